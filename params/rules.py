"""The rule book: whether params describe a run that can happen, decided once, before anything runs.

Every rule about what a layout may do lives here: the arithmetic of the degrees (dp x cp x tp x pp against the
world, tp against heads, key/value heads, FFN width and vocabulary, pp against the layers, micro-batches against the
stages, ep against dp and the experts, 2 x cp against the sequence, sequence-parallel tp against the sequence), the
feature combinations not built (ZeRO-3, context or sequence parallelism with mixture-of-experts blocks, sequence
parallelism with context parallelism, optimizer offload under expert parallelism, parameter offload with pipeline
stages or a LoRA fine-tune), and what the data sources' weights and epochs may be. A refusal is one line naming
both settings and both values.

It lives in params/ and imports no MindSpore, so the CLI judges a run in milliseconds and every layer may ask:
the schema's validators apply the rules that hold whatever a run does (so a file, a `--set` or a Prefect
parameter that breaks one is refused where it is read, with its line), the entry points call `check_run` with
what only they know (the world the run gets, whether it fine-tunes) before data prep, conversion or launch, and
model_core's `Layout` and `parallelize` call the same functions on the ranks for callers that skip the CLI.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema's validators call this module: a runtime import would be circular
    from params.schema import DataSource, ModelParams, ParallelParams, PipelineParams

# How far the weights of a mixture whose every source has one may sum from 1 (they are then scaled to 1 exactly).
WEIGHT_SUM_TOLERANCE = 1e-3


class ParallelConfigError(ValueError):
    """A run that cannot happen; the message names the settings and the numbers that disagree."""


def check_run(params: PipelineParams, *, world_size: int | None = None, finetunes: bool = False) -> None:
    """Refuse params that describe no run that can happen, naming the first problem, and warn (once per process and
    message) of settings that have no effect under the layout. `world_size`: the ranks the run gets, when the caller
    knows (a launched rank); `finetunes`: whether the run trains LoRA adapters (the pipeline with lora.enabled,
    `llmflow finetune`)."""
    problems = run_problems(params, world_size=world_size, finetunes=finetunes)
    if problems:
        raise ParallelConfigError(problems[0])
    for warning in run_warnings(params):
        warnings.warn(warning, LayoutWarning, stacklevel=2)


class LayoutWarning(UserWarning):
    """A setting the layout leaves without effect; the run goes ahead."""


def run_warnings(params: PipelineParams) -> list[str]:
    """Settings that do nothing under this layout. Sequence parallelism splits the sequence over the tp group, so
    with tensor_parallel=1 there is nothing to split. It is a warning, not a refusal: one params file runs under
    several layouts (`llmflow plan --try`, layout trials, a resume resharded to another tp), and a long-context preset
    should keep sequence_parallel on wherever tp > 1 without being refused at tp=1."""
    parallel = params.parallel
    if parallel.sequence_parallel and parallel.tensor_parallel == 1:
        return [
            "parallel.sequence_parallel=true with parallel.tensor_parallel=1: there is no tp group to split the "
            "sequence over, so it changes nothing"
        ]
    return []


def run_problems(params: PipelineParams, *, world_size: int | None = None, finetunes: bool = False) -> list[str]:
    """Every reason `check_run` would refuse, in the order it checks them (empty when the run can happen)."""
    parallel = params.parallel
    problems = parallel_problems(parallel) + layout_problems(params.model, parallel)
    if world_size is not None and world_size != parallel.world_size:
        problems.append(
            f"parallel.data_parallel={parallel.data_parallel} x "
            + (f"context_parallel={parallel.context_parallel} x " if parallel.context_parallel > 1 else "")
            + f"tensor_parallel={parallel.tensor_parallel} x "
            f"pipeline_parallel={parallel.pipeline_parallel} = {parallel.world_size} ranks, but the world has {world_size}"
        )
    if finetunes and parallel.param_offload:
        problems.append(
            "parallel.param_offload=true with LoRA fine-tuning (lora.enabled=true, or `llmflow finetune`): parameter "
            "offload runs without LoRA (its frozen weights have no gradient buffers to stand in for the offloaded shards); "
            "set lora.enabled=false or parallel.param_offload=false"
        )
    return problems


def parallel_problems(parallel: ParallelParams) -> list[str]:
    """What the parallel section alone rules out."""
    problems = degree_problems(
        parallel.data_parallel, parallel.pipeline_parallel, parallel.expert_parallel, parallel.pipeline_layers
    )
    pp, ep = parallel.pipeline_parallel, parallel.expert_parallel
    if parallel.micro_batches < pp:
        problems.append(
            f"parallel.micro_batches={parallel.micro_batches} is fewer than parallel.pipeline_parallel={pp}; a "
            "pipeline needs at least one per stage"
        )
    if ep > 1 and parallel.optimizer_offload:
        problems.append(
            f"parallel.optimizer_offload=true with parallel.expert_parallel={ep}: the offload file holds one "
            "optimizer's moments, expert parallelism keeps two (dense over dp, experts over expert-dp)"
        )
    if parallel.param_offload:
        if parallel.zero_stage != 3 or parallel.data_parallel < 2:
            problems.append(
                f"parallel.param_offload=true needs ZeRO-3 over at least 2 ranks (the shards are what it offloads): "
                f"parallel.zero_stage={parallel.zero_stage}, parallel.data_parallel={parallel.data_parallel}"
            )
        if not parallel.optimizer_offload:
            problems.append(
                "parallel.param_offload=true needs parallel.optimizer_offload=true (the update reads the shards from "
                "the file bucket by bucket with the moments): parallel.optimizer_offload=false"
            )
        if pp > 1:
            problems.append(
                f"parallel.param_offload=true with parallel.pipeline_parallel={pp}: parameter offload runs without "
                "pipeline stages (a stage's schedule keeps its own gradient buffers)"
            )
    return problems


def degree_problems(dp: int, pp: int, ep: int, pipeline_layers: Sequence[int] | None) -> list[str]:
    """What the degrees alone rule out: ep carved out of dp, one entry of pipeline_layers per stage."""
    problems = []
    if dp % ep:
        problems.append(
            f"parallel.expert_parallel={ep} does not divide parallel.data_parallel={dp}: the expert-parallel groups "
            "are carved out of the data-parallel ranks"
        )
    if pipeline_layers is not None:
        if len(pipeline_layers) != pp:
            problems.append(
                f"parallel.pipeline_layers lists {len(pipeline_layers)} stages but parallel.pipeline_parallel={pp}"
            )
        if min(pipeline_layers, default=1) < 1:
            problems.append(f"parallel.pipeline_layers={list(pipeline_layers)}: every stage needs at least one layer")
    return problems


def layout_problems(model: ModelParams, parallel: ParallelParams) -> list[str]:
    """What the model rules out of the parallel section: its shapes against the degrees, its experts."""
    problems = [tensor_parallel_problem(parallel.tensor_parallel, model)]
    problems.append(stage_problem(parallel.pipeline_parallel, parallel.pipeline_layers, model.num_layers))
    problems += expert_problems(parallel.expert_parallel, parallel.zero_stage, model)
    problems += context_parallel_problems(parallel.context_parallel, model)
    if parallel.sequence_parallel:
        problems += sequence_parallel_problems(parallel.tensor_parallel, model, parallel.context_parallel)
    return [problem for problem in problems if problem is not None]


def context_parallel_problems(cp: int, model: ModelParams) -> list[str]:
    """Every cp rank holds two equal chunks of every sequence, so 2 x cp must divide it. A mixture-of-experts block's
    routing statistics and capacity are per sequence, which no rank holds whole: refused rather than trained wrong."""
    if cp == 1:
        return []
    problems = []
    if model.seq_len % (2 * cp):
        problems.append(
            f"model.seq_len={model.seq_len} is not a multiple of 2 x parallel.context_parallel={2 * cp}: every cp rank "
            "holds two equal chunks of each sequence"
        )
    if model.moe_layers:
        problems.append(
            f"parallel.context_parallel={cp} with model.moe ({len(model.moe_layers)} MoE blocks): context parallelism "
            "trains dense models for now"
        )
    return problems


def sequence_parallel_problems(tp: int, model: ModelParams, cp: int = 1) -> list[str]:
    """Sequence parallelism gives each tp rank an equal slice of every sequence. Mixture-of-experts blocks are not
    built for it yet: their routing (capacity, balancing loss) is over the whole micro-batch's tokens, so routing
    each rank's slice would train another model than tp alone does."""
    if tp == 1:
        return []
    problems = []
    if cp > 1:  # not built: the slices of a cp rank's two chunks, and their RoPE positions, are untested
        problems.append(
            f"parallel.sequence_parallel=true with parallel.context_parallel={cp}: sequence parallelism runs "
            "without context parallelism for now; set parallel.sequence_parallel=false"
        )
    if model.seq_len % tp:
        problems.append(
            f"parallel.sequence_parallel=true: parallel.tensor_parallel={tp} does not divide model.seq_len="
            f"{model.seq_len} into equal slices of the sequence"
        )
    if model.moe_layers:
        problems.append(
            f"parallel.sequence_parallel=true with model.moe ({len(model.moe_layers)} MoE blocks): sequence "
            "parallelism runs dense models for now; set parallel.sequence_parallel=false"
        )
    return problems


def check_sequence_parallel(tp: int, model: ModelParams) -> None:
    """`sequence_parallel_problems` as an error, for a layout chosen outside params."""
    problems = sequence_parallel_problems(tp, model)
    if problems:
        raise ParallelConfigError(problems[0])


def tensor_parallel_problem(tp: int, model: ModelParams) -> str | None:
    """Every tensor-parallel rank must get an equal block of heads, key/value heads, FFN width and vocabulary."""
    split = {
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "ffn_hidden_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
    }
    for field, value in split.items():
        if value % tp:
            hint = f" (pad it: llmflow convert hf-to-ms --tensor-parallel {tp})" if field == "vocab_size" else ""
            return f"parallel.tensor_parallel={tp} does not divide model.{field}={value}{hint}"
    return None


def check_tensor_parallel(tp: int, model: ModelParams) -> None:
    """`tensor_parallel_problem` as an error: for a layout chosen outside params (a reshard's target)."""
    problem = tensor_parallel_problem(tp, model)
    if problem is not None:
        raise ParallelConfigError(problem)


def stage_problem(pp: int, pipeline_layers: Sequence[int] | None, num_layers: int) -> str | None:
    """The stages must hold the model's layers: `pipeline_layers` summing to them, or pp equal stages."""
    if pipeline_layers is not None:
        if sum(pipeline_layers) != num_layers:
            return (
                f"parallel.pipeline_layers={list(pipeline_layers)} sum to {sum(pipeline_layers)} layers but "
                f"model.num_layers={num_layers}"
            )
        return None
    if num_layers % pp:
        return (
            f"parallel.pipeline_parallel={pp} does not divide model.num_layers={num_layers} into equal stages (or "
            "list them: parallel.pipeline_layers)"
        )
    return None


def expert_problems(ep: int, zero_stage: int, model: ModelParams) -> list[str]:
    """Expert parallelism needs experts to share out, an equal block of them per ep rank. Mixture-of-experts
    blocks train under data, tensor, pipeline and expert parallelism with ZeRO 0 to 2: ZeRO-3 does not carry the
    expert shards yet, and is refused rather than trained wrong."""
    if not model.moe_layers:
        return [f"parallel.expert_parallel={ep} but model.moe is null: no experts to share out"] if ep > 1 else []
    problems = []
    if model.moe.num_experts % ep:
        problems.append(f"parallel.expert_parallel={ep} does not divide model.moe.num_experts={model.moe.num_experts}")
    if zero_stage == 3:
        problems.append(
            f"parallel.zero_stage=3 with model.moe ({len(model.moe_layers)} MoE blocks): mixture-of-experts "
            "models train with data, tensor, pipeline and expert parallelism and ZeRO 0 to 2 for now"
        )
    return problems


def source_names(sources: Sequence[DataSource]) -> list[str]:
    """Each data source's name: its `name`, or `source<i>` by its place."""
    return [source.name or f"source{index}" for index, source in enumerate(sources)]


def mixture_problems(sources: Sequence[DataSource]) -> list[str]:
    """What the data sources' weights and epochs alone rule out (what needs the data, a weight on a source with no
    rows, is judged when training opens the dataset: model_core/data/mixture.py)."""
    names = source_names(sources)
    problems = [f"data.sources: two sources are named {name!r}" for name in sorted({n for n in names if names.count(n) > 1})]
    weighted = [(name, source.weight) for name, source in zip(names, sources) if source.weight is not None]
    total = sum(weight for _, weight in weighted)
    others = [name for name, source in zip(names, sources) if source.weight is None]
    listed = ", ".join(f"{name}={weight}" for name, weight in weighted)
    if weighted and not others and abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        problems.append(f"data.sources weights ({listed}) sum to {total:.6g}, not 1: every source has a weight, so they are its shares")
    if others and total >= 1.0:
        problems.append(
            f"data.sources weights ({listed}) sum to {total:.6g}, leaving no share for {', '.join(others)} "
            "(sources without a weight are read by epochs; weights must then sum to less than 1)"
        )
    return problems
