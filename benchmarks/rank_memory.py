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
WORKER = Path(__file__).with_name("_rank_memory_worker.py")
MB = 1e6


def layout_params(name: str, extra: list[str] = ()):
    from params import load_params

    return load_params("tiny", [*MODEL, *BATCH, *LAYOUTS[name][2], *extra])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ", ".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps each layout runs after building")
    args = parser.parse_args()
    names = args.layouts.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="rank-memory-") as workdir:
        workdir = Path(workdir)
        dataset = prepare_data(workdir / "data")
        weights = write_converted_checkpoint(workdir)
        ranks = {name: run_layout(name, dataset, weights, workdir / name, args.steps) for name in names}
    for name, reports in ranks.items():
        for report in reports:
            add_planner_figures(name, report)
    print_table(ranks)
    print(json.dumps(summary(ranks)))


def prepare_data(out: Path) -> Path:
    """The tiny preset's corpus (the standard library's docstrings) tokenised for the reference model."""
    from model_core.data import prepare_dataset

    params = layout_params("dp1", [f"data.output_dir={out}"])
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


def write_converted_checkpoint(workdir: Path) -> Path:
    """A randomly initialised Hugging Face Llama of the reference shape, converted as `llmflow convert hf-to-ms`
    converts one: the directory every layout's `initial_weights` reads."""
    import numpy as np
    from safetensors.numpy import save_file

    from model_core.convert import hf_to_ms
    from model_core.convert.llama import hf_config, tensor_names

    model = layout_params("dp1").model
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


def run_layout(name: str, dataset: Path, weights: Path, out: Path, steps: int) -> list[dict]:
    """Every rank's report of one layout, in rank order."""
    workers, threads, overrides = LAYOUTS[name]
    out.mkdir(parents=True)
    command = [str(WORKER), "--threads", str(threads), "--steps", str(steps), str(dataset), str(weights), str(out)]
    command += [item for override in [*MODEL, *BATCH, *overrides] for item in ("--set", override)]
    if workers == 1:
        subprocess.run([sys.executable, *command], check=True, cwd=REPO)
    else:
        from model_core.parallel.launch import launch

        with open(out / "rank0.log", "w") as echo:
            launch(command, workers, out / "logs", echo=echo)
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(workers)]
    print(f"{name}: {len(reports)} rank(s) measured", file=sys.stderr, flush=True)
    return reports


def add_planner_figures(name: str, report: dict) -> None:
    """The planner's per-rank estimate for this rank's pipeline stage, from its pure-Python API."""
    from model_core.parallel.planner import CPU, Candidate, stage_memory

    params = layout_params(name)
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
