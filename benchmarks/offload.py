"""Optimizer (and parameter) offload against none, side by side: peak RSS and step time of one process, and of dp2
under ZeRO-3.

Every run trains the reference-size Llama (vocab 8000, hidden 512, 8 layers, 8 heads, FFN 1376, seq 256, tied;
29.4M parameters, fp32) on the same global batch of 8 sequences (2048 tokens) with the real `Trainer`:
  baseline          one process, 2 threads;
  offload           the same with `parallel.optimizer_offload=true`;
  zero3_baseline    two msrun workers of 1 thread, dp2, ZeRO-3, 4 sequences each;
  zero3_offload     the same with `parallel.optimizer_offload=true` (each rank offloads its shard's moments);
  zero3_param_offload  the same with `parallel.param_offload=true` too (each rank's parameter shards as well).
Peak RSS is each worker's own high-water mark (VmHWM) at the end of the run, summed over the workers of a job
(msrun's scheduler process, the same in both ZeRO-3 jobs, is left out). Step seconds are the median over the steps
after `--warmup` (the first compiles), and so are step CPU seconds (this process's user + system time a step, rank 0
under ZeRO-3: less sensitive than wall time to other processes on a shared machine). `moment_mb` is the AdamW moments one process holds without offload (8 bytes
a parameter; the two ZeRO-3 ranks hold half each, the same total). The target: offload lowers peak RSS by at least
80% of moment_mb, at most 1.3x the step time. `zero3_param_mb` is the parameter shards the two ZeRO-3 ranks hold
without parameter offload (4 bytes a parameter in all).

    flock /tmp/cpu.lock python benchmarks/offload.py [--steps 8] [--warmup 3] [--runs baseline,offload]
        [--model model.hidden_size=1024 ...]   (a larger model: the parameter shards grow, the step's ops do not)

The last line printed is one JSON object: `baseline_peak_rss_mb`, `offload_peak_rss_mb`, `moment_mb`,
`baseline_step_s`, `offload_step_s`, the same four with a `zero3_` prefix, `*_step_cpu_s` beside each `*_step_s`, `saving_over_moments` and
`zero3_saving_over_moments` ((baseline - offload) peak RSS / moment_mb), and the offloaded runs' bytes moved and
staging seconds per step (`offload_bytes_per_step`, `offload_seconds_per_step`, and `zero3_` for rank 0). The
parameter-offload run's figures carry a `zero3_param_` prefix (`zero3_param_offload_peak_rss_mb`, `..._step_s`,
`..._step_cpu_s`, `zero3_param_offload_bytes_per_step`, `zero3_param_offload_seconds_per_step`), beside
`zero3_param_saving_over_params` ((zero3_offload - zero3_param_offload) peak RSS / zero3_param_mb),
`zero3_param_saving_over_offloaded` ((zero3_baseline - zero3_param_offload) / (zero3_moment_mb + zero3_param_mb)) and
`zero3_param_step_ratio`, `zero3_param_step_cpu_ratio` (against zero3_baseline).
Where the memory is, per run (summed over its workers): `*_built_rss_mb` (RSS once the `Trainer` is built, before
the first step compiles), and at the end `*_end_rss_anon_mb`, `*_end_rss_file_mb` (anonymous and file-backed pages,
the offload files' mapped pages among the latter) and `*_end_heap_in_use_mb`, `*_end_heap_free_mb` (glibc's heap:
allocated, and freed but kept resident; MindSpore's 1 GiB memory pool is a mapping of its own, in neither).
`zero3_param_built_rss_saving_over_params` and `zero3_param_end_heap_in_use_saving_over_params` compare those of
the two offloaded ZeRO-3 runs as `zero3_param_saving_over_params` compares their peaks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
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
ZERO3 = ["train.micro_batch_size=4", "parallel.data_parallel=2", "parallel.zero_stage=3"]
OFFLOAD = ["parallel.optimizer_offload=true"]
# run -> (workers, threads per worker, params overrides); every one trains on 8 sequences a step
RUNS = {
    "baseline": (1, 2, ["train.micro_batch_size=8"]),
    "offload": (1, 2, ["train.micro_batch_size=8", *OFFLOAD]),
    "zero3_baseline": (2, 1, ZERO3),
    "zero3_offload": (2, 1, [*ZERO3, *OFFLOAD]),
    "zero3_param_offload": (2, 1, [*ZERO3, *OFFLOAD, "parallel.param_offload=true"]),
}
# run -> (key prefix, kind): each offload run is compared with the baseline of its prefix's family
KEYS = {
    "baseline": ("", "baseline"),
    "offload": ("", "offload"),
    "zero3_baseline": ("zero3_", "baseline"),
    "zero3_offload": ("zero3_", "offload"),
    "zero3_param_offload": ("zero3_param_", "offload"),
}
MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (compilation)")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    parser.add_argument("--model", action="append", default=[], metavar="model.FIELD=VALUE",
                        help="a change to the reference model (repeatable), e.g. model.hidden_size=1024")
    parser.add_argument("--run-worker", help=argparse.SUPPRESS)  # internal: one process of one run
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_worker:
        dataset, out = args.paths
        run_worker(args.run_worker, dataset, Path(out), args.steps, [*MODEL, *args.model])
        return
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as workdir:
        reports = measure(Path(workdir), args.steps, args.runs.split(","), args.model)
    summary = summarise(reports, args.warmup)
    print(f"{'run':<21}{'peak RSS MB':>13}{'step s':>9}{'step CPU s':>12}{'offload MB/step':>17}{'staging s':>11}")
    for name in reports:
        offloaded = reports[name][0]["last"].get("offload_bytes_per_step")
        staging = reports[name][0]["last"].get("offload_seconds_per_step")
        prefix, kind = KEYS[name]
        print(f"{name:<21}{summary[f'{prefix}{kind}_peak_rss_mb']:>13,.1f}{summary[f'{prefix}{kind}_step_s']:>9.3f}"
              f"{summary[f'{prefix}{kind}_step_cpu_s']:>12.3f}"
              f"{'' if offloaded is None else f'{offloaded / MB:.1f}':>17}{'' if staging is None else f'{staging:.3f}':>11}")
    print(json.dumps(summary))


def measure(workdir: Path, steps: int, names: list[str], model: list[str]) -> dict[str, list[dict]]:
    from model_core.data import prepare_dataset
    from params import load_params

    params = load_params("tiny", [*MODEL, *model, f"data.output_dir={workdir / 'data'}"])
    dataset = prepare_dataset(params.data, params.tokenizer, params.model).output_dir
    return {name: run(name, dataset, workdir / name, steps, model) for name in names}


def run(name: str, dataset: Path, out: Path, steps: int, model: list[str]) -> list[dict]:
    """Every worker's report of one run, in rank order."""
    workers = RUNS[name][0]
    out.mkdir(parents=True)
    changes = [arg for change in model for arg in ("--model", change)]
    command = [str(Path(__file__)), "--run-worker", name, "--steps", str(steps), *changes, str(dataset), str(out)]
    if workers == 1:
        subprocess.run([sys.executable, *command], check=True, cwd=REPO)
    else:
        from model_core.parallel.launch import launch

        with open(out / "launch.log", "w") as echo:
            launch(command, workers, out / "logs", echo=echo)
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(workers)]
    print(f"{name}: peak RSS {[round(r['peak_rss_bytes'] / MB) for r in reports]} MB", file=sys.stderr, flush=True)
    return reports


def summarise(reports: dict[str, list[dict]], warmup: int) -> dict:
    summary = {}
    for name, ranks in reports.items():
        prefix, kind = KEYS[name]
        timed = ranks[0]["history"][warmup:]
        if not timed:
            raise ValueError(f"{len(ranks[0]['history'])} steps leave none to time after {warmup} warm-up steps")
        summary[f"{prefix}{kind}_peak_rss_mb"] = round(sum(r["peak_rss_bytes"] for r in ranks) / MB, 1)
        summary[f"{prefix}{kind}_built_rss_mb"] = round(sum(r["built"]["rss"] for r in ranks) / MB, 1)
        for field in ("rss_anon", "rss_file", "heap_in_use", "heap_free"):
            if all(field in r["end"] for r in ranks):
                summary[f"{prefix}{kind}_end_{field}_mb"] = round(sum(r["end"][field] for r in ranks) / MB, 1)
        summary[f"{prefix}{kind}_step_s"] = round(statistics.median(2048 / r["tokens_per_second"] for r in timed), 3)
        summary[f"{prefix}{kind}_step_cpu_s"] = round(statistics.median(ranks[0]["step_cpu_seconds"][warmup:]), 3)
        if prefix == "zero3_":  # the shards both ZeRO-3 runs without parameter offload hold
            summary["zero3_param_mb"] = round(sum(r["shard_bytes"] for r in ranks) / MB, 1)
        if kind == "baseline":
            summary[f"{prefix}moment_mb"] = round(sum(r["moment_bytes"] for r in ranks) / MB, 1)
        else:
            summary[f"{prefix}offload_bytes_per_step"] = ranks[0]["last"]["offload_bytes_per_step"]
            summary[f"{prefix}offload_seconds_per_step"] = round(
                statistics.median(r["offload_seconds_per_step"] for r in timed), 3
            )
    for prefix, base in (("", ""), ("zero3_", "zero3_"), ("zero3_param_", "zero3_")):
        if f"{base}baseline_step_s" not in summary or f"{prefix}offload_step_s" not in summary:
            continue
        saved = summary[f"{base}baseline_peak_rss_mb"] - summary[f"{prefix}offload_peak_rss_mb"]
        if prefix == "zero3_param_":
            offloaded = summary["zero3_moment_mb"] + summary["zero3_param_mb"]
            summary["zero3_param_saving_over_offloaded"] = round(saved / offloaded, 3)
        else:
            summary[f"{prefix}saving_over_moments"] = round(saved / summary[f"{prefix}moment_mb"], 3)
        summary[f"{prefix}step_ratio"] = round(summary[f"{prefix}offload_step_s"] / summary[f"{base}baseline_step_s"], 3)
        cpu = summary[f"{prefix}offload_step_cpu_s"] / summary[f"{base}baseline_step_cpu_s"]
        summary[f"{prefix}step_cpu_ratio"] = round(cpu, 3)
    if "zero3_offload_peak_rss_mb" in summary and "zero3_param_offload_peak_rss_mb" in summary:
        for measure in ("peak_rss", "built_rss", "end_heap_in_use"):
            key = f"zero3_param_offload_{measure}_mb"
            if key in summary and f"zero3_offload_{measure}_mb" in summary:
                params_saved = summary[f"zero3_offload_{measure}_mb"] - summary[key]
                name = "saving_over_params" if measure == "peak_rss" else f"{measure}_saving_over_params"
                summary[f"zero3_param_{name}"] = round(params_saved / summary["zero3_param_mb"], 3)
    return summary


def run_worker(name: str, dataset: str, out: Path, steps: int, model: list[str]) -> None:
    import mindspore as ms

    from model_core.train.system import peak_rss_bytes
    from model_core.train.trainer import Trainer
    from params import load_params

    _, threads, overrides = RUNS[name]
    ms.device_context.cpu.op_tuning.threads_num(threads)
    params = load_params("tiny", [*model, *overrides, f"train.steps={steps}", "train.log_interval=1",
                                  "train.eval_interval=100000", "train.checkpoint_interval=100000"])
    trainer = Trainer(params, dataset, out / "checkpoints")
    built = _memory()
    # The final checkpoint and validation are not part of a step (and the checkpoint's barriers are collectives).
    trainer.save = lambda: None
    trainer.evaluate = lambda: float("nan")
    optimizer = trainer.optimizer
    held = optimizer.moment_bytes()
    cpu_marks = [_cpu_seconds()]
    history = trainer.run(on_metrics=lambda record: cpu_marks.append(_cpu_seconds())).history
    zero3 = trainer.parallel.zero3  # the shards the rank holds in memory (under parameter offload: none)
    shards = 0 if zero3 is None or zero3.offloaded is not None else sum(4 * int(p.shape[0]) for p in zero3.shards.values())
    report = {"history": history, "last": history[-1], "peak_rss_bytes": peak_rss_bytes(), "moment_bytes": held,
              "shard_bytes": shards, "built": built, "end": _memory(),
              "step_cpu_seconds": [after - before for before, after in zip(cpu_marks, cpu_marks[1:])]}
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(report))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(field, ctypes.c_size_t) for field in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _memory() -> dict[str, int]:
    """This process's resident bytes now (`rss`: anonymous + file pages) and glibc's heap: `heap_in_use` (allocated
    by malloc, without its mmapped blocks) and `heap_free` (freed, kept by malloc, resident once touched)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    kb = {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "RssAnon", "RssFile")}
    memory = {"rss": kb["VmRSS"], "rss_anon": kb["RssAnon"], "rss_file": kb["RssFile"]}
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        memory.update(heap_in_use=info.uordblks, heap_free=info.fordblks)
    except (OSError, AttributeError):  # not glibc >= 2.33
        pass
    return memory


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


if __name__ == "__main__":
    main()
