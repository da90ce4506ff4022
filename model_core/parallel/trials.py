"""Layout trials: run the planner's candidate layouts for a few steps each and measure them, since the plan
says what fits but not what is fastest (collectives, pipeline bubbles and tensor-parallel traffic cost what
this machine makes them cost). `llmflow plan --try STEPS` prints the table and writes the fastest.

One trial per (dp, tp, pp) of the plan with a layout that fits: the planner's preferred ZeRO stage and
recompute for those degrees. Every trial keeps the params' micro-batch (the one the plan estimated) and their
global batch, by setting train.grad_accum_steps, so the layout written trains the same run (params/identity.py:
a layout changes how fast, not what); degrees that cannot keep the global batch are listed with the reason,
and when none can (or none fits) `nothing_to_try` says so before anything is prepared or launched.
A trial is `llmflow train` of `steps` steps under msrun with a metrics record every step: its tokens/s is the
median over the steps after the first (which compiles the step), its peak memory each rank's own (every rank
leaves it beside the checkpoints), the busiest one shown beside the planner's estimate for the busiest rank.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from model_core.parallel.launch import RANK_MEMORY, LaunchError, launch_training
from model_core.parallel.planner import GIB, Estimate, Plan
from model_core.storage import write_file
from model_core.tables import fixed_width
from params.loading import to_yaml
from params.schema import PipelineParams


@dataclass(frozen=True)
class LayoutTrial:
    """One candidate: its plan estimate, its params (None when it cannot keep the global batch), and what the
    short run measured, or why it has no measurement."""

    estimate: Estimate
    params: PipelineParams | None
    tokens_per_second: float | None = None
    rank_peak_bytes: tuple[int, ...] = ()  # each rank's peak memory, rank 0 first
    problem: str | None = None

    @property
    def peak_memory_bytes(self) -> int | None:
        """The busiest rank's peak."""
        return max(self.rank_peak_bytes) if self.rank_peak_bytes else None


def layout_params(params: PipelineParams, estimate: Estimate) -> PipelineParams:
    """`params` under the candidate's layout with the same micro-batch and global batch; ValueError if the
    global batch does not split into the candidate's data-parallel replicas."""
    c = estimate.candidate
    per_pass = _sequences_per_pass(params, c.dp)
    accumulation, left = divmod(params.global_batch_size, per_pass)
    if left or accumulation < 1:
        raise ValueError(
            f"the global batch of {params.global_batch_size} sequences is not a multiple of dp={c.dp} x "
            f"train.micro_batch_size={params.train.micro_batch_size} x parallel.micro_batches="
            f"{params.parallel.micro_batches} = {per_pass}"
        )
    raw = params.model_dump(mode="json")
    raw["parallel"].update(data_parallel=c.dp, tensor_parallel=c.tp, pipeline_parallel=c.pp, pipeline_layers=None,
                           context_parallel=c.cp,
                           zero_stage=c.zero_stage, optimizer_offload=c.offload,
                           param_offload=c.param_offload)
    raw["recompute"] = {"mode": c.recompute}
    raw["train"]["grad_accum_steps"] = accumulation
    return PipelineParams.model_validate(raw)


def _sequences_per_pass(params: PipelineParams, dp: int) -> int:
    """Sequences one pass over every replica's micro-batches takes: the unit a global batch splits into."""
    return params.train.micro_batch_size * params.parallel.micro_batches * dp


def nothing_to_try(params: PipelineParams, plan: Plan) -> str | None:
    """Why no candidate can run `params` (none fits, or none keeps the global batch), or None when one can: known
    before anything is prepared or launched, so `plan --try` refuses then, with the numbers."""
    found = candidates_to_try(plan)
    if not found:
        return (f"no layout of {plan.devices} devices fits their memory (the plan above says what each needs), so "
                "there is no layout to try; more --devices or --device-memory would give some")
    batch = params.global_batch_size
    passes = {dp: _sequences_per_pass(params, dp) for dp in sorted({estimate.candidate.dp for estimate in found})}
    if any(batch % per_pass == 0 for per_pass in passes.values()):
        return None
    # The smallest change that keeps the micro-batch: more accumulation steps, until a pass of some dp divides it.
    per_step = batch // params.train.grad_accum_steps
    accumulation = min(math.lcm(per_step, per_pass) // per_step for per_pass in passes.values())
    each = ", ".join(f"{per_pass} under dp={dp}" for dp, per_pass in passes.items())
    return (
        f"no layout that fits keeps the global batch of {batch} sequences: a pass of dp x train.micro_batch_size="
        f"{params.train.micro_batch_size} x parallel.micro_batches={params.parallel.micro_batches} takes {each}, and "
        f"{batch} is not a multiple of {'it' if len(passes) == 1 else 'any'}; train.grad_accum_steps={accumulation} "
        f"(a global batch of {per_step * accumulation}) would split, or try other --devices"
    )


def candidates_to_try(plan: Plan) -> list[Estimate]:
    """The plan's most preferred fitting estimate of each (dp, cp, tp, pp), in order of preference."""
    chosen: dict[tuple[int, int, int, int], Estimate] = {}
    for found in plan.estimates:
        degrees = (found.candidate.dp, found.candidate.cp, found.candidate.tp, found.candidate.pp)
        if plan.advisable(found) and degrees not in chosen:
            chosen[degrees] = found
    return list(chosen.values())


def run_trials(params: PipelineParams, plan: Plan, steps: int, workdir: Path, echo: TextIO) -> list[LayoutTrial]:
    """Each candidate of `candidates_to_try` trained for `steps` (at least 2) steps under msrun in `workdir/<layout>`; the
    prepared dataset must already be there (the ranks reuse it). A failed trial (out of memory, a dead rank)
    is kept with its reason, and the others still run."""
    trials = []
    for found in candidates_to_try(plan):
        try:
            layout = layout_params(params, found)
        except ValueError as error:
            trials.append(LayoutTrial(found, None, problem=str(error)))
            continue
        name = str(found.candidate).replace(" ", "-").replace("=", "-")
        trial = _measure(layout, found, steps, workdir / name, echo)
        print(f"{found.candidate}: {_describe(trial)}", file=echo)
        trials.append(trial)
    return trials


def _measure(layout: PipelineParams, found: Estimate, steps: int, directory: Path, echo: TextIO) -> LayoutTrial:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    cadence = {"steps": steps, "log_interval": 1, "eval_interval": steps + 1, "checkpoint_interval": steps,
               "keep_checkpoints": 1, "output_dir": str(directory)}
    short = layout.model_copy(update={"train": layout.train.model_copy(update=cadence)})
    params_file = directory / "params.yaml"
    params_file.write_text(to_yaml(short))
    metrics = directory / "metrics.jsonl"
    arguments = ["--params", str(params_file), "--checkpoint-dir", str(directory / "checkpoints"),
                 "--resume", "none", "--metrics-jsonl", str(metrics)]
    with (directory / "console.log").open("w") as console:  # rank 0's progress, kept out of the table
        try:
            launch_training(short, arguments, directory / "logs", echo=console)
        except LaunchError as error:
            return LayoutTrial(found, layout, problem=str(error).splitlines()[0])
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    speeds = sorted(record["tokens_per_second"] for record in records if record["step"] > 1)
    if not speeds:
        return LayoutTrial(found, layout, problem=f"no metrics after step 1 in {metrics}")
    peaks = _rank_peaks(directory / "checkpoints", layout.parallel.world_size)
    if peaks is None:
        return LayoutTrial(found, layout, problem=f"not every rank left its peak memory in {directory / 'checkpoints'}")
    return LayoutTrial(found, layout, speeds[len(speeds) // 2], peaks)


def _rank_peaks(checkpoint_dir: Path, ranks: int) -> tuple[int, ...] | None:
    """Each rank's peak memory as `llmflow train` leaves it under msrun, or None if a rank's file is missing."""
    files = [checkpoint_dir / RANK_MEMORY / f"rank-{rank}.json" for rank in range(ranks)]
    if not all(path.is_file() for path in files):
        return None
    return tuple(int(json.loads(path.read_text())["peak_memory_bytes"]) for path in files)


def fastest(trials: list[LayoutTrial]) -> LayoutTrial | None:
    measured = [trial for trial in trials if trial.tokens_per_second is not None]
    return max(measured, key=lambda trial: trial.tokens_per_second, default=None)


def none_finished(trials: list[LayoutTrial], workdir: Path) -> str:
    """Why no trial gave a measurement, for a run where `nothing_to_try` found layouts to launch: the first
    launched trial's own reason, and where every trial's logs are."""
    launched = next(trial for trial in trials if trial.params is not None)
    return (f"no layout trial ran to the end ({launched.estimate.candidate}: {launched.problem}); "
            f"each trial's logs are under {workdir}/<layout>/logs")


def _describe(trial: LayoutTrial) -> str:
    if trial.tokens_per_second is None:
        return f"no measurement: {trial.problem}"
    peaks = ", ".join(f"{peak / GIB:.2f}" for peak in trial.rank_peak_bytes)
    return f"{trial.tokens_per_second:,.0f} tokens/s, peak GiB by rank {peaks}"


def format_trials_table(trials: list[LayoutTrial], steps: int) -> str:
    """One row per candidate: layout, planned GiB of the busiest rank, measured tokens/s and the busiest rank's
    measured peak; the fastest marked `*`; the reason of each candidate without a measurement below."""
    best = fastest(trials)
    header = ["", "layout", "grad_accum", "planned GiB", "tokens/s", "peak GiB (busiest rank)"]
    rows = []
    for trial in trials:
        measured = trial.tokens_per_second is not None
        rows.append([
            "*" if trial is best else "",
            str(trial.estimate.candidate),
            str(trial.params.train.grad_accum_steps) if trial.params else "-",
            f"{trial.estimate.memory.total / GIB:.2f}",
            f"{trial.tokens_per_second:.1f}" if measured else "-",
            f"{trial.peak_memory_bytes / GIB:.2f}" if measured else "-",
        ])
    lines = [f"layout trials: {steps} steps each, tokens/s the median after the first step", fixed_width([header, *rows])]
    lines += [f"{trial.estimate.candidate}: {trial.problem}" for trial in trials if trial.problem]
    return "\n".join(lines)


def write_params(params: PipelineParams, path: str | Path) -> Path:
    """The params as YAML at `path`, written to a temporary file beside it and renamed, so a reader never sees
    half a file."""
    return write_file(path, to_yaml(params))
