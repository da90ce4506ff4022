"""Training throughput of one process against two msrun workers, data-, tensor- or pipeline-parallel, on this
machine's cores.

Every layout trains the same reference-size Llama (vocab 8000, hidden 512, 8 layers, 8 heads, FFN 1376,
seq 256, tied) on the same global batch of 8 sequences (2048 tokens) with the real `Trainer`, fp32:
  dp1  one process, 2 threads;
  dp2  two workers of 1 thread, each 4 sequences, the gradient sum after the backward (the default);
       `dp2_inside`: the same, summed inside the backward graph (`parallel.overlap_gradient_reduction`);
       `dp2_zero2`: dp2 under ZeRO-2 (gradients reduced bucket by bucket into shards, the update a bucket at a time);
  tp2  two workers of 1 thread, each all 8 sequences and half of every large matrix;
  pp2  two workers of 1 thread, each 4 of the 8 layers, the 8 sequences as 4 micro-batches of 2 through
       the 1F1B schedule (`pp2_gpipe`: the same through GPipe).
tokens/s is the median over the steps after `--warmup` (the first compiles). The share of step time spent
in communication is measured, not modelled: each multi-worker layout runs a second time with every
collective replaced by the identity (same compute, no waiting on the other worker; its numbers are
meaningless, its time is the compute alone), and share = 1 - compute-only step time / real step time;
for a pipeline that share includes the stages' waiting on each other. A data-parallel layout also times its
gradient sum alone (the same buckets, summed 5 times after training, median): the communication a step
needs. What of it the step did not wait for is hidden: hidden = (compute alone + sum alone - step) / sum
alone, clamped to [0, 1]. Tensor- and pipeline-parallel collectives sit inside the forward and backward,
where the next operation needs their result, and have no separate sum to time: their share is the exposed
one. The pipeline bubble is measured too:
the trainer's `pipeline_bubble` (1 - compute time / wall time, summed over the stages, of a step's pass),
median over the timed steps, next to the lock-step model's figure for the same schedule.

    python benchmarks/parallel_scaling.py [--steps 8] [--warmup 3] [--layouts dp1,pp2,...]

The last line printed is one JSON object: tokens/s keyed by layout (`dp1`, `dp2`, `dp2_zero2`, `tp2`, `pp2`,
`pp2_gpipe`), `communication_share` per multi-worker layout but `dp2_zero2`, per data-parallel layout `communication_seconds` (the gradient
sum alone) and `hidden_share`, and per pipeline layout `pipeline_bubble` and
`pipeline_sent_bytes` (what rank 0's stage sent its neighbour in a step's pass: each message goes only to the
rank that needs it).
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

MODEL = [
    "model.vocab_size=8000", "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
    "model.num_kv_heads=8", "model.ffn_hidden_size=1376", "model.seq_len=256", "model.tie_embeddings=true",
]
# layout -> (workers, threads per worker, params overrides); every one trains on 8 sequences a step
LAYOUTS = {
    "dp1": (1, 2, ["train.micro_batch_size=8"]),
    "dp2": (2, 1, ["train.micro_batch_size=4", "parallel.data_parallel=2"]),
    "dp2_inside": (2, 1, ["train.micro_batch_size=4", "parallel.data_parallel=2",
                          "parallel.overlap_gradient_reduction=true"]),
    "dp2_zero2": (2, 1, ["train.micro_batch_size=4", "parallel.data_parallel=2", "parallel.zero_stage=2"]),
    "tp2": (2, 1, ["train.micro_batch_size=8", "parallel.tensor_parallel=2"]),
    "pp2": (2, 1, ["train.micro_batch_size=2", "parallel.pipeline_parallel=2", "parallel.micro_batches=4"]),
    "pp2_gpipe": (2, 1, ["train.micro_batch_size=2", "parallel.pipeline_parallel=2", "parallel.micro_batches=4",
                         "parallel.pipeline_schedule=gpipe"]),
}

# Layouts whose collectives change shapes (ZeRO-2 reduces into and gathers from shards): an identity cannot stand in
# for them, so they have no compute-only rerun and no communication share.
RESHAPING_COLLECTIVES = {"dp2_zero2"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (compilation)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ", ".join(LAYOUTS))
    # internal: one process of one layout. Named so that msrun's own parser, which reads the worker's
    # arguments too, matches none of its options by prefix (`--worker` would).
    parser.add_argument("--layout-worker", help=argparse.SUPPRESS)
    parser.add_argument("--no-communication", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout_worker:
        dataset, out = args.paths
        run_worker(args.layout_worker, dataset, Path(out), args.steps, args.no_communication)
        return
    with tempfile.TemporaryDirectory(prefix="parallel-scaling-") as workdir:
        figures = measure(Path(workdir), args.steps, args.warmup, args.layouts.split(","))
    print(f"{'layout':<10}{'tokens/s':>10}{'step s':>9}{'communication':>15}{'sum s':>8}{'hidden':>8}"
          f"{'bubble':>9}{'modelled':>10}{'sent MB':>9}")
    for name, result in figures.items():
        share, bubble = result.get("communication_share"), result.get("pipeline_bubble")
        cells = [f"{name:<10}{result['tokens_per_second']:>10.0f}{result['step_seconds']:>9.2f}"]
        cells.append(f"{'' if share is None else f'{share:.0%}':>15}")
        alone, hidden = result.get("communication_seconds"), result.get("hidden_share")
        cells.append(f"{'' if alone is None else f'{alone:.3f}':>8}{'' if hidden is None else f'{hidden:.0%}':>8}")
        if bubble is not None:
            cells.append(f"{bubble:>9.0%}{result['modelled_bubble']:>10.0%}{result['pipeline_sent_bytes'] / 1e6:>9.2f}")
        print("".join(cells))
    summary = {name: round(result["tokens_per_second"], 1) for name, result in figures.items()}
    summary["communication_share"] = {n: round(r["communication_share"], 3) for n, r in figures.items() if "communication_share" in r}
    for key, digits in (("communication_seconds", 4), ("hidden_share", 3)):
        summary[key] = {n: round(r[key], digits) for n, r in figures.items() if key in r}
    summary["pipeline_bubble"] = {n: round(r["pipeline_bubble"], 3) for n, r in figures.items() if "pipeline_bubble" in r}
    summary["pipeline_sent_bytes"] = {n: r["pipeline_sent_bytes"] for n, r in figures.items() if "pipeline_sent_bytes" in r}
    print(json.dumps(summary))


def measure(workdir: Path, steps: int, warmup: int, names: list[str]) -> dict[str, dict]:
    from model_core.data import prepare_dataset
    from params import load_params

    params = load_params("tiny", [*MODEL, f"data.output_dir={workdir / 'data'}"])
    dataset = prepare_dataset(params.data, params.tokenizer, params.model).output_dir
    figures = {}
    for name in names:
        workers = LAYOUTS[name][0]
        history = run_layout(name, workers, dataset, workdir / name, steps, False)
        step_seconds = median_step_seconds(history, warmup)
        figures[name] = {"tokens_per_second": 2048 / step_seconds, "step_seconds": step_seconds}
        if "pipeline_bubble" in history[-1]:
            figures[name]["pipeline_bubble"] = statistics.median(r["pipeline_bubble"] for r in history[warmup:])
            figures[name]["modelled_bubble"] = modelled_bubble(name)
            figures[name]["pipeline_sent_bytes"] = history[-1]["pipeline_sent_bytes"]  # rank 0, a step's pass
        if workers > 1 and name not in RESHAPING_COLLECTIVES:
            alone = median_step_seconds(run_layout(name, workers, dataset, workdir / f"{name}-alone", steps, True), warmup)
            figures[name]["communication_share"] = max(0.0, 1 - alone / step_seconds)
            if "gradient_sum_seconds" in history[-1]:
                summed = history[-1]["gradient_sum_seconds"]
                figures[name]["communication_seconds"] = summed
                figures[name]["hidden_share"] = min(1.0, max(0.0, (alone + summed - step_seconds) / summed))
        print(f"{name}: {figures[name]}", file=sys.stderr, flush=True)
    return figures


def run_layout(name: str, workers: int, dataset: Path, out: Path, steps: int, no_communication: bool) -> list[dict]:
    """Rank 0's per-step metrics of one run of `name`."""
    command = [str(Path(__file__)), "--layout-worker", name, "--steps", str(steps), str(dataset), str(out)]
    if no_communication:
        command.append("--no-communication")
    if workers == 1:
        subprocess.run([sys.executable, *command], check=True, cwd=REPO)
    else:
        from model_core.parallel.launch import launch

        with open(out.with_suffix(".log"), "w") as echo:
            launch(command, workers, out / "logs", echo=echo)
    return json.loads((out / "history.json").read_text())


def modelled_bubble(name: str) -> float:
    """The lock-step model's bubble for the layout's schedule (pipeline.idle_fraction)."""
    from model_core.parallel.pipeline import idle_fraction, schedule, ticks
    from params import load_params

    parallel = load_params("tiny", LAYOUTS[name][2]).parallel
    return idle_fraction(ticks(schedule(parallel.pipeline_schedule, parallel.pipeline_parallel, parallel.micro_batches)))


def median_step_seconds(history: list[dict], warmup: int) -> float:
    timed = history[warmup:]
    if not timed:
        raise ValueError(f"{len(history)} steps leave none to time after {warmup} warm-up steps; raise --steps")
    return statistics.median(2048 / record["tokens_per_second"] for record in timed)


def run_worker(name: str, dataset: str, out: Path, steps: int, no_communication: bool) -> None:
    import mindspore as ms

    from model_core.parallel import comm
    from model_core.train.trainer import Trainer
    from params import load_params

    workers, threads, overrides = LAYOUTS[name]
    ms.device_context.cpu.op_tuning.threads_num(threads)
    if no_communication:
        remove_communication(comm)
    params = load_params("tiny", [*MODEL, *overrides, f"train.steps={steps}", "train.log_interval=1",
                                  "train.eval_interval=100000", "train.checkpoint_interval=100000"])
    trainer = Trainer(params, dataset, out / "checkpoints")
    # The final checkpoint and validation are not part of a step (and the checkpoint's barriers are collectives).
    trainer.save = lambda: None
    trainer.evaluate = lambda: float("nan")
    history = trainer.run().history
    if trainer.dp_group.size > 1 and not no_communication and params.parallel.zero_stage < 2:  # ZeRO-2: shards
        history[-1]["gradient_sum_seconds"] = time_gradient_sum(trainer)
    if trainer.is_reporting:
        out.mkdir(parents=True, exist_ok=True)
        (out / "history.json").write_text(json.dumps(history))


def time_gradient_sum(trainer, repeats: int = 5) -> float:
    """Median seconds of one step's gradient sum over dp alone: the trainer's buffers in its buckets."""
    import time

    from mindspore import ParameterTuple

    from model_core.parallel.data_parallel import GradientAllReduce

    parallel = trainer.parallel
    bucket_bytes = int(trainer.params.parallel.gradient_bucket_mb * 2**20)
    summing = GradientAllReduce(ParameterTuple(parallel.accumulate.buffers), parallel.dp_group, bucket_bytes)
    summing()  # compiles
    seconds = []
    for _ in range(repeats):
        parallel.dp_group.all_reduce(parallel.accumulate.buffers[0][:1]).asnumpy()  # the ranks start together
        start = time.perf_counter()
        summing()
        parallel.accumulate.buffers[0].asnumpy()  # waits for the graph
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def remove_communication(comm) -> None:
    """Every collective of comm.Group returns this rank's input: the compute of a step without its waiting."""

    def alone(self, x, *args):
        return x

    for method in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        setattr(comm.Group, method, alone)


if __name__ == "__main__":
    main()
