"""Data parallelism, applied from outside the model: every dp rank runs the whole model on its slice of the
global batch, and the accumulated gradients are summed over the dp group once per optimizer step.

The gradients are *summed*, not averaged: the trainer scales each micro-batch's summed token loss by
1 / (tokens counted in the whole global batch, over all ranks), so the sum over ranks is exactly the
gradient of the mean loss over the global batch, as one process training on all of it would compute.
The sum runs over a few flat buckets (`bucket_bytes` each, parameters in model order) rather than one
all-reduce per parameter: each collective has a fixed latency, whatever its size.

With `parallel.overlap_gradient_reduction` (off by default), in a step of one micro-batch, the sum is part of its
backward graph (`AccumulateAndSumGradients`; with several micro-batches the sum runs after them, since a second
compiled backward beside the plain accumulation's would keep as much memory again): each bucket, taken in the
order the backward finishes gradients (last layers first), is summed once its own gradients exist, as Megatron's
and PyTorch DDP's bucketed reducers do with backward hooks. The arithmetic is the same: (buffer + the
micro-batch's gradient), summed over the group. What it buys depends on the execution order the graph compiler
builds: MindSpore's kernel-by-kernel order runs a collective's successors only once the compute that is ready
beside it has run, so each bucket after the first (its flat input waits for the previous bucket's write-back)
is summed only after the backward, its gradients alive until then. Summed after the backward, in a graph of its
own, a step holds at most a bucket beside the buffers.
A communication thread has no such place to start from: the backward is one compiled graph, so its gradients
reach Python together when it ends; a thread could only sum the earlier micro-batches' gradients while the
last one computes, moving twice the bytes in another summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from model_core.parallel import heartbeat
from model_core.parallel.comm import Group

DEFAULT_BUCKET_BYTES = 32 * 2**20


def bucket_indices(sizes_in_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices grouped so each group holds at most `bucket_bytes` (a larger item stands alone)."""
    buckets: list[list[int]] = []
    filled = bucket_bytes
    for index, size in enumerate(sizes_in_bytes):
        if filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets


class GradientAllReduce(nn.Cell):
    """Sum the gradient buffers over the group, in place, one flat all-reduce per bucket of at most `bucket_bytes`.

    A buffer larger than a bucket is summed a run of its elements at a time, each run written back into it in place
    (`partial_writes`): besides the buffers a rank then holds one bucket and its sum, however large a weight is (a
    vocabulary table spans several buckets). Summed whole, such a buffer was held three times over: its flat copy,
    the sum and the slice written back."""

    def __init__(self, buffers: ParameterTuple, group: Group, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        self.buffers = buffers
        self.group = group
        shapes = [tuple(b.shape) for b in buffers]
        runs = [(i, start, end) for i, buffer in enumerate(buffers)
                for start, end in bucket_runs(shapes[i], buffer.itemsize, bucket_bytes)]
        nbytes = [(end - start) * buffers[i].itemsize for i, start, end in runs]
        reads, writes, indices = [], [], []
        for bucket in bucket_indices(nbytes, bucket_bytes):
            bucket_writes, offset = [], 0  # offset: where the run starts in the bucket's sum
            for i, start, end in (runs[j] for j in bucket):
                if end - start == int(np.prod(shapes[i])):  # the whole buffer
                    bucket_writes.append((i, offset, offset + end - start, shapes[i], -1))
                else:
                    for lo, hi, where, shape in partial_writes(shapes[i], start, end):
                        bucket_writes.append((i, offset + lo - start, offset + hi - start, shape, len(indices)))
                        indices.append(Tensor(where, ms.int32))
                offset += end - start
            reads.append(tuple(runs[j] for j in bucket))
            writes.append(tuple(bucket_writes))
        self.reads, self.writes, self.indices = tuple(reads), tuple(writes), tuple(indices)

    @ms.jit
    def construct(self):
        # Each bucket is flattened only once the previous one is written back: the concatenations read Parameters
        # alone, so the compiled graph would otherwise make every bucket's flat copy at its start, all at once.
        done = ops.zeros((), ms.float32)
        for k in range(len(self.reads)):
            parts = [ops.depend(self.buffers[i], done).reshape(-1)[start:end] for i, start, end in self.reads[k]]
            summed = self.group.all_reduce(ops.cat(parts) if len(parts) > 1 else parts[0])
            for i, lo, hi, shape, where in self.writes[k]:
                value = (summed if hi - lo == summed.shape[0] else summed[lo:hi]).reshape(shape)
                if where < 0:
                    written = ops.assign(self.buffers[i], value)
                else:
                    written = ops.scatter_nd_update(self.buffers[i], self.indices[where], value)
                done = ops.depend(done, written)  # every write before the next bucket: a later one keeps this alive
        return True


def bucket_runs(shape: Sequence[int], itemsize: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, end) runs of flat elements a buffer of `shape` is summed in: all of it when it fits a bucket, else runs
    of at most a bucket, cut between rows (of the last axis) where a row fits in one."""
    size = int(np.prod(shape))
    per_bucket = max(bucket_bytes // itemsize, 1)
    if size <= per_bucket:
        return [(0, size)]
    row = shape[-1] if len(shape) > 1 else 1
    step = per_bucket // row * row if row <= per_bucket else per_bucket
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def write_back(buffers, bucket, flat, sizes, shapes):
    """Buffers `bucket` (indices) take their consecutive pieces of the flat summed bucket; returns the last write."""
    offset, done = 0, None
    for i in bucket:
        done = ops.assign(buffers[i], flat[offset : offset + sizes[i]].reshape(shapes[i]))
        offset += sizes[i]
    return done


class AccumulateAndSumGradients(nn.Cell):
    """The last micro-batch of a step: forward + backward, its gradients added to the buffers, and every buffer
    that the layout sums summed over its groups inside the same graph, bucket by bucket in backward order.

    `sums[i]` lists the groups buffer i is summed over, in order (a tp-partial gradient over tp, then over dp;
    an expert's over its expert-dp group); an empty list only accumulates. Buffers with the same groups share
    buckets of at most `bucket_bytes`."""

    def __init__(self, accumulate: nn.Cell, sums: Sequence[Sequence[Group]], bucket_bytes: int) -> None:
        super().__init__()
        self.accumulate = accumulate
        self.buffers = accumulate.buffers
        self.routed = accumulate.routed
        self.shapes = tuple(tuple(b.shape) for b in self.buffers)
        self.sizes = tuple(int(np.prod(shape)) for shape in self.shapes)
        kinds: list[tuple[Group, ...]] = []
        for groups in sums:
            if tuple(groups) not in kinds:
                kinds.append(tuple(groups))
        self.kinds = nn.CellList([nn.CellList(list(groups)) for groups in kinds])
        backward_order = range(len(self.buffers) - 1, -1, -1)  # the last layers' gradients are final first
        buckets, self.accumulated_only = [], tuple(i for i in backward_order if not sums[i])
        for kind, members in groupby(sorted((i for i in backward_order if sums[i]),
                                            key=lambda i: (kinds.index(tuple(sums[i])), -i)),
                                     key=lambda i: kinds.index(tuple(sums[i]))):
            members = list(members)
            nbytes = [self.sizes[i] * self.buffers[i].itemsize for i in members]
            buckets += [(kind, tuple(members[j] for j in bucket)) for bucket in bucket_indices(nbytes, bucket_bytes)]
        self.buckets = tuple(sorted(buckets, key=lambda bucket: -bucket[1][0]))

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads, rows_grad = self.accumulate.backward(tokens, labels, loss_mask, position_ids, segment_ids,
                                                             scale, router_noise)
        grads = self.accumulate.dense_gradients(tokens, grads, rows_grad)
        done = ops.zeros((), ms.float32)
        for kind, bucket in self.buckets:  # each flattened once the previous is written back (`GradientAllReduce`)
            flat = ops.cat([(ops.depend(self.buffers[i], done) + grads[i].astype(self.buffers[i].dtype)).reshape(-1)
                            for i in bucket])
            for group in self.kinds[kind]:
                flat = group.all_reduce(flat)
            done = write_back(self.buffers, bucket, flat, self.sizes, self.shapes)
        for i in self.accumulated_only:
            ops.assign_add(self.buffers[i], grads[i].astype(self.buffers[i].dtype))
        if self.routed:
            return outputs[1], outputs[2]
        return outputs[1]


def sum_over(group: Group, values: Sequence[float]) -> list[float]:
    """Python numbers summed over the group (token counts, summed losses): one small all-reduce.

    The CPU all-reduce has no float64, so each value travels as a float32 pair (high part, remainder),
    which keeps about 48 bits of the sum instead of float32's 24."""
    if group.size == 1:
        return list(values)
    exact = np.asarray(values, dtype=np.float64)
    high = exact.astype(np.float32)
    low = (exact - high).astype(np.float32)
    with heartbeat.collective("all_reduce", group.ranks):
        total = group.all_reduce(Tensor(np.stack([high, low]))).asnumpy().astype(np.float64)
    return [float(v) for v in total[0] + total[1]]


def partial_writes(shape: Sequence[int], start: int, end: int) -> list[tuple[int, int, np.ndarray, tuple[int, ...]]]:
    """How to write flat elements [start, end) of a parameter of `shape` in place with `ops.scatter_nd_update`:
    (lo, hi, indices, value shape) for runs of whole rows (the last axis) and for the single elements of a row cut
    at either end, lo and hi the run's flat elements. A vector's elements are its rows."""
    if len(shape) == 1:
        return [(start, end, np.arange(start, end).reshape(-1, 1), (end - start,))]
    row = shape[-1]
    leading = tuple(shape[:-1])
    runs = []
    first, last = -(-start // row), end // row  # the whole rows inside [start, end)
    if first > last:  # inside one row
        return [element_run(leading, row, start, end)]
    if start < first * row:
        runs.append(element_run(leading, row, start, first * row))
    if first < last:
        rows = np.stack(np.unravel_index(np.arange(first, last), leading), axis=1)
        runs.append((first * row, last * row, rows, (last - first, row)))
    if last * row < end:
        runs.append(element_run(leading, row, last * row, end))
    return runs


def element_run(leading: tuple[int, ...], row: int, start: int, end: int) -> tuple[int, int, np.ndarray, tuple[int, ...]]:
    """`partial_writes`' run of single elements [start, end) of one row."""
    elements = np.arange(start, end)
    where = np.stack([*np.unravel_index(elements // row, leading), elements % row], axis=1)
    return start, end, where, (end - start,)
