"""Checkpoints across layouts: tensor-parallel blocks and pipeline stages joined into whole tensors and
split again, exactly.

Nothing is computed: a split tensor is the concatenation of its blocks along `split_axis(name)` (an
optimizer moment `adam_m.<name>` along its parameter's axis), and a replicated one is stored whole in every
block, where the copies must agree bit for bit. Pipeline stages hold disjoint sets of tensors, so joining
them is a union; a tied embedding table is held by the first and the last stage, whose copies must agree
too. `reshard(checkpoint_dir, to_layout, output_dir)` writes a checkpoint for another tp x pp layout;
`blocks_for(checkpoint, tp, index)` gives one rank of a resumed run its tp block of every stage in memory,
whatever layout the checkpoint was saved under (a pipeline stage then keeps what it owns).

Only tp and pp shape the files. Moments are stored whole over dp (ZeRO gathers them when saving), and the
data-loader position counts rows of the global sample stream, so a checkpoint resumes under another dp as
long as the global batch (micro-batch x micro_batches x accumulation x dp) stays the same; otherwise the
loader stops with both sizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model_core.parallel.layout import Layout, check_tensor_parallel
from model_core.parallel.parallelize import split_axis, take_block
from model_core.parallel.pipeline import stage_owns
from model_core.train.checkpoint import Checkpoint, Tensors, block_index, save_shards, verify
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


def join_stages(stages: list[Tensors]) -> Tensors:
    """The union of the pipeline stages' tensors; one held by several stages (a tied table) must agree."""
    joined: Tensors = {}
    for stage, tensors in enumerate(stages):
        for name, value in tensors.items():
            if name in joined and not np.array_equal(joined[name], value):
                raise ValueError(f"{name} is held by several pipeline stages and differs on stage {stage}")
            joined.setdefault(name, value)
    return joined


def whole_tensors(checkpoint: Checkpoint) -> tuple[Tensors, Tensors]:
    """(weights, moments) of a checkpoint as whole tensors, whatever layout it was saved under."""
    layout = checkpoint.layout()
    stages = []
    for stage in range(layout.pp):
        blocks = [checkpoint.load_shard(block_index(layout, stage, t)) for t in range(layout.tp)]
        stages.append((join_blocks([w for w, _ in blocks]), join_blocks([m for _, m in blocks])))
    return join_stages([w for w, _ in stages]), join_stages([m for _, m in stages])


def blocks_for(checkpoint: Checkpoint, tp: int, index: int) -> tuple[Tensors, Tensors]:
    """(weights, moments) of every layer for tp rank `index` of a run under `tp` ranks: read as stored when
    the checkpoint was saved under the same tp, else joined and split again."""
    layout = checkpoint.layout()
    if layout.tp == tp:
        blocks = [checkpoint.load_shard(block_index(layout, stage, index)) for stage in range(layout.pp)]
        return join_stages([w for w, _ in blocks]), join_stages([m for _, m in blocks])
    weights, moments = whole_tensors(checkpoint)
    return split_into_blocks(weights, tp, index), split_into_blocks(moments, tp, index)


def stage_tensors(tensors: Tensors, model: ModelParams, layout: Layout, stage: int) -> Tensors:
    """The tensors (weights or moments) that pipeline stage `stage` of `layout` holds."""
    sizes = layout.stage_sizes(model.num_layers)
    return {name: value for name, value in tensors.items() if stage_owns(name, sizes, stage, model.tie_embeddings)}


def reshard(checkpoint_dir: str | Path, to_layout: Layout, output_dir: str | Path) -> Checkpoint:
    """Write the checkpoint at `checkpoint_dir` (a `step-*` directory) as a checkpoint for `to_layout`,
    into `output_dir/step-*` (nothing else there is removed); return it. Exact: a round trip gives the same
    bytes."""
    source = Checkpoint(Path(checkpoint_dir), -1)
    problem = verify(source)
    if problem:
        raise ValueError(f"checkpoint {checkpoint_dir} is not usable: {problem}")
    state = source.state()
    model = ModelParams(**state["model"])
    check_tensor_parallel(to_layout.tp, model)
    to_layout.stage_sizes(model.num_layers)  # an error naming both numbers if the stages do not fit the model
    weights, moments = whole_tensors(source)
    shards = {}
    for stage in range(to_layout.pp):
        staged = stage_tensors(weights, model, to_layout, stage), stage_tensors(moments, model, to_layout, stage)
        for t in range(to_layout.tp):
            shards[block_index(to_layout, stage, t)] = tuple(split_into_blocks(part, to_layout.tp, t) for part in staged)
    return save_shards(output_dir, state["step"], shards, state, to_layout, keep=None)
