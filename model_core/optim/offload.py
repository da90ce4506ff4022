"""Optimizer offload: AdamW moments that live in a memory-mapped file and pass through memory in buckets.

The moments m and v of every element this rank updates are laid out, in order, in two arrays of a file on local
disk (created under the temp directory, `TMPDIR`, and unlinked at once, so nothing is left behind whatever way the
process ends: the disk space returns when the mapping is dropped, at `close()` or exit). An update walks the file
in buckets of `bucket_elements`: for each bucket it stages the weights' pieces (decayed where AdamW decays them),
the gradients' pieces times the gradient scale, and the bucket's m and v into three fixed staging Parameters,
runs the same fused `ops.Adam` as `model_core.optim.adamw.AdamW`, writes the weights' pieces back in place and
m and v back to the file, and drops the file's pages from this process (`MADV_DONTNEED`; the kernel keeps them in
its page cache and writes them back). Every operation is element-wise and the same kernel as the unoffloaded
update, so the result is that update's, bit for bit; only the bucket is ever resident.

What is updated is a list of `Slot`s: a range of one weight (flattened) and the matching range of its gradient
buffer, one for each piece `model_core.parallel.optimizer.AdamW` updates (a whole weight, a ZeRO-3 shard, or a
piece of a ZeRO-1/2 shard, whose gather that optimizer runs afterwards): offload is where the moments of its
pieces live, not another optimizer. Under
parameter offload (`model_core.parallel.param_offload`) a slot's weight is a `FileWeight`, a range of another
`OffloadFile`, whose pieces are staged from and written back to that file the same way. On the CPU backend, where
host memory is the device, the file is the off-device store (ZeRO-Infinity's NVMe offload).
"""

from __future__ import annotations

import math

import mmap
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from model_core.optim.adamw import adamw_scalars

# 1M fp32 elements: three 4 MiB staging Parameters and their transient copies stay under ~30 MB, a small part of
# the reference model's 235 MB of moments, while ~30 buckets a step keep the per-bucket dispatch cost small.
BUCKET_ELEMENTS = 2**20
# The CPU Adam kernel cuts its input into chunks of size / 2^k (k <= 5 on a 2-thread pool, searched by timing) and
# runs each chunk's last (chunk mod 8) elements through a scalar loop that rounds differently (a double sqrt) from
# its 8-wide loop. A bucket of a multiple of 8 x 2^5 elements is all 8-wide, as is the unoffloaded update of every
# weight whose size is such a multiple (all of the reference model's), so the two agree bit for bit.
BUCKET_ALIGNMENT = 256
FILE_PREFIX = "llmflow-offload-"


@dataclass(frozen=True)
class Slot:
    """Elements [start, end) of `weight` (flattened) take AdamW's update from elements [gradient_start,
    gradient_start + end - start) of gradient buffer number `gradient` (flattened); `name` names the piece."""

    name: str
    weight: Parameter | FileWeight
    start: int
    end: int
    gradient: int
    gradient_start: int
    decays: bool

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _Piece:
    """Elements [offset, offset + length) of slot `slot`, at element `at` of its bucket."""

    slot: int
    offset: int
    length: int
    at: int


def buckets_of(sizes: Sequence[int], bucket_elements: int) -> list[list[_Piece]]:
    """Slots of these sizes laid end to end and cut into buckets of `bucket_elements`."""
    buckets: list[list[_Piece]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            if filled == bucket_elements:
                buckets.append([])
                filled = 0
            length = min(size - offset, bucket_elements - filled)
            buckets[-1].append(_Piece(index, offset, length, filled))
            offset += length
            filled += length
    return buckets


class OffloadFile:
    """`elements` fp32 values in one unlinked, memory-mapped file under `directory` (the temp directory), as `array`."""

    def __init__(self, elements: int, directory: str | None = None) -> None:
        self.elements = elements
        self.nbytes = 4 * elements
        with tempfile.NamedTemporaryFile(prefix=FILE_PREFIX, dir=directory, delete=False) as handle:
            try:
                handle.truncate(self.nbytes)
                self._map = mmap.mmap(handle.fileno(), self.nbytes)
            finally:
                os.unlink(handle.name)  # the mapping keeps the file; its name and its space go with the mapping
        self.array = np.frombuffer(self._map, np.float32)

    def release(self, first: int, length: int) -> None:
        """Drop elements [first, first + length) of `array` from this process's memory; their values stay in the
        file. Only whole pages inside the range are dropped."""
        begin = -(-first * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (first + length) * 4 // mmap.PAGESIZE * mmap.PAGESIZE
        if end > begin:
            self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    @property
    def closed(self) -> bool:
        return self._map.closed

    def close(self) -> None:
        if self._map.closed:
            return
        self.array = None
        self._map.close()


class MomentFile(OffloadFile):
    """m and v, `elements` fp32 each, in one `OffloadFile`."""

    def __init__(self, elements: int, directory: str | None = None) -> None:
        super().__init__(2 * elements, directory)
        self.m, self.v = self.array[:elements], self.array[elements:]

    def release(self, moment: np.ndarray, start: int, length: int) -> None:
        """Drop elements [start, start + length) of `moment` (self.m or self.v) from this process's memory."""
        super().release((self.m.size if moment is self.v else 0) + start, length)

    def close(self) -> None:
        self.m = self.v = None
        super().close()


@dataclass(frozen=True)
class FileWeight:
    """A flat weight kept in an `OffloadFile` (parameter offload): elements [first, first + size) of its array.
    `read` and `write` leave none of its pages in this process's memory."""

    file: OffloadFile
    first: int
    size: int

    def read(self, start: int = 0, length: int | None = None) -> np.ndarray:
        """A copy of elements [start, start + length) of the weight (all of it by default)."""
        length = self.size - start if length is None else length
        first = self.first + start
        values = self.file.array[first : first + length].copy()
        self.file.release(first, length)
        return values

    def write(self, start: int, values: np.ndarray) -> None:
        first = self.first + start
        self.file.array[first : first + values.size] = values
        self.file.release(first, values.size)


class OffloadedMoments:
    """The moments of `slots` in a `MomentFile`, and AdamW's update of the slots through them (betas, eps and
    weight_decay as AdamW's); see the module docstring.

    `step(buffers, lr, step, grad_scale)` applies one update from the gradient buffers times grad_scale (lr, step and
    grad_scale as for `ApplyGradients`). `local_state`/`load_local_state` move the moments of the slots as flat
    arrays keyed (prefix, slot index); the optimizer turns them into whole tensors by parameter path as checkpoints
    hold them. `last_bytes` and `last_seconds`: bytes moved between the file and memory in the last update, and the
    time spent staging and unstaging (everything the unoffloaded update does not do).
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        bucket_elements: int | None = None,
        directory: str | None = None,
    ) -> None:
        self.slots = tuple(slots)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self._beta1 = Tensor(self.beta1, ms.float32)
        self._beta2 = Tensor(self.beta2, ms.float32)
        total = sum(slot.size for slot in self.slots)
        wanted = min(bucket_elements or BUCKET_ELEMENTS, total)
        self.bucket_elements = -(-wanted // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
        self.buckets = buckets_of([slot.size for slot in self.slots], self.bucket_elements)
        # Each bucket has a whole bucket's room in the file, so every bucket starts on a page boundary.
        self.file = MomentFile(len(self.buckets) * self.bucket_elements, directory)
        self._file_weight_bytes = 4 * sum(slot.size for slot in self.slots if isinstance(slot.weight, FileWeight))
        zeros = np.zeros(self.bucket_elements, np.float32)
        self._weights = Parameter(Tensor(zeros), name="offload.weights", requires_grad=False)
        self._m = Parameter(Tensor(zeros), name="offload.adam_m", requires_grad=False)
        self._v = Parameter(Tensor(zeros), name="offload.adam_v", requires_grad=False)
        self._fused_update = ops.Adam()
        self.last_bytes = 0
        self.last_seconds = 0.0

    def resident_bytes(self) -> int:
        """Bytes of moments held in memory between updates: the staging m and v (the rest is in the file)."""
        return self._m.asnumpy().nbytes + self._v.asnumpy().nbytes

    def _check_open(self) -> None:
        if self.file.closed:
            raise RuntimeError(
                "the optimizer offload file was released when the run ended; make a new Trainer (it resumes from "
                "the run's checkpoint) to train on"
            )

    def step(self, buffers: Sequence[Parameter], lr: Tensor, step: Tensor, grad_scale: Tensor) -> None:
        self._check_open()
        _, beta1_power, beta2_power, eps_t, keep = adamw_scalars(self._beta1, self._beta2, self.eps,
                                                                 self.weight_decay, lr, step)
        staging = 0.0
        for index, bucket in enumerate(self.buckets):
            begin = time.perf_counter()
            gradients = self._stage(buffers, index, bucket, keep, grad_scale)
            staging += time.perf_counter() - begin
            self._fused_update(
                self._weights, self._m, self._v, beta1_power, beta2_power, lr, self._beta1, self._beta2, eps_t, gradients,
            )
            begin = time.perf_counter()
            self._unstage(index, bucket)
            staging += time.perf_counter() - begin
        self.last_bytes = 2 * self.file.nbytes + 2 * self._file_weight_bytes  # m, v (and offloaded weights) read and written
        self.last_seconds = staging

    def _stage(self, buffers: Sequence[Parameter], index: int, bucket: list[_Piece], keep: Tensor,
               grad_scale: Tensor) -> Tensor:
        weights, gradients = [], []
        for piece in bucket:
            slot = self.slots[piece.slot]
            start = slot.start + piece.offset
            if isinstance(slot.weight, FileWeight):
                weight = Tensor(slot.weight.read(start, piece.length))
            else:
                weight = slot.weight.reshape(-1)[start : start + piece.length]
            weights.append(weight * keep if slot.decays else weight)
            start = slot.gradient_start + piece.offset
            gradients.append(buffers[slot.gradient].reshape(-1)[start : start + piece.length] * grad_scale)
        padding = self.bucket_elements - sum(piece.length for piece in bucket)
        if padding:  # zero gradients and moments leave zero weights where they are
            weights.append(ops.zeros((padding,), ms.float32))
            gradients.append(ops.zeros((padding,), ms.float32))
        ops.assign(self._weights, _joined(weights))
        first = index * self.bucket_elements
        for staged, moment in ((self._m, self.file.m), (self._v, self.file.v)):
            ops.assign(staged, Tensor(moment[first : first + self.bucket_elements]))
        return _joined(gradients)

    def _unstage(self, index: int, bucket: list[_Piece]) -> None:
        for piece in bucket:
            slot = self.slots[piece.slot]
            values = self._weights[piece.at : piece.at + piece.length]
            if isinstance(slot.weight, FileWeight):
                slot.weight.write(slot.start + piece.offset, values.asnumpy())
            else:
                write_flat(slot.weight, slot.start + piece.offset, values)
        first = index * self.bucket_elements
        for staged, moment in ((self._m, self.file.m), (self._v, self.file.v)):
            moment[first : first + self.bucket_elements] = staged.asnumpy()
            self.file.release(moment, first, self.bucket_elements)

    def _slot_moment(self, moment: np.ndarray, slot: int) -> np.ndarray:
        """A copy of slot `slot`'s elements of `moment`, gathered from the buckets it spans."""
        parts = []
        for index, bucket in enumerate(self.buckets):
            for piece in bucket:
                if piece.slot == slot:
                    first = index * self.bucket_elements + piece.at
                    parts.append(moment[first : first + piece.length])
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def local_state(self) -> dict[tuple[str, int], np.ndarray]:
        """{("adam_m" | "adam_v", slot index): that slot's moment, flat}, copied out of the file."""
        self._check_open()
        return {
            (prefix, slot): self._slot_moment(moment, slot)
            for prefix, moment in (("adam_m", self.file.m), ("adam_v", self.file.v))
            for slot in range(len(self.slots))
        }

    def load_local_state(self, state: Mapping[tuple[str, int], np.ndarray]) -> None:
        """Write every slot's moments (flat, of the slot's size) into the file."""
        self._check_open()
        for prefix, moment in (("adam_m", self.file.m), ("adam_v", self.file.v)):
            for index, bucket in enumerate(self.buckets):
                for piece in bucket:
                    first = index * self.bucket_elements + piece.at
                    values = np.asarray(state[(prefix, piece.slot)], np.float32).reshape(-1)
                    moment[first : first + piece.length] = values[piece.offset : piece.offset + piece.length]
                self.file.release(moment, index * self.bucket_elements, self.bucket_elements)

    def close(self) -> None:
        """Drop the file (its space returns to the disk). The optimizer cannot update after this."""
        self.file.close()


def _joined(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else ops.cat(parts)


def write_flat(weight: Parameter, start: int, values: Tensor) -> None:
    """Elements [start, start + len(values)) of `weight` flattened = values, in place (slice assignment on the
    Parameter: along its first axis a partial leading block, whole blocks and a partial trailing block, each partial
    block written the same way one axis down; an expert stack [experts, rows, columns] like a matrix)."""
    _write_range(weight, (), tuple(int(n) for n in weight.shape), start, values)


def _write_range(weight: Parameter, index: tuple, shape: tuple[int, ...], start: int, values: Tensor) -> None:
    """`write_flat` inside weight[index], a block of `shape`."""
    length = int(values.shape[0])
    if len(shape) == 1:
        weight[index + (slice(start, start + length),)] = values
        return
    inner = math.prod(shape[1:])
    block, offset = divmod(start, inner)
    last_block, last_offset = divmod(start + length, inner)
    if block == last_block:
        _write_range(weight, index + (block,), shape[1:], offset, values)
        return
    done = 0
    if offset:
        _write_range(weight, index + (block,), shape[1:], offset, values[: inner - offset])
        done, block = inner - offset, block + 1
    if last_block > block:
        count = (last_block - block) * inner
        weight[index + (slice(block, last_block),)] = values[done : done + count].reshape((last_block - block, *shape[1:]))
        done += count
    if last_offset:
        _write_range(weight, index + (last_block,), shape[1:], 0, values[done:])


def offload_mappings() -> list[str]:
    """This process's mappings of offload files (for tests and leak checks): lines of /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if FILE_PREFIX in line]
