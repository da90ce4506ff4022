"""Next-token cross-entropy over the counted tokens of a batch, in fp32."""

from __future__ import annotations

import mindspore as ms
from mindspore import mint, ops

from model_core.model.fused import TokenNLLFunction

_token_nll = TokenNLLFunction()


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
    ignored = flat_labels == ignore_index
    counted = counted_tokens(labels, loss_mask, ignore_index)
    # Ignored tokens still need a valid class id to look up; their loss is multiplied by 0 below.
    safe_labels = mint.where(ignored, ops.zeros_like(flat_labels), flat_labels)
    per_token = _token_nll(logits.reshape(-1, vocab_size).astype(ms.float32), safe_labels)
    count = counted.sum()
    loss = (per_token * counted).sum() / mint.maximum(count, ms.Tensor(1.0, ms.float32))
    return loss, count


def counted_tokens(labels: ms.Tensor, loss_mask: ms.Tensor | None = None, ignore_index: int = -100) -> ms.Tensor:
    """[B * T] fp32: 1 where `token_cross_entropy` counts the token (label not `ignore_index`, mask nonzero)."""
    counted = mint.logical_not(labels.reshape(-1) == ignore_index).astype(ms.float32)
    if loss_mask is not None:
        counted = counted * (loss_mask.reshape(-1) != 0).astype(ms.float32)
    return counted
