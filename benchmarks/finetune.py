"""Fine-tuning step throughput and peak memory: LoRA adapters against full fine-tuning, same model, side by side.

The model is the reference model of benchmarks/train_throughput.py (vocab 8000, hidden 512, 8 layers, seq 256,
micro-batch 8 = 2,048 tokens a step, 29.4M parameters). One step is forward, backward, global-norm clip and
AdamW over the trainable parameters, through model_core.optim.step as the trainer runs it. `full` trains every
weight; the LoRA variants (model_core.model.lora, LoraParams defaults: rank 16, alpha 32, dropout 0.05, in
training mode) train only adapters, on q/k/v/o or on all seven projections, the latter also without dropout. Every variant runs in its own
subprocess, so its peak RSS (VmHWM of that child, see model_core.train.system.peak_rss_bytes) is its own.

    python benchmarks/finetune.py                                    # every variant
    python benchmarks/finetune.py --variant full --variant lora-qkvo  # some of them

The last line printed is one JSON object: tokens/s, peak RSS and trainable parameters per variant, and each
LoRA variant's ratios to `full`. Timings are medians of the timed steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys

import numpy as np

from train_throughput import BETAS, EPS, LR, MICRO_BATCH, REFERENCE, REPO, WEIGHT_DECAY, peak_rss_mb, random_batch, time_steps

ALL = ["q", "k", "v", "o", "gate", "up", "down"]
# name -> (projections that get adapters, None for full fine-tuning; adapter dropout)
VARIANTS = {
    "full": (None, 0.0),
    "lora-qkvo": (["q", "k", "v", "o"], 0.05),
    "lora-all": (ALL, 0.05),
    "lora-all-no-dropout": (ALL, 0.0),
}


def run_variant(name: str, warmup: int, steps: int) -> dict:
    sys.path.insert(0, str(REPO))
    import mindspore as ms

    from model_core.model import Llama, apply_lora, count_parameters
    from model_core.parallel.optimizer import AdamW
    from model_core.optim.step import AccumulateGradients, ApplyGradients, GradientNorm, scalar
    from params.schema import LoraParams, ModelParams

    ms.set_seed(0)
    model = Llama(ModelParams(**REFERENCE))
    targets, dropout = VARIANTS[name]
    saved_state_bytes = 0
    if targets is not None:
        saved_state_bytes = apply_lora(model, LoraParams(target_modules=targets, dropout=dropout)).saved_state_bytes
        model.set_train(True)  # adapter dropout on, as in fine-tuning
    accumulate = AccumulateGradients(model)
    norm = GradientNorm(accumulate.buffers)
    apply = ApplyGradients(accumulate.buffers, AdamW(accumulate.weights, BETAS, EPS, WEIGHT_DECAY))
    tokens_per_step = MICRO_BATCH * REFERENCE["seq_len"]
    loss_mask = ms.Tensor(np.ones((MICRO_BATCH, REFERENCE["seq_len"]), np.float32))

    def step(i: int) -> float:
        inputs, labels = random_batch(i)
        summed = accumulate(ms.Tensor(inputs), ms.Tensor(labels), loss_mask, None, None, scalar(1.0 / tokens_per_step))
        grad_norm = float(norm(scalar(1.0)).asnumpy())
        apply(scalar(LR), scalar(i + 1), scalar(min(1.0, 1.0 / (grad_norm + 1e-6))))
        return float(summed.asnumpy()) / tokens_per_step

    result = time_steps(step, warmup, steps)
    return {
        "variant": name,
        **result,
        "trainable_parameters": sum(w.size for w in accumulate.weights),
        "total_parameters": count_parameters(model),
        "saved_state_mb": round(saved_state_bytes / 2**20),
        "peak_rss_mb": round(peak_rss_mb()),
    }


def run_in_child(name: str, warmup: int, steps: int) -> dict:
    """`run_variant` in a fresh interpreter (spawned, not forked), so the peak RSS it reports is its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(run_variant, (name, warmup, steps))
        except Exception as error:  # a failed variant is reported in the table; the others still run
            return {"variant": name, "error": f"{type(error).__name__}: {error}"}


def table(results: dict[str, dict]) -> list[str]:
    full = results.get("full", {})
    rows = [
        "| variant | trainable params | tokens/s | CPU s/step | peak RSS | training state saved | vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        if "error" in result:
            rows.append(f"| {name} | failed: {result['error']} | | | | | |")
            continue
        ratio = ""
        if name != "full" and "tokens_per_s" in full:
            ratio = (
                f"{result['tokens_per_s'] / full['tokens_per_s']:.2f}x tokens/s, "
                f"{result['peak_rss_mb'] / full['peak_rss_mb']:.2f}x RSS"
            )
        rows.append(
            f"| {name} | {result['trainable_parameters']:,} of {result['total_parameters']:,} | "
            f"{result['tokens_per_s']:,.0f} | {result['cpu_seconds_per_step']} | {result['peak_rss_mb']:,} MB | "
            f"{result['saved_state_mb']:,} MB | {ratio} |"
        )
    return rows


def summary(results: dict[str, dict]) -> dict:
    figures = {}
    for name, result in results.items():
        for key in ("tokens_per_s", "peak_rss_mb", "trainable_parameters"):
            figures[f"{name}_{key}"] = result.get(key)
    full = results.get("full", {})
    for name, result in results.items():
        if name != "full" and "tokens_per_s" in result and "tokens_per_s" in full:
            figures[f"{name}_tokens_per_s_ratio"] = round(result["tokens_per_s"] / full["tokens_per_s"], 3)
            figures[f"{name}_peak_rss_ratio"] = round(result["peak_rss_mb"] / full["peak_rss_mb"], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="run this one (repeatable); default: all")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = {}
    for name in args.variant or VARIANTS:
        results[name] = run_in_child(name, args.warmup, args.steps)
        print(json.dumps(results[name]), flush=True)
    print("\n".join(table(results)))
    print(json.dumps(summary(results)), flush=True)


if __name__ == "__main__":
    main()
