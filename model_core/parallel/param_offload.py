"""Parameter offload under ZeRO-3: this rank's parameter shards live in a memory-mapped file and are fetched where
they are used.

`offload_parameters(model, sharded)` moves every shard `zero3.shard_parameters` made into one `ShardFile` (an
`OffloadFile`, unlinked at once like the moments'; each shard starts on a page, so reading it drops all of its
pages again) and leaves in the model, under each weight's path, a zero Parameter of the shard's shape that holds no
weight at all: the shard's gradient buffer. The shards are not Parameters of the compiled step, because a compiled
(jit) step keeps the buffer a Parameter had when it was compiled: swapping a Parameter's data (`set_data`,
`assign`) frees nothing. Instead each ZeRO-3 gather (`zero3.ParameterShards`) reads its shard from the file with a
`pyfunc` Custom op inside the compiled step, in the forward and again in the backward, and the copy lives only
until the all-gather has used it. The gathers' bprops return each shard's gradient as the gradient of its buffer
Parameter, so `value_and_grad` with respect to the buffers gives the shards' gradients and `AccumulateGradients`
adds them into those same Parameters (the forward never reads a buffer's values; a one-element slice of it only
orders the fetch). The update (`model_core.optim.offload.OffloadedMoments`: optimizer offload is required with it) reads and writes the
shards in the file bucket by bucket (`FileWeight`), and checkpoints read and write them there
(`ShardedParameters.full_weights`, `load_full_weights`). Every value moved is a copy of fp32 bits, so the run
equals the one without offload bit for bit. On the CPU backend, where host memory is the device, the file on
local disk is the off-device store (ZeRO-Infinity's NVMe parameter offload).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import replace

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from model_core.optim.offload import FileWeight, OffloadFile
from model_core.parallel.zero3 import ParameterShards, ShardedParameters

PAGE_ELEMENTS = mmap.PAGESIZE // 4


class ShardFile:
    """Flat fp32 shards by path in one `OffloadFile`, each from a page boundary; `fetched_bytes` counts what the
    compiled step's fetches have read since it was last reset."""

    def __init__(self, shards: Mapping[str, np.ndarray], directory: str | None = None) -> None:
        firsts, first = {}, 0
        for name, shard in shards.items():
            firsts[name] = first
            first += -(-shard.size // PAGE_ELEMENTS) * PAGE_ELEMENTS
        self.file = OffloadFile(max(first, PAGE_ELEMENTS), directory)
        self.weights = {name: FileWeight(self.file, firsts[name], shard.size) for name, shard in shards.items()}
        for name, shard in shards.items():
            self.weights[name].write(0, np.asarray(shard, np.float32).reshape(-1))
        self.fetched_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of parameters in the file (without the page padding)."""
        return 4 * sum(weight.size for weight in self.weights.values())

    def fetch_op(self, name: str) -> ops.Custom:
        """An op for a compiled step: (any tensor, which only orders it) -> a copy of shard `name` from the file."""
        weight = self.weights[name]

        def fetch(_order: np.ndarray) -> np.ndarray:
            self.fetched_bytes += 4 * weight.size
            return weight.read()

        return ops.Custom(fetch, out_shape=lambda _: (weight.size,), out_dtype=lambda _: ms.float32, func_type="pyfunc")

    def close(self) -> None:
        self.file.close()


def offload_parameters(model: nn.Cell, sharded: ShardedParameters, directory: str | None = None) -> ShardedParameters:
    """Move `sharded`'s shards (Parameters of `model`) into a `ShardFile`, put a zero gradient buffer of each shard's
    shape in its place in `model`, and make every ZeRO-3 gather of `model` fetch from the file (see the module
    docstring). Returns `sharded` with the buffers as its shards and the file as `offloaded`."""
    if any(not shard.requires_grad for shard in sharded.shards.values()):
        frozen = sorted(name for name, shard in sharded.shards.items() if not shard.requires_grad)
        raise ValueError(f"parameter offload keeps a gradient buffer per shard in its place; {frozen[:3]} are frozen")
    store = ShardFile({name: shard.asnumpy() for name, shard in sharded.shards.items()}, directory)
    buffers = {
        name: Parameter(Tensor(np.zeros(shard.shape, np.float32)), name=shard.name, requires_grad=True)
        for name, shard in sharded.shards.items()
    }
    by_id = {id(shard): name for name, shard in sharded.shards.items()}
    for _, cell in list(model.cells_and_names()):
        # A cell's own parameters by attribute: the one way MindSpore exposes which attribute holds which.
        for attribute, weight in list(cell._params.items()):
            if id(weight) in by_id:
                setattr(cell, attribute, buffers[by_id[id(weight)]])
        if isinstance(cell, ParameterShards):
            cell.fetch = store.fetch_op(cell.path)
    return replace(sharded, shards=buffers, offloaded=store)
