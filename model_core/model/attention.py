"""Scaled dot-product attention: the backend's fused kernel where one exists, plain softmax(QK^T/sqrt(d))V elsewhere.

Every attention layer calls `attention()`, so a faster kernel is swapped in here and nowhere else. The
mask is boolean, True where a query may attend to a key; the plain path computes scores and softmax in fp32
whatever the compute dtype, and repeats key/value heads for grouped-query attention.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import mint, ops

_MASKED_SCORE = float(np.finfo(np.float32).min)


def fused_attention_available() -> bool:
    """Whether `ops.flash_attention_score` runs on the current device target (Ascend only in MindSpore 2.10)."""
    return ms.get_context("device_target") == "Ascend"


def repeat_kv(x: ms.Tensor, num_heads: int) -> ms.Tensor:
    """[B, H_kv, T, D] -> [B, num_heads, T, D], each key/value head repeated for its group of query heads."""
    batch, kv_heads, seq, head_dim = x.shape
    if kv_heads == num_heads:
        return x
    group = num_heads // kv_heads
    expanded = x.unsqueeze(2).broadcast_to((batch, kv_heads, group, seq, head_dim))
    return expanded.reshape(batch, num_heads, seq, head_dim)


def attention(q: ms.Tensor, k: ms.Tensor, v: ms.Tensor, mask: ms.Tensor, fused: bool = False) -> ms.Tensor:
    """softmax(q k^T / sqrt(d) where mask, else -inf) v.

    q: [B, H, T, D]; k, v: [B, H_kv, T, D] with H a multiple of H_kv; mask: bool, broadcastable to [B, 1, T, T].
    Returns [B, H, T, D] in the dtype of v. `fused` asks for the flash-attention kernel (see
    `fused_attention_available`; callers decide it once, outside the compiled graph); the kernel takes
    fp16/bf16 only, so fp32 inputs always take the plain path.
    """
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    if fused and q.dtype != ms.float32:
        return ops.flash_attention_score(
            q, k, v, head_num=q.shape[1], attn_mask=ops.logical_not(mask), scalar_value=scale, input_layout="BNSD"
        )
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scores = mint.matmul(q, k.swapaxes(-2, -1)).astype(ms.float32) * scale  # [B, H, T, T]
    scores = ops.masked_fill(scores, ops.logical_not(mask), _MASKED_SCORE)
    probs = mint.softmax(scores, dim=-1).astype(v.dtype)
    return mint.matmul(probs, v)
