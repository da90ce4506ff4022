"""Scaled dot-product attention: the backend's fused kernel where one exists, plain softmax(QK^T/sqrt(d))V elsewhere.

Every attention layer owns an `Attention` cell, so a faster kernel is swapped in here and nowhere else, and the
model owns one `CausalMask`, so parallelism that changes which keys a rank's queries see (context parallelism,
`model_core.parallel.context`) swaps both from outside. The mask is boolean, True where a query may attend to a key.
The plain path repeats key/value heads for grouped-query attention and hands the mask as it is to
`fused.SoftmaxAttentionFunction`, which computes scores and softmax in fp32 whatever the compute dtype, in blocks of
queries, with a hand-written backward.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from model_core.model.fused import SoftmaxAttentionFunction

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


class CausalMask(nn.Cell):
    """bool mask, True where query t may attend to key s: s <= t, and within one segment (document) if segment ids
    [B, T] are given. Returns [T, T] without segments, [B, 1, T, T] with them."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.causal = ms.Tensor(np.tril(np.ones((seq_len, seq_len), dtype=bool)))

    def construct(self, seq, segment_ids=None):
        causal = self.causal[:seq, :seq]
        if segment_ids is None:
            return causal
        same_segment = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)  # [B, T, T]
        return ops.logical_and(same_segment, causal).unsqueeze(1)


class Attention(nn.Cell):
    """softmax(q k^T / sqrt(head_dim) where mask, else -inf) v.

    q: [B, H, T, D]; k, v: [B, H_kv, S, D] with H a multiple of H_kv (S = T but under context parallelism, where
    the keys are the whole sequence's); mask: bool, broadcastable to [B, 1, T, S].
    Returns [B, H, T, D] in the dtype of v. `fused` asks for the flash-attention kernel (see
    `fused_attention_available`; callers decide it once, outside the compiled graph); the kernel takes
    fp16/bf16 only, so fp32 inputs always take the plain path.
    """

    def __init__(self, head_dim: int, fused: bool = False):
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.fused = fused
        self.softmax_attention = SoftmaxAttentionFunction(self.scale)

    def construct(self, q: ms.Tensor, k: ms.Tensor, v: ms.Tensor, mask: ms.Tensor) -> ms.Tensor:
        if self.fused and q.dtype != ms.float32:
            return ops.flash_attention_score(
                q, k, v, head_num=q.shape[1], attn_mask=ops.logical_not(mask), scalar_value=self.scale,
                input_layout="BNSD",
            )
        return self.softmax_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), mask)


def cached_attention(q: ms.Tensor, keys: ms.Tensor, values: ms.Tensor, visible: ms.Tensor) -> ms.Tensor:
    """`Attention` of a few new queries over a KV cache that already holds their own keys and values, for decoding
    (no backward).

    q: [B, H, n, D], already scaled by 1 / sqrt(D) (decoding folds that into RoPE); keys, values: the cache
    [B, H_kv, S, D] with S >> n; visible: bool [B, 1, n, S]. The scores are computed as keys q^T, a matmul
    whose transposed operand is the small q, so no kernel can end up transposing the whole cache; inside the
    decode graph q keys^T costs the same (benchmarks/README.md, Generation).
    """
    num_heads = q.shape[1]
    keys, values = repeat_kv(keys, num_heads), repeat_kv(values, num_heads)
    scores = ops.matmul(keys, q.swapaxes(2, 3)).swapaxes(2, 3).astype(ms.float32)  # [B, H, n, S]
    bias = ops.logical_not(visible).astype(ms.float32) * _MASKED_SCORE
    return ops.matmul(ops.softmax(scores + bias, -1).astype(q.dtype), values)
