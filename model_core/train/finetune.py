"""LoRA fine-tuning: a pretrained checkpoint, adapters on chosen projections, instruction data.

`finetune(...)` starts a `Trainer` from the base checkpoint with the adapters applied from outside the model
(`apply_lora` as the trainer's `adapt_model`), so only the adapters train, and saves them alone, with the
base checkpoint's sha256, next to the trainer's own (resumable) checkpoints. The instruction dataset is
prepared beforehand by `model_core.data.prepare_instructions` with the pretraining tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_core.model.lora import LoraSummary, apply_lora, base_sha256, save_adapters
from model_core.parallel.layout import ParallelConfigError
from model_core.train.callbacks import MetricsCallback
from model_core.train.trainer import Trainer, TrainResult
from params.schema import PipelineParams

ADAPTERS_DIR = "adapters"


@dataclass
class FinetuneResult:
    train: TrainResult
    adapters_dir: Path
    summary: LoraSummary
    base_sha256: str


def finetune_params(params: PipelineParams) -> PipelineParams:
    """The params the fine-tuning trainer runs with: `lora.steps` steps at peak `lora.lr`, warmup over the
    first 10% of them, cosine to a tenth of the peak; instruction examples packed into one row are kept
    apart (attention and positions reset at their boundaries)."""
    optimizer = params.optimizer.model_copy(
        update={"lr": params.lora.lr, "min_lr": params.lora.lr / 10, "schedule": "cosine", "warmup_steps": None,
                "warmup_ratio": 0.1}
    )
    train = params.train.model_copy(update={"steps": params.lora.steps, "reset_at_document_boundaries": True})
    return params.model_copy(update={"optimizer": optimizer, "train": train})


def check_lora_layout(params: PipelineParams) -> None:
    """Adapters are not sharded yet: under tensor or pipeline parallelism or ZeRO-3 they would have to split like
    the projection they wrap, so those layouts are refused before anything is built."""
    parallel = params.parallel
    for field, value in (("tensor_parallel", parallel.tensor_parallel), ("pipeline_parallel", parallel.pipeline_parallel)):
        if value > 1:
            raise ParallelConfigError(
                f"LoRA with parallel.{field}={value} is not supported: adapters would have to shard like the "
                "projections they wrap; fine-tune with data_parallel (and zero_stage=1) instead"
            )
    if parallel.zero_stage == 3 and parallel.data_parallel > 1:
        raise ParallelConfigError(
            "LoRA with parallel.zero_stage=3 is not supported: ZeRO-3 replaces the projections LoRA wraps with flat "
            "weight shards; use zero_stage 1 or 2"
        )


def finetune(
    params: PipelineParams,
    dataset_dir: str | Path,
    base_checkpoint: str | Path,
    checkpoint_dir: str | Path,
    on_metrics: MetricsCallback | None = None,
    resume: str | Path = "auto",
) -> FinetuneResult:
    """Train LoRA adapters on top of `base_checkpoint` (a directory with model.safetensors) and save them to
    `<checkpoint_dir>/adapters`. `resume="auto"` continues from the newest valid fine-tuning checkpoint.
    Data parallelism and ZeRO-1 apply as in pretraining (only the adapters are reduced and sharded)."""
    check_lora_layout(params)
    tuned = finetune_params(params)
    trainer = Trainer(
        tuned, dataset_dir, checkpoint_dir, steps=tuned.train.steps, initial_weights=base_checkpoint,
        adapt_model=lambda model: apply_lora(model, params.lora),
    )
    result = trainer.run(on_metrics=on_metrics, resume=resume)
    base_hash = base_sha256(base_checkpoint)
    adapters_dir = Path(checkpoint_dir) / ADAPTERS_DIR
    if trainer.is_reporting:
        save_adapters(adapters_dir, trainer.model, params.lora, base_hash)
    return FinetuneResult(train=result, adapters_dir=adapters_dir, summary=trainer.adaptation, base_sha256=base_hash)
