"""Context parallelism: each rank of a cp group holds a part of every sequence, and attention spans the whole.

A sequence of T tokens is cut into 2 x cp equal chunks; cp rank i holds chunk i and chunk 2 x cp - 1 - i
(`sequence_chunks`). Under a causal mask a query attends to the keys before it, so a chunk's attention work grows
with its place in the sequence: with one contiguous chunk per rank the last rank would do about 2 x cp - 1 times
the first one's work and every other rank would wait for it. An early chunk paired with its mirror from the end
gives every rank the same work (its queries see i + 1 and 2 x cp - i chunks of keys: 2 x cp + 1, whatever i), as Megatron and
MindSpore Transformers do. The loader cuts each row this way (tokens, labels, loss mask, the positions of the
whole sequence for RoPE and the document segment ids: `model_core.train.loader.context_shard`); the model never
sees the whole row.

Attention runs exactly over the whole sequence by gathering keys and values: every layer all-gathers its key and
value heads over the cp group (`GatherSequence`; its backward reduce-scatters their gradients, so each rank gets
the gradient of its own keys and values from every rank's queries), and the local queries attend to all T keys
under a mask built from global token indices and segment ids (`ContextParallelMask`). The gathered keys and
values are in gather order, not sequence order: attention does not care about the order of its keys as long as
the mask says which are visible, so they are never reordered. Gathering costs a layer's whole-sequence K and V
(2 x T x kv_heads x head_dim, small next to the activations under grouped-query attention) and one collective
each way per layer. A ring (each rank passing its K/V block on, cp - 1 hops, merging partial softmaxes) would hold
two blocks instead of the whole and overlap the transfers with the compute, but it needs point-to-point transfers
(on MindSpore's CPU backend each hop would be an all-reduce over a pair of ranks) and an online softmax whose
rounding differs from the one-process run; the all-gather keeps the arithmetic of the single-device attention
(Llama 3 trained at long context this way). Recompute re-runs the gather in the backward.

`context_parallel(model, group)` swaps these cells into a built single-device Llama (or pipeline stage) from
outside; a group of one rank leaves the model as it is.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from model_core.model.llama import Llama
from model_core.parallel.comm import Group


def sequence_chunks(seq_len: int, cp: int, index: int) -> np.ndarray:
    """Token indices [seq_len / cp] (int32) of a sequence that cp rank `index` holds: chunk `index` and chunk
    2 x cp - 1 - index of 2 x cp equal chunks, in that order."""
    if seq_len % (2 * cp) or not 0 <= index < cp:
        raise ValueError(f"seq_len={seq_len} must split into 2 x cp={2 * cp} chunks, and 0 <= index={index} < cp")
    chunk = seq_len // (2 * cp)
    first, second = index * chunk, (2 * cp - 1 - index) * chunk
    return np.concatenate([np.arange(first, first + chunk), np.arange(second, second + chunk)]).astype(np.int32)


def gathered_order(seq_len: int, cp: int) -> np.ndarray:
    """Token indices [seq_len] of a sequence gathered over the cp group in group order (every rank's
    `sequence_chunks`, one after the other): which token each gathered key is."""
    return np.concatenate([sequence_chunks(seq_len, cp, index) for index in range(cp)])


class GatherSequence(nn.Cell):
    """All-gather along the sequence axis over the cp group; the backward reduce-scatters the gradient, so each rank
    gets the sum over the group's queries of the gradient of its own block."""

    def __init__(self, group: Group, axis: int) -> None:
        super().__init__()
        self.group, self.axis = group, axis

    def construct(self, x):
        return self.group.all_gather(x, self.axis)

    def bprop(self, x, out, dout):
        return (self.group.reduce_scatter(dout, self.axis),)


class ContextParallelMask(nn.Cell):
    """The attention mask of this rank's queries against the keys of the whole sequence in gather order: bool
    [B, 1, T / cp, T], True where the key is at or before the query in the sequence and in the same document.

    Takes the model's (seq, segment_ids) like `attention.CausalMask`; segment_ids [B, T / cp] are always given
    under cp (`loader.context_shard` makes them), and are gathered over the group once per forward."""

    def __init__(self, seq_len: int, group: Group) -> None:
        super().__init__()
        self.group = group
        self.query_tokens = Tensor(sequence_chunks(seq_len, group.size, group.index).reshape(-1, 1))  # [T / cp, 1]
        self.key_tokens = Tensor(gathered_order(seq_len, group.size).reshape(1, -1))  # [1, T]

    def construct(self, seq, segment_ids):
        # Segment ids travel as fp32 (exact below 2^24): MindSpore's CPU all-reduce sums floating point.
        local = ops.stop_gradient(segment_ids).astype(ms.float32)
        everyone = self.group.all_gather(local, 1)  # [B, T]
        causal = self.key_tokens <= self.query_tokens  # [T / cp, T]
        same_document = local.unsqueeze(2) == everyone.unsqueeze(1)  # [B, T / cp, T]
        return ops.logical_and(same_document, causal).unsqueeze(1)


class ContextParallelAttention(nn.Cell):
    """A layer's `Attention` over the whole sequence: its key and value heads gathered over the cp group (before
    grouped-query attention repeats them, so the fewer kv heads travel), the local queries masked against them by
    `ContextParallelMask`."""

    def __init__(self, attention: nn.Cell, group: Group) -> None:
        super().__init__()
        self.attention = attention
        self.gather_keys, self.gather_values = GatherSequence(group, 2), GatherSequence(group, 2)

    def construct(self, q, k, v, mask):
        return self.attention(q, self.gather_keys(k), self.gather_values(v), mask)


def context_parallel(model: Llama, group: Group) -> None:
    """Swap cp attention and its mask into `model` (whatever layers it holds) in place; nothing for one rank."""
    if group.size == 1:
        return
    model.attention_mask = ContextParallelMask(model.seq_len, group)
    for layer in model.layers:
        layer.self_attn.attention = ContextParallelAttention(layer.self_attn.attention, group)
