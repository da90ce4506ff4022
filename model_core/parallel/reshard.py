"""Checkpoints across layouts: tensor-parallel blocks joined into whole tensors and split again, exactly.

Nothing is computed: a split tensor is the concatenation of its blocks along `split_axis(name)` (an
optimizer moment `adam_m.<name>` along its parameter's axis), and a replicated one is stored whole in every
block, where the copies must agree bit for bit. `reshard(checkpoint_dir, to_layout, output_dir)` writes a
checkpoint for another tensor-parallel size; `blocks_for(checkpoint, tp, index)` gives one rank of a
resumed run its block in memory, whatever tp the checkpoint was saved under.

Only tp shapes the files. Moments are stored whole over dp (ZeRO-1 gathers them when saving), and the
data-loader position counts rows of the global sample stream, so a checkpoint resumes under another dp as
long as the global batch (micro-batch x micro_batches x accumulation x dp) stays the same; otherwise the
loader stops with both sizes. Pipeline layouts are not implemented (issue #4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model_core.parallel.layout import Layout, ParallelConfigError, check_tensor_parallel
from model_core.parallel.parallelize import split_axis, take_block
from model_core.train.checkpoint import Checkpoint, Tensors, save_shards, verify
from params.schema import ModelParams

_MOMENT_PREFIXES = ("adam_m.", "adam_v.")


def tensor_axis(name: str) -> int | None:
    """The split axis of a weight or of an optimizer moment (the axis of the parameter it belongs to)."""
    for prefix in _MOMENT_PREFIXES:
        if name.startswith(prefix):
            return split_axis(name.removeprefix(prefix))
    return split_axis(name)


def join_blocks(blocks: list[Tensors]) -> Tensors:
    """Whole tensors from the blocks of every tp rank, in rank order."""
    names = set(blocks[0])
    for index, block in enumerate(blocks[1:], start=1):
        if set(block) != names:
            raise ValueError(f"tp block {index} holds other tensors than block 0: {sorted(set(block) ^ names)[:5]}")
    whole = {}
    for name in blocks[0]:
        axis = tensor_axis(name)
        if axis is not None:
            whole[name] = np.concatenate([block[name] for block in blocks], axis=axis)
            continue
        for index, block in enumerate(blocks[1:], start=1):
            if not np.array_equal(block[name], blocks[0][name]):
                raise ValueError(f"replicated tensor {name} differs between tp blocks 0 and {index}")
        whole[name] = blocks[0][name]
    return whole


def split_into_blocks(whole: Tensors, tp: int, index: int) -> Tensors:
    """Block `index` of `tp` of every tensor (replicated ones whole)."""
    return {name: np.ascontiguousarray(take_block(value, tensor_axis(name), tp, index)) for name, value in whole.items()}


def whole_tensors(checkpoint: Checkpoint) -> tuple[Tensors, Tensors]:
    """(weights, moments) of a checkpoint as whole tensors, whatever tp it was saved under."""
    blocks = [checkpoint.load_shard(index) for index in range(checkpoint.layout().tp)]
    return join_blocks([weights for weights, _ in blocks]), join_blocks([moments for _, moments in blocks])


def blocks_for(checkpoint: Checkpoint, tp: int, index: int) -> tuple[Tensors, Tensors]:
    """(weights, moments) for tp rank `index` of a run under `tp` ranks: read as stored when the checkpoint
    was saved under the same tp, else joined and split again."""
    if checkpoint.layout().tp == tp:
        return checkpoint.load_shard(index)
    weights, moments = whole_tensors(checkpoint)
    return split_into_blocks(weights, tp, index), split_into_blocks(moments, tp, index)


def reshard(checkpoint_dir: str | Path, to_layout: Layout, output_dir: str | Path) -> Checkpoint:
    """Write the checkpoint at `checkpoint_dir` (a `step-*` directory) as a checkpoint for `to_layout`,
    into `output_dir/step-*` (nothing else there is removed); return it. Exact: a round trip gives the same
    bytes."""
    source = Checkpoint(Path(checkpoint_dir), -1)
    problem = verify(source)
    if problem:
        raise ValueError(f"checkpoint {checkpoint_dir} is not usable: {problem}")
    if to_layout.pp != 1:
        raise ParallelConfigError(f"pipeline_parallel={to_layout.pp} is not implemented yet (issue #4); use 1")
    state = source.state()
    check_tensor_parallel(to_layout.tp, ModelParams(**state["model"]))
    weights, moments = whole_tensors(source)
    shards = {
        index: (split_into_blocks(weights, to_layout.tp, index), split_into_blocks(moments, to_layout.tp, index))
        for index in range(to_layout.tp)
    }
    return save_shards(output_dir, state["step"], shards, state, to_layout, keep=None)
