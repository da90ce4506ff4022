"""What each rank holds, and what building it costs: dp1, tp2, pp2, tp2 x pp2 and dp2 with ZeRO-3 on the reference
model, every layout started from the same converted checkpoint on disk, against `llmflow plan`'s estimate.

The reference model (vocab 8000, hidden 512, 8 layers, 8 heads, FFN 1376, seq 256, tied; 29.4M parameters) is
given random weights, written as a Hugging Face directory and converted with `hf_to_ms`, so every layout reads
its initial weights the way a fine-tune of a converted model does. Each rank (msrun workers for the multi-rank
layouts, benchmarks/_rank_memory_worker.py) constructs the real `Trainer` from them, runs two optimizer steps
and reports:
  build MB       peak RSS while it builds its model and loads its initial weights, minus its RSS just before;
  params MB      bytes of the Parameters `trainer.model` holds, de-duplicated by identity;
  +optim MB      those plus the Parameters `trainer.optimizer` holds (its moments);
  full MB        the largest single tensor, at its full unsharded size, of which the rank holds some part;
  build/share    build MB / (params MB + full MB): 1.0 is a rank that never held more than its share plus one
                 whole tensor (issue 14's target is <= 1.2);
  plan MB        the planner's parameters + optimizer bytes for that rank's stage (fp32 masters 4P and AdamW
                 moments 8P, each divided over dp where the layout's ZeRO stage shards it), compared like with
                 like with +optim MB;
  peak / plan peak   the rank's peak RSS over the whole run against the planner's CPU total for its stage
                 (informative: two steps of a small batch, not what the planner's constants were fitted to).

    flock /tmp/cpu.lock python benchmarks/rank_memory.py [--layouts dp1,tp2,pp2,tp2xpp2,dp2-zero3] [--steps 2]

The last line printed is one JSON object: `max_build_over_share` (over ranks and layouts), `planner_error` (the
largest relative error of the planner's parameters + optimizer bytes against the measured ones),
`planner_peak_rss_error`, and the per-rank figures keyed by layout.

`--states` measures model states against the ZeRO paper instead (Rajbhandari et al. 2020, Fig. 1): a model whose
states dominate a rank (hidden 1536, FFN 4096, 8 layers, vocab 8000, tied: 238.8M parameters, 955 MB in fp32, the
table 5.1% of them and a layer 11.9%, nearer Llama-2 7B's 3.9% and 3.0%; sequences of 32 tokens, micro-batch 1),
trained 3 steps at dp2 under each ZeRO stage, in fp32 and in the mixed precision the CPU runs (float16 compute, fp32
weights, dynamic loss scaling), every layout from the same converted checkpoint. A rank's measured model-state bytes are its peak RSS minus its RSS just before it built its
model (the runtime, the joined job and the imports are the baseline; what the step's graph and its small
activations add counts against us). Printed per rank with the planner's CPU estimate of its peak and the paper's
bytes for the stage, a P + b P / dp: fp32 16, 8 + 8/dp, 4 + 12/dp, 16/dp; mixed precision 16, 4 + 12/dp,
2 + 14/dp, 16/dp. Beside them, what the rank would hold in an accelerator's memory: every Parameter it holds
(weights, masters, gradient buffers, shard copies, moments) plus the peak of MindSpore's memory pool over the run
(fresh gradients, communication buffers, the update's temporaries, activations), which MindSpore prints at exit
(MS_DEV_RUNTIME_CONF=memory_statistics:True, set for the workers). Peak RSS also holds what on an accelerator is
host memory: the compiled graphs, the CPU kernels' own buffers and the free heap glibc keeps. The last line:
`fp32_states_over_paper` and `mixed_states_over_paper` (the worst stage's measured peak RSS states over paper
bytes; issue 32's targets 1.15 and 1.25), `fp32_device_states_over_paper` and `mixed_device_states_over_paper`
(the same with the device bytes), `planner_error` (the largest relative error of the planner's peak against the
measured peak RSS; target 0.10) and `accelerator_planner_error` (the same for the planner's accelerator count, the
`acc plan` column, against the device bytes: how well `llmflow plan` counts what a device would hold).

    flock /tmp/cpu.lock python benchmarks/rank_memory.py --states [--layouts fp32-zero1,mixed-zero2,...]

Why these proportions: on CPU each layer adds a fixed cost of compiled graph (tens of MB whatever its size) and
the backward holds a layer or two of fresh gradients and the table's, so many small layers measure the graph and
a few large ones a layer's transients as if they were a whole model's; eight layers of this shape keep both
effects near an LLM's shares, and two ranks of it (at most 6.5 GB each, mixed ZeRO-0) fit this machine. `--set`
changes the model, e.g. `--set model.num_layers=4` for the earlier model (benchmarks/README.md compares them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _memory_pool import pool_peaks, record_pool_peaks  # noqa: E402  (beside this file)

MODEL = [
    "model.vocab_size=8000", "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
    "model.num_kv_heads=8", "model.ffn_hidden_size=1376", "model.seq_len=256", "model.tie_embeddings=true",
]
# A small batch: the build, the parameters and the moments do not depend on it, and the run only has to
# create optimizer state. Pipeline layouts need micro_batches >= pp.
BATCH = ["train.micro_batch_size=2"]
PIPELINE = ["parallel.pipeline_parallel=2", "parallel.micro_batches=2"]
# layout -> (workers, threads per worker, params overrides)
LAYOUTS = {
    "dp1": (1, 2, []),
    "tp2": (2, 1, ["parallel.tensor_parallel=2"]),
    "pp2": (2, 1, PIPELINE),
    "tp2xpp2": (4, 1, ["parallel.tensor_parallel=2", *PIPELINE]),
    "dp2-zero3": (2, 1, ["parallel.data_parallel=2", "parallel.zero_stage=3"]),
}
STATES_MODEL = [
    "model.vocab_size=8000", "model.hidden_size=1536", "model.num_layers=8", "model.num_heads=12",
    "model.num_kv_heads=12", "model.ffn_hidden_size=4096", "model.seq_len=32", "model.tie_embeddings=true",
]
STATES_BATCH = ["train.micro_batch_size=1", "parallel.data_parallel=2"]
PRECISIONS = {
    "fp32": ["precision.compute_dtype=float32"],
    # A first scale that does not overflow float16 here, so every step updates (and AdamW makes its moments).
    "mixed": ["precision.compute_dtype=float16", "precision.initial_loss_scale=1024"],
}
# The ZeRO paper's model-state bytes per parameter, (a, b) for a P + b P / dp, by precision and stage.
PAPER_BYTES = {
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
    "mixed": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
}
STATES = {
    f"{precision}-zero{stage}": (2, 1, [*STATES_BATCH, *overrides, f"parallel.zero_stage={stage}"])
    for precision, overrides in PRECISIONS.items()
    for stage in range(4)
}
WORKER = Path(__file__).with_name("_rank_memory_worker.py")
MB = 1e6


def layout_params(name: str, extra: list[str] = ()):
    from params import load_params

    return load_params("tiny", layout_overrides(name, extra))


def layout_overrides(name: str, extra: list[str] = ()) -> list[str]:
    """The params overrides of layout `name`, then `extra` (--set: e.g. another model shape)."""
    if name in STATES:
        return [*STATES_MODEL, *STATES[name][2], *extra]
    return [*MODEL, *BATCH, *LAYOUTS[name][2], *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--states", action="store_true", help="model states per ZeRO stage against the ZeRO paper")
    parser.add_argument("--layouts", help="comma-separated subset of " + ", ".join(LAYOUTS) + " (with --states: of "
                        + ", ".join(STATES) + ")")
    parser.add_argument("--steps", type=int, help="optimizer steps each layout runs after building (2; --states: 3)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.FIELD=VALUE",
                        help="a params override applied to every layout after its own (e.g. model.num_layers=8)")
    parser.add_argument("--phases", action="store_true", help="also print each rank's RSS through the step's phases")
    args = parser.parse_args()
    extra = args.overrides
    runs = STATES if args.states else LAYOUTS
    if args.states:
        record_pool_peaks()
    names = args.layouts.split(",") if args.layouts else list(runs)
    steps = args.steps or (3 if args.states else 2)
    unknown = sorted(set(names) - set(runs))
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(runs)}")
    with tempfile.TemporaryDirectory(prefix="rank-memory-") as workdir:
        workdir = Path(workdir)
        first = names[0]
        dataset = prepare_data(workdir / "data", first, extra)
        weights = write_converted_checkpoint(workdir, first, extra)
        ranks = {name: run_layout(name, dataset, weights, workdir / name, steps, extra) for name in names}
    if args.phases:
        print_phases(ranks)
    if args.states:
        for name, reports in ranks.items():
            for report in reports:
                add_state_figures(name, report, extra)
        print_states_table(ranks)
        print(json.dumps(states_summary(ranks)))
        return
    for name, reports in ranks.items():
        for report in reports:
            add_planner_figures(name, report, extra)
    print_table(ranks)
    print(json.dumps(summary(ranks)))


def prepare_data(out: Path, name: str, extra: list[str]) -> Path:
    """The tiny preset's corpus (the standard library's docstrings) tokenised for the model of layout `name`."""
    from model_core.data import prepare_dataset

    params = layout_params(name, [*extra, f"data.output_dir={out}"])
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


def write_converted_checkpoint(workdir: Path, name: str, extra: list[str]) -> Path:
    """A randomly initialised Hugging Face Llama of layout `name`'s shape, converted as `llmflow convert hf-to-ms`
    converts one: the directory every layout's `initial_weights` reads."""
    import numpy as np
    from safetensors.numpy import save_file

    from model_core.convert import hf_to_ms
    from model_core.convert.llama import hf_config, tensor_names

    model = layout_params(name, extra).model
    generator = np.random.default_rng(0)
    state = {}
    for theirs, shape in tensor_names(model).values():
        # Norm weights are vectors of ones in a fresh model; everything else is N(0, 0.02), as HF initialises.
        random = generator.normal(0, 0.02, shape).astype(np.float32)
        state[theirs] = np.ones(shape, np.float32) if len(shape) == 1 else random
    hf = workdir / "hf"
    hf.mkdir()
    save_file(state, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(hf_config(model)))
    return hf_to_ms(hf, workdir / "converted", seq_len=model.seq_len).path


def run_layout(name: str, dataset: Path, weights: Path, out: Path, steps: int, extra: list[str]) -> list[dict]:
    """Every rank's report of one layout, in rank order."""
    workers, threads, _ = STATES[name] if name in STATES else LAYOUTS[name]
    out.mkdir(parents=True)
    command = [str(WORKER), "--threads", str(threads), "--steps", str(steps), str(dataset), str(weights), str(out)]
    command += [item for override in layout_overrides(name, extra) for item in ("--set", override)]
    if workers == 1:
        subprocess.run([sys.executable, *command], check=True, cwd=REPO)
    else:
        from model_core.parallel.launch import launch

        with open(out / "rank0.log", "w") as echo:
            launch(command, workers, out / "logs", echo=echo)
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(workers)]
    if name in STATES:
        for report, peak in zip(reports, pool_peaks(out / "logs", workers)):
            report["pool_peak_bytes"] = peak
    print(f"{name}: {len(reports)} rank(s) measured", file=sys.stderr, flush=True)
    return reports


def add_planner_figures(name: str, report: dict, extra: list[str]) -> None:
    """The planner's per-rank estimate for this rank's pipeline stage, from its pure-Python API."""
    from model_core.parallel.planner import CPU, Candidate, stage_memory

    params = layout_params(name, extra)
    parallel = params.parallel
    candidate = Candidate(
        parallel.data_parallel, parallel.tensor_parallel, parallel.pipeline_parallel, parallel.zero_stage, "none"
    )
    on_cpu = stage_memory(params, candidate, report["stage"], CPU, CPU.runtime_bytes)
    # Like with like: the planner's `parameters` (fp32 masters; no compute-dtype copies in fp32) and `optimizer`
    # (AdamW m and v) are what trainer.model and trainer.optimizer hold; its gradients, activations, buffers and
    # runtime are not Parameters of either and are left out of this comparison.
    report["planned_param_optimizer_bytes"] = on_cpu.parameters + on_cpu.optimizer
    report["planned_peak_rss_bytes"] = on_cpu.total


def add_state_figures(name: str, report: dict, extra: list[str]) -> None:
    """The paper's model-state bytes for this run's stage and precision, and the planner's CPU estimate of the peak."""
    from model_core.parallel.planner import ACCELERATOR, CPU, Candidate, stage_memory, stage_parameters

    params = layout_params(name, extra)
    parallel = params.parallel
    precision, stage = name.split("-zero")
    a, b = PAPER_BYTES[precision][int(stage)]
    parameters = stage_parameters(params.model, 1, 1, 0)
    report["parameters"] = parameters
    report["paper_state_bytes"] = a * parameters + b * parameters / parallel.data_parallel
    report["state_bytes"] = report["peak_rss_bytes"] - report["rss_before_bytes"]
    pool = report.get("pool_peak_bytes")
    report["device_state_bytes"] = None if pool is None else report["every_parameter_bytes"] + pool
    candidate = Candidate(parallel.data_parallel, 1, 1, parallel.zero_stage, "none")
    report["planned_peak_rss_bytes"] = stage_memory(params, candidate, 0, CPU, CPU.runtime_bytes).total
    report["accelerator_plan_bytes"] = stage_memory(params, candidate, 0, ACCELERATOR, 0).total


def print_states_table(ranks: dict[str, list[dict]]) -> None:
    header = ["run", "rank", "skipped", "before", "peak", "plan peak", "error", "states", "paper", "states/paper",
              "bytes/P", "parameters", "pool", "device", "device/paper", "acc plan", "acc error"]
    print("MB (10^6 bytes) per rank; states = peak RSS - RSS before the model was built; device = every Parameter "
          "the rank holds + the peak of MindSpore's memory pool")
    print("".join(f"{cell:>13}" for cell in header))
    for name, reports in ranks.items():
        for r in reports:
            cells = [
                name, r["rank"], r["skipped_steps"], f"{r['rss_before_bytes'] / MB:.0f}", f"{r['peak_rss_bytes'] / MB:.0f}",
                f"{r['planned_peak_rss_bytes'] / MB:.0f}", f"{relative_error(r['planned_peak_rss_bytes'], r['peak_rss_bytes']):.3f}",
                f"{r['state_bytes'] / MB:.0f}", f"{r['paper_state_bytes'] / MB:.0f}",
                f"{r['state_bytes'] / r['paper_state_bytes']:.2f}", f"{r['state_bytes'] / r['parameters']:.1f}",
                f"{r['every_parameter_bytes'] / MB:.0f}",
            ]
            device = r["device_state_bytes"]
            cells += ["-", "-", "-", "-", "-"] if device is None else [
                f"{r['pool_peak_bytes'] / MB:.0f}", f"{device / MB:.0f}", f"{device / r['paper_state_bytes']:.2f}",
                f"{r['accelerator_plan_bytes'] / MB:.0f}", f"{relative_error(r['accelerator_plan_bytes'], device):.3f}"]
            print("".join(f"{cell:>13}" for cell in cells))


def print_phases(ranks: dict[str, list[dict]]) -> None:
    """Each rank's RSS through its run: after the Trainer was built, then each phase call's peak and what it left."""
    print("MB (10^6 bytes): RSS after the Trainer was built, then per phase call: peak / RSS after / glibc heap in "
          "use / free heap glibc kept; at the end RSS, anonymous, and RSS after malloc_trim(0)")
    for name, reports in ranks.items():
        for r in reports:
            built = r["after_trainer_built"]
            cells = [f"{name} rank {r['rank']}: before build {r['rss_before_bytes'] / MB:.0f}",
                     f"build peak {r['build_peak_bytes'] / MB:.0f}",
                     f"built {built['rss_bytes'] / MB:.0f} (heap {built['heap_in_use_bytes'] / MB:.0f}"
                     f" + free {built['heap_free_kept_bytes'] / MB:.0f})"]
            cells += [f"{p['phase']} {p['peak_bytes'] / MB:.0f}/{p['rss_after_bytes'] / MB:.0f}/"
                      f"{p['heap_in_use_bytes'] / MB:.0f}/{p['heap_free_kept_bytes'] / MB:.0f}" for p in r["phases"]]
            end = r["at_end"]
            cells.append(f"end {end['rss_bytes'] / MB:.0f} anon {end['anonymous_bytes'] / MB:.0f} "
                         f"trimmed {end['rss_after_malloc_trim_bytes'] / MB:.0f}")
            print("; ".join(cells))


def states_summary(ranks: dict[str, list[dict]]) -> dict:
    def worst(precision: str, measured: str = "state_bytes") -> float | None:
        ratios = [None if r[measured] is None else r[measured] / r["paper_state_bytes"]
                  for name, reports in ranks.items() if name.startswith(precision) for r in reports]
        if not ratios or None in ratios:
            return None
        return round(max(ratios), 3)

    every = [report for reports in ranks.values() for report in reports]
    return {
        "fp32_states_over_paper": worst("fp32"),
        "mixed_states_over_paper": worst("mixed"),
        "fp32_device_states_over_paper": worst("fp32", "device_state_bytes"),
        "mixed_device_states_over_paper": worst("mixed", "device_state_bytes"),
        "planner_error": round(max(relative_error(r["planned_peak_rss_bytes"], r["peak_rss_bytes"]) for r in every), 3),
        "accelerator_planner_error": None if any(r["device_state_bytes"] is None for r in every) else round(
            max(relative_error(r["accelerator_plan_bytes"], r["device_state_bytes"]) for r in every), 3),
        "runs": ranks,
    }


def relative_error(estimate: float, measured: float) -> float:
    return abs(estimate - measured) / measured


def print_table(ranks: dict[str, list[dict]]) -> None:
    header = ["layout", "rank", "stage", "before", "build", "params", "+optim", "full", "build/share", "plan", "error",
              "peak", "plan peak"]
    print("MB (10^6 bytes) per rank; build = peak RSS while building and loading - RSS before")
    print("".join(f"{cell:>12}" for cell in header))
    for name, reports in ranks.items():
        for r in reports:
            held = r["param_bytes"] + r["optimizer_bytes"]
            cells = [
                name, r["rank"], r["stage"], f"{r['rss_before_bytes'] / MB:.0f}", f"{r['build_bytes'] / MB:.0f}",
                f"{r['param_bytes'] / MB:.1f}", f"{held / MB:.1f}", f"{r['largest_full_tensor_bytes'] / MB:.1f}",
                f"{build_over_share(r):.2f}", f"{r['planned_param_optimizer_bytes'] / MB:.1f}",
                f"{relative_error(r['planned_param_optimizer_bytes'], held):.1e}", f"{r['peak_rss_bytes'] / MB:.0f}",
                f"{r['planned_peak_rss_bytes'] / MB:.0f}",
            ]
            print("".join(f"{cell:>12}" for cell in cells))


def build_over_share(report: dict) -> float:
    return report["build_bytes"] / (report["param_bytes"] + report["largest_full_tensor_bytes"])


def summary(ranks: dict[str, list[dict]]) -> dict:
    every = [report for reports in ranks.values() for report in reports]
    return {
        "max_build_over_share": round(max(build_over_share(r) for r in every), 3),
        "planner_error": max(
            relative_error(r["planned_param_optimizer_bytes"], r["param_bytes"] + r["optimizer_bytes"]) for r in every
        ),
        "planner_peak_rss_error": round(
            max(relative_error(r["planned_peak_rss_bytes"], r["peak_rss_bytes"]) for r in every), 3
        ),
        "layouts": {
            name: [{**report, "build_over_share": round(build_over_share(report), 3)} for report in reports]
            for name, reports in ranks.items()
        },
    }


if __name__ == "__main__":
    main()
