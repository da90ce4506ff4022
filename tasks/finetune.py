"""The fine-tune stage as a Prefect task: instruction data, LoRA training on the pretrained checkpoint, the
adapters and a loss curve in MLflow."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.data import prepare_instructions
from model_core.train.checkpoint import run_directory
from model_core.train.finetune import check_lora_layout, finetune
from params import PipelineParams, params_hash
from tasks.data import DataResult, numeric_leaves
from tasks.plots import loss_curve_png
from tasks.retry import retry_on_transient_io
from tasks.tracking import MetricsBatcher, Tracking, stage_run

__all__ = ["FinetuneStageResult", "check_lora_layout", "finetune_stage"]


class FinetuneStageResult(BaseModel):
    adapters_dir: Path
    base_checkpoint: Path
    instructions_dir: Path
    steps: int
    initial_loss: float
    final_loss: float
    trainable_parameters: int
    trainable_share: float


@task(name="finetune", cache_policy=NO_CACHE, retries=1, retry_condition_fn=retry_on_transient_io)
def finetune_stage(
    params: PipelineParams, data: DataResult, base_checkpoint: Path, tracking: Tracking
) -> FinetuneStageResult:
    """LoRA on `base_checkpoint` with the pretraining tokenizer; `resume auto` continues an interrupted run."""
    with stage_run(tracking, "finetune") as run:
        instructions = prepare_instructions(
            params.lora, params.data, data.tokenizer_path, params.model, params.tokenizer,
            min_validation_rows=params.train.micro_batch_size,
        )
        directory = run_directory(
            params.train.output_dir, params.name, params_hash(params), instructions.output_dir, "finetune"
        )
        run.log_params(
            {
                "stage.base_checkpoint": base_checkpoint,
                "stage.instructions_dir": instructions.output_dir,
                "stage.checkpoint_dir": directory,
            }
        )
        run.log_metrics(numeric_leaves(instructions.manifest, "data.", skip={"shards"}))
        run.log_artifact(instructions.manifest_path, "data")
        with MetricsBatcher(run) as metrics:
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
    )
