"""The smoke and pretrain stages as Prefect tasks: train, stream metrics to MLflow, log the checkpoint
and a loss curve.

The smoke run must show learning (final loss below the initial loss by `smoke.min_loss_drop`, no
non-finite step) or the flow stops before the expensive pretraining run.
"""

from __future__ import annotations

import math
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.train.checkpoint import run_directory
from model_core.train.trainer import Trainer, TrainResult
from params import PipelineParams, params_hash
from tasks.data import DataResult
from tasks.plots import loss_curve_png
from tasks.retry import retry_on_transient_io
from tasks.tracking import MetricsBatcher, StageRun, Tracking, stage_run


class SmokeTestFailed(ValueError):
    """The smoke run did not learn; pretraining is not started."""


class TrainStageResult(BaseModel):
    checkpoint: Path
    steps: int
    initial_loss: float
    final_loss: float
    skipped_steps: int
    nonfinite_steps: int


def train_stage(
    params: PipelineParams,
    data: DataResult,
    run: StageRun,
    stage: str,
    steps: int,
    resume: str,
    initial_weights: Path | None = None,
) -> TrainResult:
    """Train and record: batched per-step metrics, a summary, the final checkpoint and a loss curve."""
    directory = run_directory(params.train.output_dir, params.name, params_hash(params), data.dataset_dir, stage)
    run.log_params(
        {
            "stage.steps": steps,
            "stage.checkpoint_dir": directory,
            "stage.resume": resume,
            "stage.initial_weights": initial_weights or "random init",
        }
    )
    trainer = Trainer(params, data.dataset_dir, directory, steps=steps, initial_weights=initial_weights)
    with MetricsBatcher(run) as metrics:
        result = trainer.run(on_metrics=metrics, resume=resume)
    run.log_metrics(
        {
            "initial_loss": result.initial_loss,
            "final_loss": result.final_loss,
            "skipped_steps": result.skipped_steps,
            "nonfinite_steps": result.nonfinite_steps,
        },
        step=result.steps,
    )
    if result.checkpoint is not None:
        run.log_artifacts(result.checkpoint, f"checkpoint/{result.checkpoint.name}")
    if result.history:
        run.log_bytes(loss_curve_png(result.history, title=f"{params.name} {stage}"), "loss_curve.png")
    return result


def _summary(result: TrainResult) -> TrainStageResult:
    return TrainStageResult(
        checkpoint=result.checkpoint,
        steps=result.steps,
        initial_loss=result.initial_loss,
        final_loss=result.final_loss,
        skipped_steps=result.skipped_steps,
        nonfinite_steps=result.nonfinite_steps,
    )


@task(name="smoke-run", cache_policy=NO_CACHE)
def smoke_run(params: PipelineParams, data: DataResult, tracking: Tracking) -> TrainStageResult:
    """Always from a random initialisation: it checks that this model, data and optimizer can learn."""
    with stage_run(tracking, "smoke") as run:
        result = train_stage(params, data, run, "smoke", params.smoke.steps, resume="none")
        drop = result.initial_loss - result.final_loss
        passed = result.nonfinite_steps == 0 and math.isfinite(drop) and drop >= params.smoke.min_loss_drop
        run.set_tags({"llmflow.smoke_passed": str(passed).lower()})
        if not passed:
            raise SmokeTestFailed(
                f"smoke run failed: loss went from {result.initial_loss:.4f} to {result.final_loss:.4f} "
                f"(drop {drop:.4f}, smoke.min_loss_drop={params.smoke.min_loss_drop}) with "
                f"{result.nonfinite_steps} non-finite steps over {result.steps} steps; pretraining not started"
            )
    return _summary(result)


@task(name="pretrain", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_on_transient_io)
def pretrain(
    params: PipelineParams, data: DataResult, tracking: Tracking, initial_weights: Path | None = None
) -> TrainStageResult:
    """The full run, from `initial_weights` (a converted checkpoint) or a random initialisation; `resume auto`
    continues from this run's newest valid checkpoint (a retry or a rerun)."""
    with stage_run(tracking, "pretrain") as run:
        result = train_stage(params, data, run, "pretrain", params.train.steps, "auto", initial_weights)
    return _summary(result)
