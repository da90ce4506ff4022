"""Run identity by stage: the params that decide each stage's result, and the key its directory is named by.

A stage's key hashes only what changes its result, so changing a later stage's params finds the earlier
stages' results where they were left (`llmflow finetune` after a `lora.steps` change, a nightly rerun):

| stage     | its key covers                                                                                  |
|-----------|-------------------------------------------------------------------------------------------------|
| data prep | the input files' contents, data.* (not output_dir, num_workers, runner, ray_address, ray_connect_timeout_s, shard_bytes, verify_on_reuse), tokenizer.*, model.vocab_size, vocab_padding, seq_len (model_core/data/prepare.py) |
| smoke     | the training inputs below with train.steps = smoke.steps, and the dataset                       |
| pretrain  | the training inputs, the dataset, and the start: random, the converted checkpoint, or the earlier run's checkpoint it continues |
| finetune  | the training inputs of the fine-tuning run (lora.lr, lora.steps in place of optimizer.lr, train.steps), lora.* (not enabled), the base checkpoint's content, the instruction dataset |
| eval      | eval.*, model.*, train.micro_batch_size and reset_at_document_boundaries (the held-out batches), the checkpoint's and adapters' content, the held-out datasets |

The training inputs are model.*, optimizer.*, precision.*, train.steps, train.seed,
train.reset_at_document_boundaries, the global batch size (sequences per optimizer step) and the data sources'
weights and epochs (the mixture; the dataset's key leaves them out). The parallel
layout is not among them: every layout computes the one-process run (tested layout by layout, up to float
summation order and LoRA dropout masks, which are drawn per micro-batch), checkpoints are layout-independent
and resume under another layout, so how the global batch is cut into dp replicas, micro-batches and
accumulation steps, tp, pp, ZeRO and recompute only change how fast and in how much memory a run goes.
Cadence and places (log, eval, checkpoint intervals, keep_checkpoints, output paths), the smoke gate's
threshold, tracking and the run's name change nothing a stage computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from params.loading import canonical_hash
from params.schema import PipelineParams

KEY_LENGTH = 16
TRAIN_RESULT_FIELDS = {"steps", "seed", "reset_at_document_boundaries"}


def training_inputs(params: PipelineParams) -> dict[str, Any]:
    """What decides the weights a training run ends with, given its data and its start."""
    return {
        "model": params.model.model_dump(mode="json"),
        "optimizer": params.optimizer.model_dump(mode="json"),
        "precision": params.precision.model_dump(mode="json"),
        "train": params.train.model_dump(mode="json", include=TRAIN_RESULT_FIELDS),
        "global_batch_size": params.global_batch_size,
        **_mixture(params),
    }


def _mixture(params: PipelineParams) -> dict[str, Any]:
    """The data sources' weights and epochs where any is set: they decide the samples a run reads, and the
    dataset's key leaves them out (one prepared dataset serves every mixture of its sources)."""
    mixture = [source.model_dump(include={"weight", "epochs"}) for source in params.data.sources]
    return {"data_mixture": mixture} if any(value is not None for entry in mixture for value in entry.values()) else {}


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    """The first hex digits of the sha256 of a stage's inputs: equal inputs, equal key."""
    return canonical_hash({"stage": stage, **inputs})[:KEY_LENGTH]


def stage_directory(params: PipelineParams, stage: str, key: str) -> Path:
    """`<train.output_dir>/<stage>-<key>`: where a stage run's checkpoints or reports go."""
    return Path(params.train.output_dir) / f"{stage}-{key}"
