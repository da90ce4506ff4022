"""LoRA fine-tuning: a pretrained checkpoint, adapters on chosen projections, instruction data.

`finetune(...)` starts a `Trainer` from the base checkpoint with LoRA adapters applied from outside the model
(`parallelize` adds them to each rank's shard, under any layout), so only the adapters train, and saves them
alone and whole, with the base checkpoint's sha256, next to the trainer's own (resumable) checkpoints. The instruction dataset is
prepared beforehand by `model_core.data.prepare_instructions` with the pretraining tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from model_core.model.lora import CONFIG, LoraSummary, base_sha256, summary_of, write_adapters
from model_core.parallel import comm
from model_core.train.callbacks import MetricsCallback
from model_core.train.checkpoint import Checkpoint, latest_valid
from model_core.train.reshard import whole_tensors
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
    Runs on this process's rank of params.parallel's layout: every layout `parallelize` supports for LoRA."""
    tuned = finetune_params(params)
    lora = params.lora.model_copy(update={"enabled": True})  # `enabled` switches the pipeline's stage; this is the stage
    trainer = Trainer(tuned, dataset_dir, checkpoint_dir, steps=tuned.train.steps, initial_weights=base_checkpoint, lora=lora)
    result = trainer.run(on_metrics=on_metrics, resume=resume)
    base_hash = base_sha256(base_checkpoint)
    adapters_dir = Path(checkpoint_dir) / ADAPTERS_DIR
    if trainer.is_reporting:  # the adapters whole, from the run's last checkpoint (every rank wrote its block)
        final = result.checkpoint or latest_valid(checkpoint_dir).path
        weights, _ = whole_tensors(Checkpoint(final, -1))
        adapters = {row.name: weights[row.name] for row in trainer.parallel.table if row.trainable}
        write_adapters(adapters_dir, adapters, params.lora, base_hash, sum(value.size for value in weights.values()))
    comm.barrier()  # the adapters exist before any rank returns
    return FinetuneResult(train=result, adapters_dir=adapters_dir, summary=read_summary(adapters_dir), base_sha256=base_hash)


def read_summary(adapters_dir: str | Path) -> LoraSummary:
    """What the saved adapters amount to, from their adapter_config.json."""
    config = json.loads((Path(adapters_dir) / CONFIG).read_text())
    return summary_of(config["adapted_modules"], config["adapter_parameters"], config["total_parameters"])
