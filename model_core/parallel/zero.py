"""ZeRO stages 1 and 2: AdamW moments (1) and gradients too (2) sharded over the data-parallel group.

All parameters, flattened and concatenated in order, are cut into `dp` equal shards (the last one padded,
`shard_pieces`). A rank keeps Adam moments only for its shard, which falls into pieces, one per parameter it
touches; `model_core.parallel.optimizer.AdamW` updates them where the placement table says a weight's state is a
flat shard, and all-gathers the updated shards into every parameter (`ShardGather`). The arithmetic is
element-wise, so the result is the unsharded update, bit for bit up to the gradient sum.

ZeRO-1 sums the full gradients over the group once per step and lets each rank slice its pieces out.
ZeRO-2 keeps no full gradient buffer: each micro-batch's gradients, flattened the same way, are
reduce-scattered over the group bucket by bucket (on a backend without a native reduce-scatter, all-reduced in
contiguous buckets) and only this rank's shard is added into shard-sized buffers, one per piece (`GradientShards`,
which pipeline stages use too); the gradient norm sums the shards' squares over the group. Both stages write the
updated shards back into the weights with a bucketed all-gather (`ShardGather`), and AdamW applies the loss scale
and the clip factor to each gradient piece as it uses it: no buffer the size of the whole model is made at the
update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, nn, ops

from model_core.optim.step import AccumulateGradients
from model_core.parallel.comm import Group
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES, bucket_indices


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `index`, flattened: part of one rank's shard."""

    index: int
    start: int
    end: int


def shard_pieces(sizes: Sequence[int], shards: int, shard: int, length: int | None = None) -> tuple[list[Piece], int]:
    """The pieces of shard `shard` of `shards` over parameters of these sizes, and the shard length: the
    flat parameters split evenly, or into shards of `length` (at least that even split) when given."""
    total = sum(sizes)
    length = max(-(-total // shards), length or 0)
    first, last = shard * length, min(total, (shard + 1) * length)
    pieces, offset = [], 0
    for index, size in enumerate(sizes):
        start, end = max(first, offset), min(last, offset + size)
        if start < end:
            pieces.append(Piece(index, start - offset, end - offset))
        offset += size
    return pieces, length


def gather_plan(
    sizes: Sequence[int], shards: int, length: int, bucket_elements: int
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...], ...]]:
    """How to all-gather `shards` shards of `length` elements (the flat, concatenated parameters of these sizes)
    in buckets: bucket k gathers elements [lo, hi) of every shard (at most `bucket_elements` of each), so its
    result holds shard r's at [r (hi - lo), (r + 1)(hi - lo)). Returns the buckets' (lo, hi) and, for each bucket,
    the parameters it completes: (index, its segments in flat order as (bucket, start, end) of a gathered result)."""
    buckets = tuple((lo, min(lo + bucket_elements, length)) for lo in range(0, length, bucket_elements))
    completions: list[list] = [[] for _ in buckets]
    offset = 0
    for index, size in enumerate(sizes):
        segments = []
        for shard in range(shards):
            first, last = max(offset, shard * length), min(offset + size, (shard + 1) * length)
            for k, (lo, hi) in enumerate(buckets):
                start, end = max(first - shard * length, lo), min(last - shard * length, hi)
                if start < end:
                    base = shard * (hi - lo) - lo
                    segments.append((k, base + start, base + end))
        completions[max(k for k, _, _ in segments)].append((index, tuple(segments)))
        offset += size
    return buckets, tuple(tuple(done) for done in completions)


class ShardGather(nn.Cell):
    """Every parameter set from the ranks' updated shards, bucket by bucket (`gather_plan`): no buffer of the
    whole model is made. Each gathered bucket is cut into the parameters' segments before the next is gathered,
    and a parameter is written once its last segment is in; so besides one bucket, a rank holds the segments of
    the parameters still incomplete (at most one per shard).

    Called with this rank's pieces (`pieces`: (parameter index, start, end), the pieces of `shard_pieces`) as
    tensors in that order."""

    def __init__(self, parameters: Sequence[Parameter], pieces: Sequence[tuple[int, int, int]], length: int,
                 group: Group, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        self.parameters = ParameterTuple(parameters)
        self.group = group
        self.shapes = tuple(tuple(p.shape) for p in parameters)
        sizes = [int(np.prod(shape)) for shape in self.shapes]
        bucket_elements = max(1, bucket_bytes // (4 * group.size))  # a gathered bucket holds bucket_bytes
        self.buckets, completions = gather_plan(sizes, group.size, length, bucket_elements)
        # Segments are numbered in the order they are cut: bucket by bucket, each bucket's in parameter order.
        cuts = [[] for _ in self.buckets]
        numbered = {}
        for done in completions:
            for index, segments in done:
                for segment in segments:
                    cuts[segment[0]].append((index, segment))
        for k in range(len(cuts)):
            cuts[k].sort()
            for index, segment in cuts[k]:
                numbered[(index, segment)] = len(numbered)
        self.cuts = tuple(tuple((start, end) for _, (_, start, end) in bucket) for bucket in cuts)
        self.writes = tuple(
            tuple((index, tuple(numbered[(index, segment)] for segment in segments)) for index, segments in done)
            for done in completions
        )
        self.local = shard_fill(self.buckets, [end - start for _, start, end in pieces])

    def construct(self, pieces, after=None):
        """Write the weights from `pieces`, once `after` (the update that made them), when given, is done."""
        segments = []
        done = ops.zeros((), ms.float32)
        if after is not None:
            done = ops.depend(done, after)
        for k in range(len(self.buckets)):
            parts = [pieces[j].reshape(-1)[a:b] if j >= 0 else ops.zeros((b - a,), ms.float32) for j, a, b in self.local[k]]
            mine = ops.cat(parts) if len(parts) > 1 else parts[0]
            bucket = self.group.all_gather(ops.depend(mine, done))
            for start, end in self.cuts[k]:
                segments.append(bucket[start:end])
                done = ops.depend(done, segments[-1])  # the next gather waits until this bucket is cut up
            for i, numbers in self.writes[k]:
                values = [segments[n] for n in numbers]
                value = ops.cat(values) if len(values) > 1 else values[0]
                done = ops.assign(self.parameters[i], value.reshape(self.shapes[i]).astype(self.parameters[i].dtype))
        return done


def shard_fill(buckets, lengths: Sequence[int]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """For each bucket [lo, hi), what fills it from this rank's pieces (of these lengths, laid end to end from the
    shard's start): (piece, start, end) of a piece, or (-1, 0, n) for n zeros of padding after the last piece."""
    filled = []
    for lo, hi in buckets:
        parts, offset = [], 0
        for j, length in enumerate(lengths):
            first, last = max(lo, offset), min(hi, offset + length)
            if first < last:
                parts.append((j, first - offset, last - offset))
            offset += length
        padding = hi - lo - sum(end - start for _, start, end in parts)
        if padding:
            parts.append((-1, 0, padding))
        filled.append(tuple(parts))
    return tuple(filled)


class GradientShards(nn.Cell):
    """ZeRO-2's gradient store: fp32 `buffers`, one per piece of this rank's shard of the weights' flattened,
    concatenated gradients (the pieces the optimizer updates where a weight's state is a flat shard). Called inside
    a compiled step with one micro-batch's full gradients, it sums them over the group bucket by bucket, each of at
    most `bucket_bytes` before the reduction, and adds this rank's shard in: no flat copy of all the gradients is
    made, only one bucket's at a time.

    With a native reduce-scatter the buckets are those of `gather_plan` (bucket k: elements [lo, hi) of every
    rank's shard), reduce-scattered. Without one (the CPU's MCCL) a reduce-scatter is an all-reduce of the whole
    bucket anyway, so the buckets are contiguous runs of the flat gradients instead (`contiguous_buckets`), taken
    last weight first as the backward makes them; each is all-reduced, and only its parts inside this rank's shard
    are added in. A `gather_plan` bucket joins the end of one shard with the end of the next, so its first one waits
    for the backward to reach the middle of the model while the later shards' fresh gradients stay alive; a
    contiguous bucket is ready as soon as its own weights' gradients are. Every rank runs the same all-reduces,
    those of buckets outside its shard included.

    `shard_length` (`shard_pieces`) lets two pipeline stages that hold the same tied table first cut it at
    the same offsets, so its gradient pieces can be summed over the two stages piece by piece.

    The buckets run as one chain, in `order`; `ready[k]` is the first weight bucket k reads, which the backward
    reaches last: `expert.ExpertGradientShards` merges two stores' chains by it (`merged_order`)."""

    def __init__(self, weights: Sequence[Parameter], group: Group, shard_length: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        sizes = [int(np.prod(w.shape)) for w in weights]
        pieces, self.shard_length = shard_pieces(sizes, group.size, group.index, shard_length)
        self.buffers = ParameterTuple(
            Parameter(
                ops.zeros((p.end - p.start,), ms.float32),
                name=f"grad_shard.{weights[p.index].name}.{p.start}",
                requires_grad=False,
            )
            for p in pieces
        )
        self.group = group
        self.piece_params = tuple(p.index for p in pieces)  # the weight each buffer is a piece of
        self.piece_lengths = tuple(p.end - p.start for p in pieces)
        self.all_reduced = group.size == 1 or not group.native_reduce_scatter
        if self.all_reduced:
            self.plan = contiguous_buckets(sizes, group.size, self.shard_length, pieces, max(1, bucket_bytes // 4))
            self.order = tuple(range(len(self.plan)))  # already last weight first
            self.ready = tuple(min(i for i, _, _ in units) for units, _ in self.plan)
            self.last_sum = Parameter(ops.zeros((1,), ms.float32), name=f"grad_shard.last_sum.{weights[-1].name}",
                                      requires_grad=False)
        else:
            buckets, completions = gather_plan(sizes, group.size, self.shard_length,
                                               max(1, bucket_bytes // (4 * group.size)))
            self.buckets = buckets
            self.inputs = bucket_inputs(buckets, completions, group.size)
            self.completions = piece_completions(buckets, self.piece_lengths)
            self.order = tuple(range(len(buckets) - 1, -1, -1))  # the last bucket first: the last weights are first
            self.ready = tuple(min((i for i, _, _ in parts if i >= 0), default=len(sizes)) for parts in self.inputs)

    def construct(self, grads):
        done, reduced = ops.zeros((), ms.float32), self.no_sums()
        for k in self.order:
            done, reduced = self.sum_bucket(k, grads, done, reduced)
        return self.finish(done)

    def no_sums(self):
        """The buckets' reduced blocks before any is summed (the native path completes a piece from several)."""
        return tuple(ops.zeros((), ms.float32) for _ in self.order) if not self.all_reduced else ()

    def finish(self, done):
        """What the step keeps of the chain of sums: on the all-reduce path its last sum, written into `last_sum`
        (jit drops a sum whose result nothing uses: a rank whose shard misses the last buckets would skip their
        all-reduces, which the other ranks wait in)."""
        if self.all_reduced:
            return ops.assign(self.last_sum, done.reshape(-1)[:1])
        return done

    def sum_bucket(self, k, grads, done, reduced):
        """Bucket k summed over the group once `done` is, and this rank's part added into its piece buffers:
        returns what the next bucket waits for, and `reduced` with bucket k's block on the native path. A bucket's
        flat fp32 input is cut from the gradients only then: made as soon as the gradients exist, every bucket's
        would be alive at once, waiting for its turn."""
        if self.all_reduced:
            units, adds = self.plan[k]
            parts = [ops.depend(grads[i], done).reshape(-1)[start:end].astype(ms.float32) for i, start, end in units]
            summed = self.group.all_reduce(ops.cat(parts) if len(parts) > 1 else parts[0])
            done = summed
            for j, at in adds:
                done = ops.depend(done, ops.assign_add(self.buffers[j], summed[at : at + self.piece_lengths[j]]))
            return done, reduced
        parts = []
        for i, start, end in self.inputs[k]:
            if i < 0:
                parts.append(ops.depend(ops.zeros((end - start,), ms.float32), done))
            else:
                parts.append(ops.depend(grads[i], done).reshape(-1)[start:end].astype(ms.float32))
        done = self.group.reduce_scatter(ops.cat(parts) if len(parts) > 1 else parts[0])  # this rank's [lo, hi), summed
        reduced = reduced[:k] + (done,) + reduced[k + 1:]
        for j, segments in self.completions[k]:
            values = [reduced[b][start:end] for b, start, end in segments]
            ops.assign_add(self.buffers[j], ops.cat(values) if len(values) > 1 else values[0])
        return done, reduced


def merged_order(readiness: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """One chain of several stores' buckets, as (store, position in its `order`): each store's own order kept, and
    of the stores' next buckets the one the backward finishes first (the highest `ready`; ties to the first store)
    taken first. Computed from sizes alone, so every rank runs the stores' collectives in the same order."""
    heads, chain = [0] * len(readiness), []
    while any(head < len(ready) for head, ready in zip(heads, readiness)):
        store = max((s for s, ready in enumerate(readiness) if heads[s] < len(ready)),
                    key=lambda s: (readiness[s][heads[s]], -s))
        chain.append((store, heads[store]))
        heads[store] += 1
    return tuple(chain)


def contiguous_buckets(sizes: Sequence[int], shards: int, length: int, pieces: Sequence[Piece], bucket_elements: int
                       ) -> tuple[tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]], ...]:
    """The all-reduce buckets of `GradientShards` without a native reduce-scatter: each weight's flat gradient (of
    these sizes) cut at the boundaries of `shards` shards of `length` into units inside one shard each, taken last
    weight first and grouped, consecutive, into buckets of at most `bucket_elements` (a larger unit stands alone).
    Per bucket: its units (weight, start, end) in order, and this rank's `pieces` (`shard_pieces`) among them as
    (piece, offset in the bucket); a unit of this rank's shard is one whole piece."""
    offsets = np.cumsum([0, *sizes]).tolist()
    mine = {(p.index, p.start): j for j, p in enumerate(pieces)}
    units = []
    for index in reversed(range(len(sizes))):
        for shard in range(shards):
            start = max(offsets[index], shard * length) - offsets[index]
            end = min(offsets[index + 1], (shard + 1) * length) - offsets[index]
            if start < end:
                units.append((index, start, end))
    plan = []
    for bucket in bucket_indices([end - start for _, start, end in units], bucket_elements):
        members, adds, at = tuple(units[u] for u in bucket), [], 0
        for index, start, end in members:
            if (index, start) in mine:
                adds.append((mine[(index, start)], at))
            at += end - start
        plan.append((members, tuple(adds)))
    return tuple(plan)


def bucket_inputs(buckets, completions, shards: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """What each bucket of a reduce-scatter is made of, in order: (weight, start, end) of a flattened gradient, or
    (-1, 0, n) for n zeros (padding past the last weight): the `gather_plan` layout of `shards` shards read
    backwards, so that block r of bucket k is elements [lo, hi) of shard r."""
    placed: list[list[tuple[int, int, int, int]]] = [[] for _ in buckets]  # (position, weight, start, end)
    for done in completions:
        for index, segments in done:
            offset = 0
            for b, start, end in segments:
                placed[b].append((start, index, offset, offset + end - start))
                offset += end - start
    inputs = []
    for (lo, hi), items in zip(buckets, placed):
        parts, position = [], 0
        for at, index, start, end in sorted(items):
            if at > position:
                parts.append((-1, 0, at - position))
            parts.append((index, start, end))
            position = at + end - start
        if position < shards * (hi - lo):
            parts.append((-1, 0, shards * (hi - lo) - position))
        inputs.append(tuple(parts))
    return tuple(inputs)


def piece_completions(buckets, lengths: Sequence[int]) -> tuple[tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...], ...]:
    """For each bucket, the pieces of this rank's shard (of these lengths, laid end to end from its start) that
    the bucket completes when the buckets are reduced last first: (piece, its segments as (bucket, start, end) of
    the buckets' reduced blocks)."""
    completions: list[list] = [[] for _ in buckets]
    offset = 0
    for j, length in enumerate(lengths):
        segments = []
        for k, (lo, hi) in enumerate(buckets):
            first, last = max(lo, offset), min(hi, offset + length)
            if first < last:
                segments.append((k, first - lo, last - lo))
        completions[min(k for k, _, _ in segments)].append((j, tuple(segments)))
        offset += length
    return tuple(tuple(done) for done in completions)


class ShardedAccumulateGradients(AccumulateGradients):
    """ZeRO-2 accumulation: forward + backward of one micro-batch, its gradients reduce-scattered into `shards`, a
    store over `model`'s trainable weights: `GradientShards` over dp, or under expert parallelism
    `expert.ExpertGradientShards` (the expert stacks' over expert-dp). Its fp32 buffers, one per piece of this
    rank's shard, are the ones the optimizer updates; `buffers`, `piece_params` and the (dense) `shard_length` are
    the store's. `loss` as for `AccumulateGradients` (tensor parallelism passes its vocab-parallel one)."""

    def __init__(self, model: nn.Cell, shards: nn.Cell, loss: nn.Cell | None = None) -> None:
        super().__init__(model, shards.buffers, loss)
        self.shards = shards
        self.piece_params = shards.piece_params
        self.shard_length = shards.shard_length

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads = self.value_and_grad(tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise)
        self.shards(grads)
        if self.routed:  # an MoE model's routing statistics ride along, as in `AccumulateGradients`
            return outputs[1], outputs[2]
        return outputs[1]
