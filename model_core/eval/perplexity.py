"""Held-out loss and perplexity of a model on the first batches of a prepared split, in file order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms

from model_core.model import Llama, token_cross_entropy
from model_core.train.loader import Rows, sequential_batches


@dataclass(frozen=True)
class HeldOutLoss:
    mean_loss: float  # nats per counted token, every counted token weighing the same
    perplexity: float  # exp(mean_loss)
    tokens: int  # counted tokens
    batches: int


def held_out_loss(
    model: Llama, rows: Rows, batch_rows: int, max_batches: int, pad_id: int, reset_at_documents: bool
) -> HeldOutLoss:
    """Token-weighted mean next-token loss over the first `max_batches` batches of `batch_rows` rows.

    Tokens count where the loader's loss mask says so (not padding, and whatever else make_batch masks).
    """
    summed, tokens, batches = 0.0, 0, 0
    for batch in sequential_batches(rows, batch_rows, max_batches, pad_id, reset_at_documents):
        extra = [None if ids is None else ms.Tensor(ids) for ids in (batch.position_ids, batch.segment_ids)]
        logits = model.compiled_forward(ms.Tensor(batch.tokens), *extra)
        mean, count = token_cross_entropy(logits, ms.Tensor(batch.labels), ms.Tensor(batch.loss_mask))
        summed += float(mean.asnumpy()) * float(count.asnumpy())
        tokens += int(count.asnumpy())
        batches += 1
    if tokens == 0:
        raise ValueError(
            f"no counted tokens in {batches} held-out batches of {batch_rows} rows (the split has {len(rows)} rows)"
        )
    mean_loss = summed / tokens
    return HeldOutLoss(mean_loss, math.exp(mean_loss), tokens, batches)
