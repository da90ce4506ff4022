"""Checkpoints across layouts: tensor-parallel blocks and pipeline stages joined into whole tensors and
split again, exactly.

Nothing is computed: a split tensor is the concatenation of its blocks along the axis the placement table
gives it (an optimizer moment `adam_m.<name>` along its parameter's), and a replicated one is stored whole in
every block, where the copies must agree bit for bit. Pipeline stages hold disjoint sets of tensors, so joining
them is a union; a tied embedding table is held by the first and the last stage, whose copies must agree
too. `reshard(checkpoint_dir, to_layout, output_dir)` writes a checkpoint for another tp x pp layout;
`blocks_for(checkpoint, tp, index)` gives one rank of a resumed run its tp block of every stage in memory,
whatever layout the checkpoint was saved under (a pipeline stage then keeps what it owns).

Only tp and pp shape the files. Moments are stored whole over dp (ZeRO gathers them when saving), and the
data-loader position counts samples of the global sample stream, so a checkpoint resumes under another dp,
micro-batch size, accumulation or global batch at the next sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model_core.parallel.layout import Layout
from model_core.parallel.parallelize import take_block
from model_core.parallel.placement import PlacementTable, placement_table
from model_core.train.checkpoint import Checkpoint, Tensors, block_index, save_shards, verify
from params.rules import check_tensor_parallel
from params.schema import LoraParams, ModelParams


def checkpoint_table(checkpoint: Checkpoint, layout: Layout | None = None) -> PlacementTable:
    """The placement table of the model a checkpoint holds (its adapters included), under `layout` (default:
    the layout it was saved under)."""
    state = checkpoint.state()
    lora = LoraParams(**state["lora"]) if state.get("lora") else None
    return placement_table(ModelParams(**state["model"]), layout or checkpoint.layout(), lora=lora)


def join_blocks(blocks: list[Tensors], table: PlacementTable) -> Tensors:
    """Whole tensors from the blocks of every tp rank, in rank order."""
    if len(blocks) == 1:
        return dict(blocks[0])
    names = set(blocks[0])
    for index, block in enumerate(blocks[1:], start=1):
        if set(block) != names:
            raise ValueError(f"tp block {index} holds other tensors than block 0: {sorted(set(block) ^ names)[:5]}")
    whole = {}
    for name in blocks[0]:
        axis = table[name].tp_axis
        if axis is not None:
            whole[name] = np.concatenate([block[name] for block in blocks], axis=axis)
            continue
        for index, block in enumerate(blocks[1:], start=1):
            if not np.array_equal(block[name], blocks[0][name]):
                raise ValueError(f"replicated tensor {name} differs between tp blocks 0 and {index}")
        whole[name] = blocks[0][name]
    return whole


def split_into_blocks(whole: Tensors, table: PlacementTable, tp: int, index: int) -> Tensors:
    """Block `index` of `tp` of every tensor (replicated ones whole)."""
    if tp == 1:
        return dict(whole)
    return {name: np.ascontiguousarray(take_block(value, table[name].tp_axis, tp, index)) for name, value in whole.items()}


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
    layout, table = checkpoint.layout(), checkpoint_table(checkpoint)
    stages = []
    for stage in range(layout.pp):
        blocks = [checkpoint.load_shard(block_index(layout, stage, t)) for t in range(layout.tp)]
        stages.append((join_blocks([w for w, _ in blocks], table), join_blocks([m for _, m in blocks], table)))
    return join_stages([w for w, _ in stages]), join_stages([m for _, m in stages])


def blocks_for(checkpoint: Checkpoint, tp: int, index: int) -> tuple[Tensors, Tensors]:
    """(weights, moments) of every layer for tp rank `index` of a run under `tp` ranks: read as stored when
    the checkpoint was saved under the same tp, else joined and split again."""
    layout = checkpoint.layout()
    if layout.tp == tp:
        blocks = [checkpoint.load_shard(block_index(layout, stage, index)) for stage in range(layout.pp)]
        return join_stages([w for w, _ in blocks]), join_stages([m for _, m in blocks])
    weights, moments = whole_tensors(checkpoint)
    table = checkpoint_table(checkpoint)
    return split_into_blocks(weights, table, tp, index), split_into_blocks(moments, table, tp, index)


def stage_tensors(tensors: Tensors, table: PlacementTable, stage: int) -> Tensors:
    """The tensors (weights or moments) that pipeline stage `stage` of the table's layout holds."""
    return {name: value for name, value in tensors.items() if stage in table[name].stages}


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
    table = checkpoint_table(source, to_layout)
    weights, moments = whole_tensors(source)
    shards = {}
    for stage in range(to_layout.pp):
        staged = stage_tensors(weights, table, stage), stage_tensors(moments, table, stage)
        for t in range(to_layout.tp):
            shards[block_index(to_layout, stage, t)] = tuple(split_into_blocks(part, table, to_layout.tp, t) for part in staged)
    return save_shards(output_dir, state["step"], shards, state, to_layout, keep=None)
