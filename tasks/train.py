"""The smoke and pretrain stages as Prefect tasks: train, stream metrics to MLflow, log the checkpoint
and a loss curve.

The smoke run must show learning (final loss below the initial loss by `smoke.min_loss_drop`, no
non-finite step) or the flow stops before the expensive pretraining run. A failed smoke gate or stage is
diagnosed (`llmflow doctor`) into its MLflow run and the log before its error goes on.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.data.health import summary_line
from model_core.parallel.launch import launch_training
from model_core.storage import write_file
from model_core.train import runs
from model_core.train.callbacks import MetricsCallback, fan_out, follow_jsonl
from model_core.train.checkpoint import Checkpoint, list_checkpoints, verify
from model_core.train.runs import TrainingRun
from model_core.train.trainer import Trainer, TrainResult
from params import PipelineParams, to_yaml
from tasks.data import DataResult, health_of
from tasks.doctor import diagnosed_on_failure
from tasks.plots import loss_curve_png
from tasks.progress import IntervalLog, StageFigures
from tasks.retry import retry_on_transient_io
from tasks.tracking import MetricsBatcher, StageRun, Tracking, record_reuse, stage_run, training_datasets


class SmokeTestFailed(ValueError):
    """The smoke run did not learn; pretraining is not started."""


class TrainStageResult(BaseModel):
    checkpoint: Path
    steps: int
    initial_loss: float
    final_loss: float
    skipped_steps: int
    nonfinite_steps: int
    figures: StageFigures = StageFigures()


def train_stage(
    params: PipelineParams,
    data: DataResult,
    run: StageRun,
    stage: str,
    planned: TrainingRun,
    resume: str,
    initial_weights: Path | None = None,
) -> TrainStageResult:
    """Train and record: batched per-step metrics, a line per log interval, a summary, the final checkpoint and a
    loss curve. A run whose final checkpoint is already there is reused: its summary is recorded, nothing is
    trained."""
    started = time.monotonic()
    steps = planned.final_step - _schedule_start(planned)
    run.log_params(
        {
            "stage.steps": steps,
            "stage.final_step": planned.final_step,
            "stage.checkpoint_dir": planned.directory,
            "stage.resume": resume,
            "stage.initial_weights": planned.continue_from or initial_weights or "random init",
        }
    )
    run.log_datasets(training_datasets(data.dataset_dir))
    finished = planned.finished()
    record_reuse(run, stage, finished.path if finished is not None else None)
    if finished is not None:
        result = result_of_checkpoint(finished, [])
    else:
        planned.write_record()
        with MetricsBatcher(run) as batcher:
            metrics = fan_out(batcher, IntervalLog(stage, planned.final_step))
            if params.parallel.world_size > 1:
                result = _train_on_ranks(params, planned, steps, resume, initial_weights, metrics)
            else:
                start = initial_weights if planned.continue_from is None else None  # a continued run has its own
                trainer = Trainer(
                    params, data.dataset_dir, planned.directory, steps=steps, initial_weights=start,
                    continue_from=planned.continue_from,
                )
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
    if result.checkpoint is not None and finished is None:
        log_checkpoint(run, result.checkpoint, params.tracking.log_optimizer_state)
    if result.history:
        run.log_bytes(loss_curve_png(result.history, title=f"{params.name} {stage}"), "loss_curve.png")
    return TrainStageResult(
        checkpoint=result.checkpoint,
        steps=result.steps,
        initial_loss=result.initial_loss,
        final_loss=result.final_loss,
        skipped_steps=result.skipped_steps,
        nonfinite_steps=result.nonfinite_steps,
        figures=StageFigures.of(result.history, time.monotonic() - started, reused=finished is not None),
    )


def log_checkpoint(run: StageRun, checkpoint: Path, optimizer_state: bool) -> None:
    """Upload a checkpoint to the stage run under `checkpoint/<step>/`: its weights and small state files, and
    its optimizer files (`optimizer*.safetensors`) only when asked."""
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and (optimizer_state or not path.name.startswith("optimizer")):
            run.log_artifact(path, f"checkpoint/{checkpoint.name}")


def _schedule_start(planned: TrainingRun) -> int:
    """The step a run's schedule starts at: that of the checkpoint it continues, else 0."""
    if planned.continue_from is None:
        return 0
    return Checkpoint(planned.continue_from, -1).state()["step"]


def _train_on_ranks(
    params: PipelineParams,
    planned: TrainingRun,
    steps: int,
    resume: str,
    initial_weights: Path | None,
    on_metrics: MetricsCallback,
) -> TrainResult:
    """`llmflow train` on params.parallel.world_size ranks under msrun, rank 0's metrics streamed to
    `on_metrics` while it runs; the result is read back from its metrics and its last checkpoint. The ranks
    read the run's start from its record in the directory."""
    directory = planned.directory
    directory.mkdir(parents=True, exist_ok=True)
    run_params = directory / f"params-{steps}-steps.yaml"
    update = {"train": params.train.model_copy(update={"steps": steps})}
    if initial_weights is None:  # `llmflow train` starts from convert.hf_source when it is set
        update["convert"] = params.convert.model_copy(update={"hf_source": None})
    write_file(run_params, to_yaml(params.model_copy(update=update)))
    metrics_file = directory / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    arguments = ["--params", str(run_params), "--checkpoint-dir", str(directory), "--resume", resume]
    arguments += ["--metrics-jsonl", str(metrics_file)]
    with follow_jsonl(metrics_file, on_metrics) as history:
        launch_training(params, arguments, directory / "logs")
    # The checkpoint of this run's last step: an earlier run in the same directory may have gone further.
    found = next((c for c in list_checkpoints(directory) if c.step == planned.final_step and verify(c) is None), None)
    if found is None:
        raise RuntimeError(f"the ranks finished but left no valid checkpoint of step {planned.final_step} in {directory}")
    return result_of_checkpoint(found, history)


def result_of_checkpoint(found: Checkpoint, history: list[dict[str, float]]) -> TrainResult:
    """What a run trained, read back from its last checkpoint's counters (and rank 0's metrics, if it ran)."""
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


@task(name="smoke-run", cache_policy=NO_CACHE)
def smoke_run(params: PipelineParams, data: DataResult, tracking: Tracking) -> TrainStageResult:
    """Always from a random initialisation: it checks that this model, data and optimizer can learn. It starts with
    the data-health line, whose warnings name what most often keeps a run from learning on its data."""
    print(summary_line(health_of(json.loads(data.manifest_path.read_text()), params)))
    with stage_run(tracking, "smoke") as run:
        planned = runs.smoke_run(params, data.dataset_dir)
        with diagnosed_on_failure(params, run, planned.directory, data.dataset_dir):
            result = train_stage(params, data, run, "smoke", planned, resume="none")
            drop = result.initial_loss - result.final_loss
            passed = result.nonfinite_steps == 0 and math.isfinite(drop) and drop >= params.smoke.min_loss_drop
            run.set_tags({"llmflow.smoke_passed": str(passed).lower()})
            if not passed:
                raise SmokeTestFailed(
                    f"smoke run failed: loss went from {result.initial_loss:.4f} to {result.final_loss:.4f} "
                    f"(drop {drop:.4f}, smoke.min_loss_drop={params.smoke.min_loss_drop}) with "
                    f"{result.nonfinite_steps} non-finite steps over {result.steps} steps; pretraining not started"
                )
    return result


@task(name="pretrain", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_on_transient_io)
def pretrain(
    params: PipelineParams, data: DataResult, tracking: Tracking, initial_weights: Path | None = None
) -> TrainStageResult:
    """The full run, from `initial_weights` (a converted checkpoint) or a random initialisation, or with
    train.continue_from=latest the continuation of the same model's run on earlier data; `resume auto`
    continues from this run's newest valid checkpoint (a retry), and a finished run is reused (a rerun)."""
    with stage_run(tracking, "pretrain") as run:
        planned = runs.pretraining_run(params, data.dataset_dir, initial_weights)
        with diagnosed_on_failure(params, run, planned.directory, data.dataset_dir):
            return train_stage(params, data, run, "pretrain", planned, "auto", initial_weights)
