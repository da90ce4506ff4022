"""Long sequences: what context parallelism (and sequence parallelism inside tensor parallelism) takes off a rank.

A small model at a sequence length where activations dominate a rank (vocab 512, hidden 256, 8 layers, 4 heads
with 2 key/value heads, FFN 512, 4.9M parameters; sequences of 2048 tokens, micro-batch 1, fp32) trains a few
steps under each layout. Eight layers, because what a layer keeps for its backward grows with the layers while
most of attention's score-sized working tensors ([heads / tp, T / cp, T] fp32, recomputed in the backward) are alive
for one layer at a time: with two layers those would be most of a rank's activations and hide what sequence
parallelism takes off the rest.
  cp1     one process;
  cp2     two msrun workers, each holding two of the four chunks of every sequence (parallel.context_parallel=2);
  tp2     two workers, tensor parallel;
  tp2-sp  two workers, tensor parallel with parallel.sequence_parallel=true (skipped, with a message, where the
          params have no such field);
  tp4, tp4-sp  only when --layouts names them: four workers, the same with 4 key/value heads (tp4 must divide
          them), where sequence parallelism's bound is lower than at tp2.
Each layout runs twice, at 2048 tokens and at 256 (same model, same steps): a rank's activation bytes are its peak
RSS at 2048 minus its peak RSS at 256, which cancels the runtime, the compiled graph's fixed part, the weights and
the optimizer (the same in both runs). Every rank's peak RSS and tokens/s (median over the steps after the first,
which compiles) are printed, with `llmflow plan`'s CPU estimate of the busiest rank's peak.

    flock /tmp/cpu.lock python benchmarks/long_context.py [--layouts cp1,cp2,tp2,tp2-sp,tp4,tp4-sp] [--steps 4]

Beside the RSS figures, the same difference of each rank's MindSpore memory pool peak (`_memory_pool.py`): the
activations an accelerator's memory would hold, without the host memory that RSS also holds and that grows with
the sequence too (the CPU kernels' own buffers, the free heap glibc keeps).

The last line is one JSON object: `cp2_activation_ratio` (a cp2 rank's activation bytes over cp1's; issue 35's
target <= 0.6), `sp_activation_ratio` (tp2-sp over tp2; target <= 0.75; null when tp2-sp was skipped), `sp_activation_ratio_tp4`
(tp4-sp over tp4; null unless both ran), `cp2_device_activation_ratio`, `sp_device_activation_ratio` and
`sp_device_activation_ratio_tp4` (the same over the pool differences),
`planner_error` (the largest relative error of the planner's peak against the measured peak RSS over the layouts
at 2048 tokens; target <= 0.10), and the per-layout figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _memory_pool import pool_peaks, record_pool_peaks  # noqa: E402  (beside this file)

LONG, SHORT = 2048, 256
MODEL = [
    "model.vocab_size=512", "model.hidden_size=256", "model.num_layers=8", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=512", "model.tie_embeddings=true",
]
RUN = ["train.micro_batch_size=1", "train.log_interval=1", "train.eval_interval=100000",
       "train.checkpoint_interval=100000", "train.reset_at_document_boundaries=true", "optimizer.warmup_steps=1"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {  # name -> (workers, params overrides)
    "cp1": (1, []),
    "cp2": (2, ["parallel.context_parallel=2"]),
    "tp2": (2, ["parallel.tensor_parallel=2"]),
    "tp2-sp": (2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),
    # Optional (--layouts): tp4 needs 4 key/value heads, so this pair's model has 4 (everything else the same).
    "tp4": (4, ["parallel.tensor_parallel=4", "model.num_kv_heads=4"]),
    "tp4-sp": (4, ["parallel.tensor_parallel=4", "model.num_kv_heads=4", "parallel.sequence_parallel=true"]),
}
DEFAULT_LAYOUTS = ("cp1", "cp2", "tp2", "tp2-sp")
# Stdlib modules whose docstrings make the corpus (a few hundred KB of real text): enough rows of 2048 tokens.
CORPUS_MODULES = ("argparse", "textwrap", "json", "pathlib", "functools", "collections", "csv", "string", "typing",
                  "dataclasses", "inspect", "logging", "subprocess", "unittest", "email", "http.client")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated subset of " + ", ".join(LAYOUTS))
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.FIELD=VALUE",
                        help="params override for every layout and both lengths, e.g. recompute.mode=all")
    # internal: one process of one run; a name msrun's own parser does not match by prefix
    parser.add_argument("--long-context-worker", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.long_context_worker:
        name, seq = args.long_context_worker.split(":")
        dataset, out = args.paths
        run_worker(name, int(seq), dataset, Path(out), args.steps, args.overrides)
        return
    names = [name for name in args.layouts.split(",") if runnable(name)]
    record_pool_peaks()
    with tempfile.TemporaryDirectory(prefix="long-context-") as workdir:
        figures = measure(Path(workdir), args.steps, names, args.overrides)
    print(f"{'layout':<8}{'rank':>5}{'peak MB':>10}{'at 256 MB':>11}{'activations MB':>16}{'tokens/s':>10}{'plan MB':>10}")
    for name, result in figures.items():
        for rank, (peak, short) in enumerate(zip(result["peak_bytes"], result["short_peak_bytes"])):
            print(f"{name:<8}{rank:>5}{peak / 1e6:>10.0f}{short / 1e6:>11.0f}{(peak - short) / 1e6:>16.0f}"
                  f"{result['tokens_per_second']:>10.0f}{result['planned_peak_bytes'] / 1e6:>10.0f}")
    summary = {
        "cp2_activation_ratio": ratio(figures, "cp2", "cp1"),
        "sp_activation_ratio": ratio(figures, "tp2-sp", "tp2"),
        "sp_activation_ratio_tp4": ratio(figures, "tp4-sp", "tp4"),
        "cp2_device_activation_ratio": ratio(figures, "cp2", "cp1", "device_activation_bytes"),
        "sp_device_activation_ratio": ratio(figures, "tp2-sp", "tp2", "device_activation_bytes"),
        "sp_device_activation_ratio_tp4": ratio(figures, "tp4-sp", "tp4", "device_activation_bytes"),
        "planner_error": round(max(abs(r["planned_peak_bytes"] / max(r["peak_bytes"]) - 1) for r in figures.values()), 3),
        "layouts": {name: {"activation_bytes": r["activation_bytes"], "peak_bytes": r["peak_bytes"],
                           "device_activation_bytes": r["device_activation_bytes"],
                           "tokens_per_second": round(r["tokens_per_second"], 1)} for name, r in figures.items()},
    }
    print(json.dumps(summary))


def runnable(name: str) -> bool:
    """Whether this checkout's params have the layout's fields; says why not on stderr."""
    from params.schema import ParallelParams

    if name.endswith("-sp") and "sequence_parallel" not in ParallelParams.model_fields:
        print("tp2-sp skipped: params have no parallel.sequence_parallel (sequence parallelism is not in this "
              "checkout)", file=sys.stderr)
        return False
    return True


def ratio(figures: dict, over: str, under: str, measured: str = "activation_bytes") -> float | None:
    if over not in figures or under not in figures or None in figures[over][measured] + figures[under][measured]:
        return None
    return round(max(figures[over][measured]) / max(figures[under][measured]), 3)


def measure(workdir: Path, steps: int, names: list[str], overrides: list[str]) -> dict[str, dict]:
    datasets = {seq: prepare(workdir / f"data-{seq}", seq) for seq in (LONG, SHORT)}
    figures = {}
    for name in names:
        long = run_layout(name, LONG, datasets[LONG], workdir / f"{name}-{LONG}", steps, overrides)
        short = run_layout(name, SHORT, datasets[SHORT], workdir / f"{name}-{SHORT}", steps, overrides)
        peaks, short_peaks = [r["peak_bytes"] for r in long], [r["peak_bytes"] for r in short]
        pools = [(a["pool_peak_bytes"], b["pool_peak_bytes"]) for a, b in zip(long, short)]
        history = long[0]["history"][1:]  # the first step compiles
        figures[name] = {
            "peak_bytes": peaks, "short_peak_bytes": short_peaks,
            "activation_bytes": [peak - base for peak, base in zip(peaks, short_peaks)],
            "device_activation_bytes": [None if None in pair else pair[0] - pair[1] for pair in pools],
            "tokens_per_second": statistics.median(record["tokens_per_second"] for record in history),
            "planned_peak_bytes": planned_peak(name, overrides),
        }
        print(f"{name}: {figures[name]}", file=sys.stderr, flush=True)
    return figures


def params_for(name: str, seq: int, extra: list[str] = ()):
    from params import load_params

    return load_params("tiny", [*MODEL, f"model.seq_len={seq}", *RUN, *LAYOUTS[name][1], *extra])


def prepare(out: Path, seq: int) -> Path:
    import importlib
    import inspect

    from model_core.data import prepare_dataset

    corpus = out.with_suffix(".jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with corpus.open("w", encoding="utf-8") as handle:
        for module_name in CORPUS_MODULES:
            module = importlib.import_module(module_name)
            for member in [module, *vars(module).values()]:
                if inspect.ismodule(member) or inspect.isclass(member) or inspect.isfunction(member):
                    doc = inspect.getdoc(member)
                    if doc and len(doc) >= 80:
                        handle.write(json.dumps({"text": doc}) + "\n")
    params = params_for("cp1", seq, [f"data.sources=[{{kind: jsonl, paths: ['{corpus}']}}]", f"data.output_dir={out}"])
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


def planned_peak(name: str, overrides: list[str]) -> int:
    """The planner's CPU estimate of the busiest rank's peak for the layout at LONG tokens."""
    from model_core.parallel.planner import CPU, Candidate, estimate

    params = params_for(name, LONG, overrides)
    parallel = params.parallel
    candidate = Candidate(parallel.data_parallel, parallel.tensor_parallel, parallel.pipeline_parallel,
                          parallel.zero_stage, params.recompute.mode, cp=parallel.context_parallel)
    return estimate(params, candidate, 2**40, CPU).memory.total


def run_layout(name: str, seq: int, dataset: Path, out: Path, steps: int, overrides: list[str]) -> list[dict]:
    """Each rank's report of one run."""
    workers = LAYOUTS[name][0]
    command = [str(Path(__file__)), "--long-context-worker", f"{name}:{seq}", "--steps", str(steps),
               *(item for override in overrides for item in ("--set", override)), str(dataset), str(out)]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if workers == 1:
        with open(logs / "worker_0.log", "w") as log:
            finished = subprocess.run([sys.executable, *command], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        if finished.returncode != 0:
            raise SystemExit(f"{name} at {seq} tokens failed (exit {finished.returncode}); its output: "
                             f"{logs / 'worker_0.log'}")
    else:
        from model_core.parallel.launch import launch

        with open(out.with_suffix(".log"), "w") as echo:
            launch(command, workers, logs, echo=echo)
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(workers)]
    for report, peak in zip(reports, pool_peaks(logs, workers)):
        report["pool_peak_bytes"] = peak
    return reports


def run_worker(name: str, seq: int, dataset: str, out: Path, steps: int, overrides: list[str]) -> None:
    import mindspore as ms

    from model_core.train.system import peak_rss_bytes
    from model_core.train.trainer import Trainer

    ms.device_context.cpu.op_tuning.threads_num(1)  # as msrun's workers run (OMP_NUM_THREADS=1)
    trainer = Trainer(params_for(name, seq, [*overrides, f"train.steps={steps}"]), dataset, out / "checkpoints")
    trainer.save = lambda: None  # a checkpoint is not part of a step
    trainer.evaluate = lambda: float("nan")
    history = trainer.run().history
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.rank}.json").write_text(json.dumps({"history": history, "peak_bytes": peak_rss_bytes()}))


if __name__ == "__main__":
    main()
