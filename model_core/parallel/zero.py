"""ZeRO stages 1 and 2: AdamW moments (1) and gradients too (2) sharded over the data-parallel group.

All parameters, flattened and concatenated in order, are cut as Megatron's distributed optimizer cuts them
(`FlatShards`): into buckets of at most `parallel.gradient_bucket_mb`, each split into `dp` equal blocks, a rank
keeping its block of every bucket. A rank keeps Adam moments only for its shard, which falls into pieces, one per
parameter and bucket it touches; `model_core.parallel.optimizer.AdamW` updates them where the placement table says
a weight's state is a flat shard, and all-gathers the updated shards into every parameter bucket by bucket
(`ShardGather`). The arithmetic is element-wise, so the result is the unsharded update, bit for bit up to the
gradient sum.

ZeRO-1 sums the full gradients over the group once per step and lets each rank slice its pieces out.
ZeRO-2 keeps no full gradient buffer: each micro-batch's gradients are reduce-scattered over the group bucket by
bucket, the last bucket first as soon as the backward has made its gradients, and only this rank's block is added
into shard-sized buffers, one per piece (`GradientShards`, which pipeline stages use too); the gradient norm sums
the shards' squares over the group. Both stages write the updated shards back into the weights with the bucketed
all-gather, and AdamW applies the loss scale and the clip factor to each gradient piece as it uses it: no buffer
the size of the whole model is made at the update.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model_core.optim.step import AccumulateGradients
from model_core.parallel.comm import Group, ReleasingReduceScatter
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES, partial_writes


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `index`, flattened: part of one rank's shard."""

    index: int
    start: int
    end: int


@dataclass(frozen=True)
class FlatShards:
    """How a group's parameters, flattened and concatenated in order (`total` elements), are cut over its `shards`
    ranks, as Megatron's distributed optimizer cuts them: into buckets of `shards` blocks of `chunk` elements, rank r
    keeping block r of every bucket (the last bucket zero-padded). A rank's shard is its blocks end to end: `length`
    = buckets x chunk elements, its real elements first.

    Buckets rather than one block a rank: a bucket is a contiguous run of the flat gradients, reduce-scattered as
    soon as the backward has made its weights' gradients (the last bucket first), and the update's all-gather of a
    bucket rebuilds a contiguous run of weights. With one block a rank, every reduce-scatter would join a piece of
    every rank's block: the first would wait for the backward to reach the end of shard 0, and every fresh gradient
    made before then would wait with it (at dp32, nearly a whole set)."""

    total: int
    shards: int
    chunk: int

    @property
    def buckets(self) -> int:
        return max(1, -(-self.total // (self.shards * self.chunk)))

    @property
    def length(self) -> int:
        return self.buckets * self.chunk

    def pieces(self, sizes: Sequence[int], shard: int) -> list[Piece]:
        """The pieces of shard `shard` over parameters of these sizes, in shard order (which is flat order)."""
        offsets = np.cumsum([0, *sizes]).tolist()
        pieces = []
        for bucket in range(self.buckets):
            lo = (bucket * self.shards + shard) * self.chunk
            hi = min(lo + self.chunk, self.total)
            index = bisect.bisect_right(offsets, lo) - 1
            while lo < hi:
                end = min(hi, offsets[index + 1])
                if lo < end:
                    pieces.append(Piece(index, lo - offsets[index], end - offsets[index]))
                lo, index = end, index + 1
        return pieces

    def bucket_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each bucket's [lo, hi) in a shard: the block a rank sends to (and gets from) the bucket's collective."""
        return tuple((k * self.chunk, (k + 1) * self.chunk) for k in range(self.buckets))

    def unshard(self, gathered: np.ndarray) -> np.ndarray:
        """The flat parameters from every rank's shard (`shards` x `length`, in group order)."""
        blocks = np.asarray(gathered).reshape(self.shards, self.buckets, self.chunk)
        return blocks.transpose(1, 0, 2).reshape(-1)[: self.total]


# Blocks are a multiple of this many elements (where a bucket holds that many a rank): the pieces then start and end
# on the same vector lanes in the update's kernels whichever way the pieces are grouped (in memory one call a piece,
# offloaded one call a staging bucket), which keeps the two bit for bit equal.
BLOCK_ALIGNMENT = 64


def flat_shards(sizes: Sequence[int], shards: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                chunk: int | None = None) -> FlatShards:
    """The `FlatShards` of parameters of these sizes over `shards` ranks: buckets of at most `bucket_bytes` of fp32,
    as few as that allows, cut evenly in blocks of a multiple of `BLOCK_ALIGNMENT` elements where they hold that
    many (so the padding is under that many elements a bucket and rank); or in blocks of `chunk` where given (a
    pipeline's two end stages share one, so their tied table, first on both, is cut alike)."""
    total = sum(sizes)
    if chunk is None:
        most = max(1, bucket_bytes // (4 * shards))
        align = BLOCK_ALIGNMENT if min(most, total // shards) >= BLOCK_ALIGNMENT else 1
        most -= most % align
        buckets = max(1, -(-total // (shards * most)))
        chunk = max(1, -(-total // (shards * buckets * align)) * align)
    return FlatShards(total, shards, chunk)


def gather_plan(sizes: Sequence[int], layout: FlatShards) -> tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]:
    """For each bucket of `layout` (whose all-gather gives flat elements [k B, (k + 1) B), B = shards x chunk), the
    parameters it completes when the buckets are gathered first to last: (index, its segments in flat order as
    (bucket, start, end) of a gathered bucket)."""
    width = layout.shards * layout.chunk
    completions: list[list] = [[] for _ in range(layout.buckets)]
    offset = 0
    for index, size in enumerate(sizes):
        segments = tuple((k, max(offset, k * width) - k * width, min(offset + size, (k + 1) * width) - k * width)
                         for k in range(offset // width, (offset + size - 1) // width + 1))
        completions[segments[-1][0]].append((index, segments))
        offset += size
    return tuple(tuple(done) for done in completions)


class ShardGather(nn.Cell):
    """Every parameter set from the ranks' updated shards, bucket by bucket (`FlatShards`: bucket k's all-gather
    gives a contiguous run of the flat parameters): no buffer of the whole model is made. Each gathered bucket is
    written into the parameters it meets before the next is gathered: a parameter inside the bucket whole, one that
    crosses a bucket's edge the rows and elements of it that the bucket holds, in place (`ops.scatter_nd_update`).
    So besides one bucket a rank holds only the slice of it being written, never a whole parameter's copy, however
    many buckets the parameter spans (a vocabulary table spans several).

    Called with this rank's pieces (`pieces`: (parameter index, start, end), the pieces of `layout.pieces`) as
    tensors in that order."""

    def __init__(self, parameters: Sequence[Parameter], pieces: Sequence[tuple[int, int, int]], layout: FlatShards,
                 group: Group) -> None:
        super().__init__()
        self.parameters = ParameterTuple(parameters)
        self.group = group
        self.shapes = tuple(tuple(p.shape) for p in parameters)
        self.buckets = layout.bucket_ranges()
        writes: list[list] = [[] for _ in self.buckets]
        indices = []
        for done in gather_plan([int(np.prod(shape)) for shape in self.shapes], layout):
            for index, segments in done:
                if len(segments) == 1:  # inside one bucket: written whole
                    k, start, end = segments[0]
                    writes[k].append((index, start, end, self.shapes[index], -1))
                    continue
                offset = 0
                for k, start, end in segments:
                    for lo, hi, where, shape in partial_writes(self.shapes[index], offset, offset + end - start):
                        writes[k].append((index, start + lo - offset, start + hi - offset, shape, len(indices)))
                        indices.append(Tensor(where, ms.int32))
                    offset += end - start
        self.writes = tuple(tuple(bucket) for bucket in writes)
        self.indices = tuple(indices)
        self.local = shard_fill(self.buckets, [end - start for _, start, end in pieces])
        # A bucket whose parameters share one dtype is gathered in it: every rank casts its block before the
        # all-gather instead of every rank casting the whole gathered bucket after it (the same bits, since a cast
        # is elementwise), so a mixed-precision rank holds and moves the bucket at the compute dtype's width.
        self.dtypes = tuple(bucket_dtype({self.parameters[i].dtype for i, *_ in bucket}) for bucket in self.writes)

    def construct(self, pieces, after=None):
        """Write the weights from `pieces`, once `after` (the update that made them), when given, is done."""
        done = ops.zeros((), ms.float32)
        if after is not None:
            done = ops.depend(done, after)
        for k in range(len(self.buckets)):
            parts = [ops.depend(pieces[j], done).reshape(-1)[a:b] if j >= 0 else ops.zeros((b - a,), ms.float32)
                     for j, a, b in self.local[k]]
            mine = ops.cat(parts) if len(parts) > 1 else parts[0]
            done = self.bucket(k, mine, done)
        return done

    def bucket(self, k, mine, done):
        """Bucket k gathered from this rank's block of it (`mine`, once `done` exists) and written into the parameters
        it meets; returns what the next bucket waits for. The optimizer calls it directly where it updates the
        blocks one bucket at a time in one scratch buffer."""
        bucket = self.group.all_gather(ops.depend(mine, done).astype(self.dtypes[k]))
        for i, start, end, shape, where in self.writes[k]:
            value = bucket[start:end].reshape(shape).astype(self.parameters[i].dtype)
            if where < 0:
                written = ops.assign(self.parameters[i], value)
            else:
                written = ops.scatter_nd_update(self.parameters[i], self.indices[where], value)
            # Every write goes before the next gather: a write left for later keeps the bucket alive.
            done = ops.depend(done, written)
        return done


def bucket_dtype(dtypes):
    """The dtype a bucket meeting parameters of these dtypes is gathered in: theirs where they share one, else
    fp32 (the updated shards' own)."""
    return next(iter(dtypes)) if len(dtypes) == 1 else ms.float32


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
    """ZeRO-2's gradient store: fp32 `buffers`, one per piece of this rank's shard (`FlatShards`) of the weights'
    flattened, concatenated gradients (the pieces the optimizer updates where a weight's state is a flat shard).
    Called inside a compiled step with one micro-batch's full gradients, it reduce-scatters them over the group
    bucket by bucket, the last bucket first as the backward makes them, and adds this rank's block of each into its
    pieces: no flat copy of all the gradients is made, only one bucket's at a time, and each bucket goes as soon as
    its own weights' gradients exist. (Without a native reduce-scatter, the CPU's MCCL, the group all-reduces the
    bucket and keeps its block: the same buckets, the same bits.)

    A bucket's flat input is cut from the gradients once the bucket before's input exists, not once its block has
    been added: every rank then issues the collectives in the chain's order, and no bucket waits for a collective's
    result. Each bucket's collective is a `comm.ReleasingReduceScatter`, so its block is added, and its gradients
    freed, while the backward goes on (through the group's plain collective the additions, and every later bucket's
    gradients, would wait for the backward's end).

    `chunk` (`flat_shards`) lets two pipeline stages that hold the same tied table first cut it alike, so its
    gradient pieces can be summed over the two stages piece by piece.

    The buckets run as one chain, in `order`; `ready[k]` is the first weight bucket k reads, which the backward
    reaches last: `expert.ExpertGradientShards` merges two stores' chains by it (`merged_order`).

    `early`: a weight whose gradient comes in two parts, the first made at the backward's start and the other at its
    end: a tied table's, the head's gradient and the looked-up rows' (`ShardedAccumulateGradients`). Called with the
    first part as `early_grad`, the store reduce-scatters it ahead of the chain, in the buckets that hold the weight
    (zeros elsewhere in them), and adds its blocks into the weight's pieces; `grads` then carry the other part. Summed
    in one with the rows at the end, the head's gradient (vocabulary x hidden) stayed alive through the whole
    backward. The cost: the weight's buckets are reduced twice a micro-batch."""

    def __init__(self, weights: Sequence[Parameter], group: Group, chunk: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, early: int = -1) -> None:
        super().__init__()
        sizes = [int(np.prod(w.shape)) for w in weights]
        self.sizes = tuple(sizes)
        self.layout = flat_shards(sizes, group.size, bucket_bytes, chunk)
        pieces = self.layout.pieces(sizes, group.index)
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
        self.shard_chunks = {"dp": self.layout.chunk}
        self.inputs = bucket_inputs(sizes, self.layout)
        self.adds = block_pieces(self.layout.bucket_ranges(), self.piece_lengths)
        self.order = tuple(range(self.layout.buckets - 1, -1, -1))  # the last weights' gradients are made first
        self.ready = tuple(min((i for i, _, _ in parts if i >= 0), default=len(sizes)) for parts in self.inputs)
        # jit drops a sum whose result nothing uses: on a rank whose shard misses the last buckets the chain's end
        # would be unused, and the rank would skip collectives the others wait in. Written here, it is kept.
        self.last_sum = Parameter(ops.zeros((1,), ms.float32), name=f"grad_shard.last_sum.{weights[-1].name}",
                                  requires_grad=False)
        self.sums = nn.CellList([ReleasingReduceScatter(group) for _ in range(self.layout.buckets)])
        self.early = early
        self.early_buckets = early_buckets(self.inputs, early) if early >= 0 else ()
        # The early gradient is passed alone: its parts read input 0.
        self.early_inputs = tuple(tuple((0, start, end) if i == early else (-1, 0, end - start)
                                        for i, start, end in self.inputs[k]) for k in self.early_buckets)
        self.early_sizes = (self.sizes[early],) if early >= 0 else ()
        self.early_adds = tuple(tuple(add for add in self.adds[k] if self.piece_params[add[0]] == early)
                                for k in self.early_buckets)
        self.early_sums = nn.CellList([ReleasingReduceScatter(group) for _ in self.early_buckets])

    def construct(self, grads, early_grad=None):
        done = ops.zeros((), ms.float32)
        previous = done
        if early_grad is not None:
            for n in range(len(self.early_buckets)):
                previous, done = self.reduce(self.early_inputs[n], self.early_adds[n], self.early_sums[n],
                                             (early_grad,), self.early_sizes, previous, done)
        for k in self.order:
            previous, done = self.sum_bucket(k, grads, previous, done)
        return self.finish(done)

    def finish(self, done):
        """The end of the chain of sums, written into `last_sum`."""
        return ops.assign(self.last_sum, done.reshape(-1)[:1])

    def sum_bucket(self, k, grads, previous, done):
        """Bucket k's flat fp32 input, cut from the gradients once `previous` (the chain's last input) exists,
        reduce-scattered, and its block added into the pieces it holds: returns (the input, `done` joined with the
        additions). The wait for `previous` also keeps the inputs from being cut as soon as the gradients exist,
        which would make every bucket's at once."""
        return self.reduce(self.inputs[k], self.adds[k], self.sums[k], grads, self.sizes, previous, done)

    def reduce(self, inputs, adds, collective, grads, sizes, previous, done):
        """`sum_bucket` of a bucket made of `inputs` ((input, start, end), -1 for zeros) of `grads` (of `sizes`),
        added into `adds` through `collective`."""
        parts = []
        for i, start, end in inputs:
            if i < 0:  # what the blocks no piece takes hold: zeros made at run time, not a constant of the graph
                parts.append(ops.broadcast_to(ops.depend(ops.zeros((1,), ms.float32), previous), (end - start,)))
            elif end - start == sizes[i]:
                parts.append(ops.depend(grads[i], previous).reshape(-1))
            else:
                parts.append(ops.depend(grads[i], previous).reshape(-1)[start:end])
        flat = flat_fp32(parts)
        block = collective(flat)  # this rank's, summed
        done = ops.depend(done, block)  # kept where this rank holds no piece of the bucket (see `last_sum`)
        for j, start, end in adds:
            done = ops.depend(done, ops.assign_add(self.buffers[j], block[start:end]))
        return flat, done


def early_buckets(inputs, weight: int) -> tuple[int, ...]:
    """The buckets (of `bucket_inputs`) that hold elements of `weight`, in the order the weight's gradient runs
    through them."""
    return tuple(k for k, parts in enumerate(inputs) if any(i == weight for i, _, _ in parts))


def flat_fp32(parts):
    """The flat parts concatenated in fp32. Consecutive parts of one dtype are concatenated before they are cast, so a
    low-precision run is copied once at its own width and once cast, instead of cast part by part and the fp32 casts
    copied again into the bucket: the same bits, one fp32 bucket-sized buffer fewer alive at once."""
    runs = []
    run = [parts[0]]
    for part in parts[1:]:
        if part.dtype == run[0].dtype:
            run.append(part)
        else:
            runs.append((ops.cat(run) if len(run) > 1 else run[0]).astype(ms.float32))
            run = [part]
    runs.append((ops.cat(run) if len(run) > 1 else run[0]).astype(ms.float32))
    return ops.cat(runs) if len(runs) > 1 else runs[0]


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


def bucket_inputs(sizes: Sequence[int], layout: FlatShards) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """What each bucket of `layout` is made of, in order: (weight, start, end) of a flattened gradient (of these
    sizes), or (-1, 0, n) for n zeros (the padding past the last weight)."""
    width = layout.shards * layout.chunk
    offsets = np.cumsum([0, *sizes]).tolist()
    inputs = []
    for k in range(layout.buckets):
        lo, hi, parts = k * width, (k + 1) * width, []
        index = bisect.bisect_right(offsets, lo) - 1
        while index < len(sizes) and offsets[index] < hi:
            start, end = max(lo, offsets[index]), min(hi, offsets[index + 1])
            if start < end:
                parts.append((index, start - offsets[index], end - offsets[index]))
            index += 1
        if min(hi, layout.total) < hi:
            parts.append((-1, 0, hi - max(lo, layout.total)))
        inputs.append(tuple(parts))
    return tuple(inputs)


def block_pieces(buckets, lengths: Sequence[int]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """For each bucket [lo, hi) of a shard, the pieces of this rank's shard (of these lengths, laid end to end from
    its start) inside its block: (piece, start, end) of the bucket's reduced block. `FlatShards.pieces` cuts a piece
    inside one block, so each piece is in exactly one bucket."""
    adds: list[list] = [[] for _ in buckets]
    offset = 0
    for j, length in enumerate(lengths):
        k = next(k for k, (lo, hi) in enumerate(buckets) if lo <= offset < hi)
        lo, hi = buckets[k]
        if offset + length > hi:
            raise ValueError(f"piece {j} [{offset}, {offset + length}) crosses the block [{lo}, {hi})")
        adds[k].append((j, offset - lo, offset + length - lo))
        offset += length
    return tuple(tuple(bucket) for bucket in adds)


class ShardedAccumulateGradients(AccumulateGradients):
    """ZeRO-2 accumulation: forward + backward of one micro-batch, its gradients reduce-scattered into `shards`, a
    store over `model`'s trainable weights: `GradientShards` over dp, or under expert parallelism
    `expert.ExpertGradientShards` (the expert stacks' over expert-dp). Its fp32 buffers, one per piece of this
    rank's shard, are the ones the optimizer updates; `buffers`, `piece_params` and `shard_chunks` (by group) are
    the store's. `loss` as for `AccumulateGradients` (tensor parallelism passes its vocab-parallel one)."""

    def __init__(self, model: nn.Cell, shards: nn.Cell, loss: nn.Cell | None = None) -> None:
        super().__init__(model, shards.buffers, loss)
        self.shards = shards
        self.piece_params = shards.piece_params
        self.shard_chunks = shards.shard_chunks
        # A tied table's head gradient goes ahead of the chain, where the store takes it (`GradientShards.early`).
        self.head_early = self.tied and getattr(shards, "early", -1) == self.lookup

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads, rows_grad = self.backward(tokens, labels, loss_mask, position_ids, segment_ids, scale,
                                                  router_noise)
        if self.head_early:
            self.shards(self.dense_gradients(tokens, grads, rows_grad, with_head=False),
                        grads[self.slots[self.lookup]])
        else:
            self.shards(self.dense_gradients(tokens, grads, rows_grad))
        if self.routed:  # an MoE model's routing statistics ride along, as in `AccumulateGradients`
            return outputs[1], outputs[2]
        return outputs[1]
