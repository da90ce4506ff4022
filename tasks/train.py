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

from model_core.parallel.launch import launch_training
from model_core.train.callbacks import MetricsCallback, follow_jsonl
from model_core.train.checkpoint import Checkpoint, list_checkpoints, run_directory, verify
from model_core.train.trainer import Trainer, TrainResult
from params import PipelineParams, params_hash, to_yaml
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
    with MetricsBatcher(run) as metrics:
        if params.parallel.world_size > 1:
            result = _train_on_ranks(params, directory, steps, resume, initial_weights, metrics)
        else:
            trainer = Trainer(params, data.dataset_dir, directory, steps=steps, initial_weights=initial_weights)
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


def _train_on_ranks(
    params: PipelineParams,
    directory: Path,
    steps: int,
    resume: str,
    initial_weights: Path | None,
    on_metrics: MetricsCallback,
) -> TrainResult:
    """`llmflow train` on params.parallel.world_size ranks under msrun, rank 0's metrics streamed to
    `on_metrics` while it runs; the result is read back from its metrics and its last checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    run_params = directory / f"params-{steps}-steps.yaml"
    update = {"train": params.train.model_copy(update={"steps": steps})}
    if initial_weights is None:  # `llmflow train` starts from convert.hf_source when it is set
        update["convert"] = params.convert.model_copy(update={"hf_source": None})
    run_params.write_text(to_yaml(params.model_copy(update=update)))
    metrics_file = directory / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    arguments = ["--params", str(run_params), "--checkpoint-dir", str(directory), "--resume", resume]
    arguments += ["--metrics-jsonl", str(metrics_file)]
    with follow_jsonl(metrics_file, on_metrics) as history:
        launch_training(params, arguments, directory / "logs")
    # The checkpoint of this run's last step: an earlier run in the same directory may have gone further.
    found = next((c for c in list_checkpoints(directory) if c.step == steps and verify(c) is None), None)
    if found is None:
        raise RuntimeError(f"the ranks finished but left no valid checkpoint of step {steps} in {directory}")
    return result_of_ranks(found, history)


def result_of_ranks(found: Checkpoint, history: list[dict[str, float]]) -> TrainResult:
    """What a run on ranks trained, read back from its last checkpoint's counters and rank 0's metrics."""
    counters = found.state()["counters"]
    return TrainResult(
        steps=counters["step"],
        initial_loss=counters["initial_loss"],
        final_loss=counters["last_loss"],
        skipped_steps=counters["skipped"],
        nonfinite_steps=counters["nonfinite"],
        checkpoint=found.path,
        resumed_from=None,
        history=history,
    )


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
