"""Train-step throughput and peak memory: our MindSpore step against PyTorch eager, same model, side by side.

One full optimizer step is forward, backward and AdamW on one micro-batch. Ours runs the compiled pieces of
model_core.optim.step (AccumulateGradients, GradientNorm, ApplyGradients with model_core.parallel.optimizer.AdamW),
as the trainer does; PyTorch runs a compact Llama of the same architecture and init with torch.optim.AdamW.
Every variant runs in its own subprocess, so its peak RSS (VmHWM of that child, see model_core.train.system.peak_rss_bytes) is its own.

    python benchmarks/train_throughput.py                 # every variant, reference size, two rounds
    python benchmarks/train_throughput.py --variants torch-fp32,ours-fp32   # just the fp32 pair
    python benchmarks/train_throughput.py --variants torch-fp32,ours-fp32,torch-compile-fp32   # + torch.compile
    python benchmarks/train_throughput.py --variant ours-fp32   # one variant in this process (JSON line)
    python benchmarks/train_throughput.py --variants torch-fp32,ours-fp32 --threads 1   # one kernel thread each

On a loaded machine wall time mostly measures the neighbours; compare CPU seconds per step (all threads of the
child) too. `--threads` sets each framework's kernel thread count (torch.set_num_threads, MindSpore's
op_tuning.threads_num); with 1, torch's OpenMP threads stop spinning at barriers while other load runs.

The variants run one after another, `--rounds` times over (torch, ours, torch, ours, ...), and each variant's
figures pool its rounds: the median of all its timed steps, the highest of its peak RSS. The last line printed
is one JSON object for the fp32 reference size: ours_tokens_per_s, torch_tokens_per_s, ours_peak_rss_mb,
torch_peak_rss_mb and their ratios. Timings are medians of the timed steps after warm-up; the warm-up steps' seconds are printed
too (`warmup_step_seconds`: ours run slower there while MindSpore's kernels search their thread split, see
AUTOTUNED_AFTER).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
REFERENCE = dict(
    vocab_size=8000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, ffn_hidden_size=1376,
    seq_len=256, tie_embeddings=True, init_std=0.02,
)
MICRO_BATCH = 8
BETAS, EPS, WEIGHT_DECAY, LR = (0.9, 0.95), 1e-8, 0.1, 3e-4
FP16_LOSS_SCALE = 1024.0
# MindSpore's CPU kernels pick how many threads to split each elementwise kernel over by timing it: every kernel of
# a graph runs 5 times as one task, 5 as two, then 4, 8, 16 and 32, and keeps the fastest from its 31st launch
# on (ParallelLaunchAutoSearch). A graph launches each of its kernels once a step, so the first 30 steps run
# the trials (the first five all on one thread) and a training run's steady state starts at step 31. Both
# frameworks warm up as long.
AUTOTUNED_AFTER = 31

# name -> (framework, compute dtype, recompute every block)
VARIANTS = {
    "torch-fp32": ("torch", "float32", False),
    "ours-fp32": ("ours", "float32", False),
    "torch-compile-fp32": ("torch", "float32", False),
    "ours-fp32-spinning": ("ours", "float32", False),
    "torch-fp32-recompute": ("torch", "float32", True),
    "ours-fp32-recompute": ("ours", "float32", True),
    "torch-bf16": ("torch", "bfloat16", False),
    "ours-bf16": ("ours", "bfloat16", False),
    "ours-fp16": ("ours", "float16", False),
}
# By default MindSpore's Python thread waits for a launched graph in a busy loop (AsyncRQueue::Wait), which
# takes a whole core of the two from the kernels. Importing model_core sets MS_DEV_HOST_BLOCKING_RUN=1, which
# runs the launch on the Python thread instead, so nothing spins; these variants turn it off to show the cost.
SPINNING = {"ours-fp32-spinning"}
# torch.compile (Inductor, C++ kernels built by the system compiler) of the same module, forward and backward: a
# reference row, not a target; its first steps compile, which the warm-up leaves out.
COMPILED = {"torch-compile-fp32"}


def peak_rss_mb() -> float:
    from model_core.train.system import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def random_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, REFERENCE["vocab_size"], (MICRO_BATCH, REFERENCE["seq_len"] + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def time_steps(step, warmup: int, steps: int) -> dict:
    """Run `step(i) -> loss` warmup + steps times; seconds and losses of the timed ones, and the seconds of the
    warm-up steps after the first (which compiles)."""
    seconds, cpu_seconds, losses = [], [], []
    for i in range(warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step(i))
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    timed = slice(warmup, None)
    tokens = MICRO_BATCH * REFERENCE["seq_len"]
    return {
        "tokens_per_s": tokens / statistics.median(seconds[timed]),
        # CPU time of all the process's threads: steadier than wall time on a shared machine.
        "cpu_seconds_per_step": round(statistics.median(cpu_seconds[timed]), 3),
        "step_seconds": [round(s, 3) for s in seconds[timed]],
        "cpu_step_seconds": [round(s, 3) for s in cpu_seconds[timed]],
        "warmup_step_seconds": [round(s, 3) for s in seconds[1:warmup]],
        "last_loss": losses[-1],
    }


# ----------------------------------------------------------------------------------------------- ours


def run_ours(dtype: str, recompute: bool, warmup: int, steps: int, threads: int | None) -> dict:
    sys.path.insert(0, str(REPO))
    import mindspore as ms

    from model_core.model import Llama
    from model_core.parallel.optimizer import AdamW
    from model_core.optim.step import AccumulateGradients, ApplyGradients, GradientNorm, scalar
    from model_core.train.precision import PrecisionError, check_precision
    from params.schema import ModelParams, PrecisionParams

    try:
        check_precision(PrecisionParams(compute_dtype=dtype), ms.get_context("device_target"))
    except PrecisionError as error:
        return {"unsupported": str(error)}
    if threads is not None:
        ms.device_context.cpu.op_tuning.threads_num(threads)
    ms.set_seed(0)
    model = Llama(ModelParams(**REFERENCE), dtype)
    if recompute:
        for block in model.layers:
            block.recompute()
    accumulate = AccumulateGradients(model)
    norm = GradientNorm(accumulate.buffers)
    apply = ApplyGradients(accumulate.buffers, AdamW(accumulate.weights, BETAS, EPS, WEIGHT_DECAY))
    loss_scale = FP16_LOSS_SCALE if dtype == "float16" else 1.0
    tokens_per_step = MICRO_BATCH * REFERENCE["seq_len"]

    def step(i: int) -> float:
        inputs, labels = random_batch(i)
        loss_mask = ms.Tensor(np.ones(labels.shape, np.float32))
        summed = accumulate(ms.Tensor(inputs), ms.Tensor(labels), loss_mask, None, None, scalar(loss_scale / tokens_per_step))
        grad_norm = float(norm(scalar(1.0 / loss_scale)).asnumpy())
        apply(scalar(LR), scalar(i + 1), scalar(min(1.0, 1.0 / (grad_norm + 1e-6)) / loss_scale))
        return float(summed.asnumpy()) / tokens_per_step

    return time_steps(step, warmup, steps)


# ---------------------------------------------------------------------------------------------- torch


def torch_llama(torch, config: dict):
    """A compact Llama with the architecture and init of model_core.model.Llama (tied head, no biases)."""
    nn, functional = torch.nn, torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, size: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(size))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def linear(fan_in: int, fan_out: int, std: float):
        layer = nn.Linear(fan_in, fan_out, bias=False)
        nn.init.normal_(layer.weight, std=std)
        return layer

    hidden, heads, layers = config["hidden_size"], config["num_heads"], config["num_layers"]
    std, output_std = config["init_std"], config["init_std"] / math.sqrt(2 * layers)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
            self.q, self.k, self.v = (linear(hidden, hidden, std) for _ in range(3))
            self.o = linear(hidden, hidden, output_std)
            self.gate, self.up = linear(hidden, config["ffn_hidden_size"], std), linear(hidden, config["ffn_hidden_size"], std)
            self.down = linear(config["ffn_hidden_size"], hidden, output_std)

        def forward(self, x, cos, sin):
            batch, seq, _ = x.shape
            h = self.input_norm(x)
            q, k, v = (p(h).view(batch, seq, heads, hidden // heads).transpose(1, 2) for p in (self.q, self.k, self.v))
            attended = functional.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
            x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, hidden))
            h = self.post_norm(x)
            return x + self.down(functional.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self, recompute: bool):
            super().__init__()
            self.recompute = recompute
            self.embed = nn.Embedding(config["vocab_size"], hidden)
            nn.init.normal_(self.embed.weight, std=std)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm(hidden)
            head_dim = hidden // heads
            inv_freq = 1.0 / 10_000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            angles = torch.outer(torch.arange(config["seq_len"], dtype=torch.float64), inv_freq)
            angles = torch.cat([angles, angles], -1)
            self.register_buffer("cos", angles.cos().float())
            self.register_buffer("sin", angles.sin().float())

        def forward(self, tokens):
            x = self.embed(tokens)
            cos, sin = self.cos[: tokens.shape[1]].to(x.dtype), self.sin[: tokens.shape[1]].to(x.dtype)
            for block in self.blocks:
                if self.recompute:
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    x = block(x, cos, sin)
            return functional.linear(self.norm(x), self.embed.weight).float()

    return Llama


def run_torch(dtype: str, recompute: bool, warmup: int, steps: int, threads: int | None, compiled: bool = False) -> dict:
    import torch
    import torch.utils.checkpoint

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch_llama(torch, REFERENCE)(recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    vocab = REFERENCE["vocab_size"]
    if compiled:
        model = torch.compile(model)

    def step(i: int) -> float:
        inputs, labels = (torch.from_numpy(a.astype(np.int64)) for a in random_batch(i))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return time_steps(step, warmup, steps)


# --------------------------------------------------------------------------------------------- driver


def run_variant(name: str, warmup: int, steps: int, threads: int | None) -> dict:
    framework, dtype, recompute = VARIANTS[name]
    if name in SPINNING:
        os.environ["MS_DEV_HOST_BLOCKING_RUN"] = "0"  # before model_core's import sets its default
    if framework == "ours":
        result = run_ours(dtype, recompute, warmup, steps, threads)
    else:
        result = run_torch(dtype, recompute, warmup, steps, threads, compiled=name in COMPILED)
    return {"variant": name, **result, "peak_rss_mb": round(peak_rss_mb())}


def run_in_child(name: str, warmup: int, steps: int, threads: int | None) -> dict:
    command = [sys.executable, __file__, "--variant", name, "--warmup", str(warmup), "--steps", str(steps)]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"variant": name, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def pooled(runs: list[dict]) -> dict:
    """One variant's runs (one per round) as one result: throughput and CPU time from the medians of all their
    timed steps, the highest peak RSS."""
    if len(runs) == 1 or any("tokens_per_s" not in run for run in runs):
        return runs[-1]
    seconds = [s for run in runs for s in run["step_seconds"]]
    cpu_seconds = [s for run in runs for s in run["cpu_step_seconds"]]
    return {
        "variant": runs[0]["variant"],
        "tokens_per_s": MICRO_BATCH * REFERENCE["seq_len"] / statistics.median(seconds),
        "cpu_seconds_per_step": round(statistics.median(cpu_seconds), 3),
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
        "tokens_per_s_by_round": [round(run["tokens_per_s"]) for run in runs],
        "peak_rss_mb_by_round": [run["peak_rss_mb"] for run in runs],
    }


def describe(result: dict, torch_fp32: dict | None) -> str:
    name = result["variant"]
    if "unsupported" in result:
        return f"| {name} | not run: {result['unsupported']} | | | |"
    if "error" in result:
        return f"| {name} | failed: {result['error']} | | | |"
    ratio = ""
    if torch_fp32 and "tokens_per_s" in torch_fp32:
        ratio = (
            f"{result['tokens_per_s'] / torch_fp32['tokens_per_s']:.2f}x tokens/s, "
            f"{torch_fp32['cpu_seconds_per_step'] / result['cpu_seconds_per_step']:.2f}x tokens/CPU-s, "
            f"{result['peak_rss_mb'] / torch_fp32['peak_rss_mb']:.2f}x RSS"
        )
    return (
        f"| {name} | {result['tokens_per_s']:,.0f} | {result['cpu_seconds_per_step']:.2f} "
        f"| {result['peak_rss_mb']:,.0f} MB | {ratio} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="run one variant here and print its JSON")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variant names to run")
    parser.add_argument(
        "--warmup", type=int, default=AUTOTUNED_AFTER, help=f"untimed steps first (default {AUTOTUNED_AFTER}, see above)"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, help="kernel threads per framework (default: each one's own)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="times every variant runs, in turn (a drifting load then meets each alike)"
    )
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.warmup, args.steps, args.threads)), flush=True)
        return

    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(run_in_child(name, args.warmup, args.steps, args.threads))
            print(json.dumps(runs[name][-1]), flush=True)
    results = {name: pooled(runs[name]) for name in names}
    torch_fp32 = results.get("torch-fp32")
    print("| variant | tokens/s | CPU s/step | peak RSS | vs torch-fp32 |\n|---|---|---|---|---|")
    for name in names:
        print(describe(results[name], torch_fp32))
    ours, theirs = results.get("ours-fp32", {}), torch_fp32 or {}
    summary = {
        "ours_tokens_per_s": ours.get("tokens_per_s"),
        "torch_tokens_per_s": theirs.get("tokens_per_s"),
        "ours_peak_rss_mb": ours.get("peak_rss_mb"),
        "torch_peak_rss_mb": theirs.get("peak_rss_mb"),
    }
    if all(summary.values()):
        summary["tokens_per_s_ratio"] = round(summary["ours_tokens_per_s"] / summary["torch_tokens_per_s"], 3)
        summary["peak_rss_ratio"] = round(summary["ours_peak_rss_mb"] / summary["torch_peak_rss_mb"], 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
