"""Next-token cross-entropy over the counted tokens of a batch, in fp32."""

from __future__ import annotations

import mindspore as ms
from mindspore import mint, ops


def token_cross_entropy(
    logits: ms.Tensor, labels: ms.Tensor, loss_mask: ms.Tensor | None = None, ignore_index: int = -100
) -> tuple[ms.Tensor, ms.Tensor]:
    """Mean cross-entropy over counted tokens, and how many tokens were counted.

    logits: [B, T, V]; labels: [B, T], already aligned with logits (labels[:, t] is the target of
    logits[:, t]). A token is counted when its label is not `ignore_index` and, if given, its `loss_mask`
    entry is nonzero. Returns (loss, count), both fp32 scalars; the loss is 0 when nothing is counted.
    """
    vocab_size = logits.shape[-1]
    flat_labels = labels.reshape(-1)
    per_token = ops.cross_entropy(
        logits.reshape(-1, vocab_size).astype(ms.float32), flat_labels, reduction="none", ignore_index=ignore_index
    )
    counted = (flat_labels != ignore_index).astype(ms.float32)
    if loss_mask is not None:
        counted = counted * (loss_mask.reshape(-1) != 0).astype(ms.float32)
    count = counted.sum()
    loss = (per_token * counted).sum() / mint.maximum(count, ms.Tensor(1.0, ms.float32))
    return loss, count
