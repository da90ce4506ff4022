"""The fine-tune stage as a Prefect task: instruction data, LoRA training on the pretrained checkpoint, the
adapters and a loss curve in MLflow."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.data import prepare_instructions
from model_core.data.identity import split_identities
from model_core.model.lora import CONFIG, base_sha256
from model_core.parallel.launch import hang_watch, launch
from model_core.storage import write_file
from model_core.train.callbacks import MetricsCallback, fan_out, follow_jsonl
from model_core.train.checkpoint import latest_valid
from model_core.train.finetune import ADAPTERS_DIR, FinetuneResult, finetune, finetune_params, read_summary
from model_core.train.runs import finetune_directory
from params import PipelineParams, to_yaml
from tasks.data import MANIFEST_SETTINGS, DataResult, numeric_leaves
from tasks.doctor import diagnosed_on_failure
from tasks.plots import loss_curve_png
from tasks.progress import IntervalLog, StageFigures
from tasks.retry import retry_on_transient_io
from tasks.tracking import BASE_MODEL, MetricsBatcher, Tracking, record_reuse, stage_run, training_datasets
from tasks.train import result_of_checkpoint

__all__ = ["FinetuneStageResult", "finetune_stage"]


class FinetuneStageResult(BaseModel):
    adapters_dir: Path
    base_checkpoint: Path
    instructions_dir: Path
    steps: int
    initial_loss: float
    final_loss: float
    trainable_parameters: int
    trainable_share: float
    figures: StageFigures = StageFigures()


@task(name="finetune", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_on_transient_io)
def finetune_stage(
    params: PipelineParams, data: DataResult, base_checkpoint: Path, tracking: Tracking
) -> FinetuneStageResult:
    """LoRA on `base_checkpoint` with the pretraining tokenizer; `resume auto` continues an interrupted run, and
    a finished one (same base, instructions and lora params) is reused."""
    started = time.monotonic()
    with stage_run(tracking, "finetune") as run:
        instructions = prepare_instructions(
            params.lora, params.data, data.tokenizer_path, params.model, params.tokenizer,
            min_validation_rows=params.train.micro_batch_size,
        )
        directory = finetune_directory(params, base_checkpoint, instructions.output_dir)
        run.log_params(
            {
                "stage.base_checkpoint": base_checkpoint,
                "stage.instructions_dir": instructions.output_dir,
                "stage.checkpoint_dir": directory,
            }
        )
        run.log_metrics(numeric_leaves(instructions.manifest, "data.", skip=MANIFEST_SETTINGS))
        run.log_artifact(instructions.manifest_path, "data")
        base_data = [(identity, BASE_MODEL) for identity in split_identities(data.dataset_dir, ("train",))]
        run.log_datasets([*base_data, *training_datasets(instructions.output_dir)])
        reused = _finished(directory, params.lora.steps)
        record_reuse(run, "finetune", directory if reused is not None else None)
        if reused is not None:
            result = reused
        else:
            tuned = finetune_params(params)
            with (
                diagnosed_on_failure(tuned, run, directory, instructions.output_dir, stage="finetune"),
                MetricsBatcher(run) as batcher,
            ):
                metrics = fan_out(batcher, IntervalLog("finetune", params.lora.steps))
                if params.parallel.world_size > 1:  # the ranks under msrun, as pretraining runs them
                    result = _finetune_on_ranks(params, base_checkpoint, directory, metrics)
                else:
                    result = finetune(params, instructions.output_dir, base_checkpoint, directory, on_metrics=metrics)
        trained, summary = result.train, result.summary
        run.log_metrics(
            {
                "initial_loss": trained.initial_loss,
                "final_loss": trained.final_loss,
                "skipped_steps": trained.skipped_steps,
                "trainable_parameters": summary.trainable_parameters,
                "trainable_share": summary.trainable_share,
                "saved_state_bytes": summary.saved_state_bytes,
            },
            step=trained.steps,
        )
        run.set_tags({"llmflow.base_sha256": result.base_sha256})
        if reused is None:
            run.log_artifacts(result.adapters_dir, "adapters")
        if trained.history:
            run.log_bytes(loss_curve_png(trained.history, title=f"{params.name} finetune"), "loss_curve.png")
    return FinetuneStageResult(
        adapters_dir=result.adapters_dir,
        base_checkpoint=base_checkpoint,
        instructions_dir=instructions.output_dir,
        steps=trained.steps,
        initial_loss=trained.initial_loss,
        final_loss=trained.final_loss,
        trainable_parameters=summary.trainable_parameters,
        trainable_share=summary.trainable_share,
        figures=StageFigures.of(trained.history, time.monotonic() - started, reused=reused is not None),
    )


def _finetune_on_ranks(
    params: PipelineParams, base_checkpoint: Path, directory: Path, on_metrics: MetricsCallback
) -> FinetuneResult:
    """`llmflow finetune` on params.parallel.world_size ranks under msrun, rank 0's metrics streamed to
    `on_metrics` while it runs; the result is read back from its last checkpoint and its adapters."""
    directory.mkdir(parents=True, exist_ok=True)
    run_params = directory / "params.yaml"
    write_file(run_params, to_yaml(params))
    metrics_file = directory / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    arguments = ["--params", str(run_params), "--base", str(base_checkpoint), "--checkpoint-dir", str(directory)]
    arguments += ["--resume", "auto", "--metrics-jsonl", str(metrics_file)]
    with follow_jsonl(metrics_file, on_metrics) as history:
        launch(
            ["-m", "flows.cli", "finetune", *arguments], params.parallel.world_size, directory / "logs",
            **hang_watch(params),
        )
    found = latest_valid(directory)
    if found is None:
        raise RuntimeError(f"the fine-tuning ranks finished but left no valid checkpoint in {directory}")
    adapters = directory / ADAPTERS_DIR
    return FinetuneResult(result_of_checkpoint(found, history), adapters, read_summary(adapters), base_sha256(base_checkpoint))


def _finished(directory: Path, steps: int) -> FinetuneResult | None:
    """The fine-tuning run in `directory` when it is complete (its final checkpoint and its adapters)."""
    found = latest_valid(directory)
    adapters = directory / ADAPTERS_DIR
    if found is None or found.step < steps or not (adapters / CONFIG).is_file():
        return None
    base_hash = json.loads((adapters / CONFIG).read_text())["base_sha256"]  # the key holds the base's content
    return FinetuneResult(result_of_checkpoint(found, []), adapters, read_summary(adapters), base_hash)
