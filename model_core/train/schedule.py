"""The learning rate at each optimizer step: linear warmup, then cosine or linear decay to min_lr, or constant.

Steps count from 0 (the first optimizer step). Warmup is PyTorch-style, so step 0 already trains:
lr * (step + 1) / warmup, reaching the peak lr at step warmup - 1. The decay then runs from the peak to
min_lr, which it reaches exactly at the last step, total_steps - 1. Warmup is a fixed slope and is never
squeezed: a run shorter than its warmup only ramps up (every step is warmup) and never decays.
A single-step run without warmup trains at the peak lr.
"""

from __future__ import annotations

import math

from params.schema import OptimizerParams


def warmup_length(total_steps: int, params: OptimizerParams) -> int:
    """Warmup steps: warmup_steps, or round(warmup_ratio * total_steps), or 0 when neither is set."""
    if params.warmup_steps is not None:
        return params.warmup_steps
    if params.warmup_ratio is not None:
        return round(params.warmup_ratio * total_steps)
    return 0


def learning_rate(step: int, total_steps: int, params: OptimizerParams) -> float:
    """The learning rate of optimizer step `step` (0-based) in a run of `total_steps` steps."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be at least 1")
    if not 0 <= step < total_steps:
        raise ValueError(f"step={step} is outside the run's steps 0..{total_steps - 1} (total_steps={total_steps})")
    warmup = warmup_length(total_steps, params)
    if step < warmup:
        return params.lr * (step + 1) / warmup
    if params.schedule == "constant":
        return params.lr
    peak_step = max(warmup, 1) - 1
    decay_steps = total_steps - 1 - peak_step
    progress = (step - peak_step) / decay_steps if decay_steps > 0 else 0.0
    if params.schedule == "linear":
        return params.lr + (params.min_lr - params.lr) * progress
    return params.min_lr + 0.5 * (params.lr - params.min_lr) * (1.0 + math.cos(math.pi * progress))
