"""The placement table: its rows are the model's parameters (LoRA adapters included) with their shapes, in the
model's order; each tp rank's blocks tile a split weight; the stages and the per-rank bytes follow the layout;
each weight's optimizer state (whole, a flat shard over dp or expert-dp, ZeRO-3's shard; in memory or the file)
and gradient reduction (summed over tp and dp or expert-dp, or reduce-scattered).
A rank's shard built from it: each block of the seeded initialisation, or of a weights file read block by block,
is the same block of the whole; a ZeRO-3 rank makes its shard of each weight and adapter and nothing more."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import SMALL_MODEL

from model_core.model import Llama, apply_lora
from model_core.model.init import deferred_weights
from model_core.model.weights import WeightMismatchError, model_weights, named_weights
from model_core.parallel.layout import Layout
from model_core.parallel.parallelize import build_shard, check_weights_file, hold_blocks, materialize, take_block
from model_core.parallel.placement import (
    FLAT_SHARD,
    PARAMETER_SHARD,
    ROW,
    TENSOR_PARALLEL_PLAN,
    WHOLE,
    placement_table,
)
from model_core.parallel.zero3 import take_shard
from model_core.storage import read_safetensors, write_safetensors
from params import load_params

PARAMS = load_params("tiny", [*SMALL_MODEL, "model.num_layers=4"])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("with_lora", [False, True])
def test_rows_are_the_models_parameters_in_order(tied, with_lora):
    model_params = PARAMS.model.model_copy(update={"tie_embeddings": tied})
    lora = PARAMS.lora.model_copy(update={"enabled": True, "target_modules": ["q", "o", "down"]})
    model = Llama(model_params)
    if with_lora:
        apply_lora(model, lora)
    expected = {name: value.shape for name, value in model_weights(model).items()}
    table = placement_table(model_params, Layout(), lora=lora if with_lora else None)
    assert [row.name for row in table] == list(expected)
    assert all(row.shape == expected[row.name] for row in table)


def test_tensor_parallel_axes_follow_the_plan():
    every = ["q", "k", "v", "o", "gate", "up", "down"]
    table = placement_table(PARAMS.model, Layout(tp=2), lora=PARAMS.lora.model_copy(update={"enabled": True, "target_modules": every}))
    assert table["embed_tokens.weight"].tp_axis == 0 and table["norm.weight"].tp_axis is None
    for projection, style in TENSOR_PARALLEL_PLAN.items():
        weight, lora_a, lora_b = (table[f"layers.1.{projection}.{part}"] for part in ("weight", "lora_a", "lora_b"))
        if style == ROW:  # input columns: A is cut alike, B stays whole
            assert (weight.tp_axis, lora_a.tp_axis, lora_b.tp_axis) == (1, 1, None)
        else:  # output rows: B is cut alike, A stays whole
            assert (weight.tp_axis, lora_a.tp_axis, lora_b.tp_axis) == (0, None, 0)
        block = weight.block_shape(2)
        assert block[weight.tp_axis] * 2 == weight.shape[weight.tp_axis]
    assert table["adam_m.layers.0.mlp.down_proj.weight"] is table["layers.0.mlp.down_proj.weight"]
    assert all(row.block_shape(1) == row.shape for row in table)


def test_stages_hold_their_layers_and_a_tied_table_lives_on_both_ends():
    table = placement_table(PARAMS.model, Layout(pp=2))
    assert table["embed_tokens.weight"].stages == (0, 1)
    assert table["layers.1.mlp.up_proj.weight"].stages == (0,) and table["layers.2.mlp.up_proj.weight"].stages == (1,)
    assert table["norm.weight"].stages == (1,)
    untied = placement_table(PARAMS.model.model_copy(update={"tie_embeddings": False}), Layout(pp=2))
    assert untied["embed_tokens.weight"].stages == (0,) and untied["lm_head.weight"].stages == (1,)
    assert untied["adam_v.layers.3.self_attn.o_proj.weight"].stages == (1,)
    uneven = placement_table(PARAMS.model, Layout(pp=2, pipeline_layers=(3, 1)))
    assert uneven["layers.2.mlp.up_proj.weight"].stages == (0,) and uneven["layers.3.mlp.up_proj.weight"].stages == (1,)


def test_rank_bytes_split_the_model_over_tp_pp_and_zero():
    whole = placement_table(PARAMS.model, Layout()).rank_bytes(0)
    elements = whole["parameters"] // 4
    assert whole == {"parameters": 4 * elements, "gradients": 4 * elements, "optimizer": 8 * elements, "offloaded": 0}
    tp = placement_table(PARAMS.model, Layout(tp=2))
    norms = sum(row.size for row in tp if row.tp_axis is None)
    assert [tp.rank_bytes(r)["parameters"] for r in range(2)] == [4 * ((elements - norms) // 2 + norms)] * 2
    zero3 = placement_table(PARAMS.model, Layout(dp=2), zero_stage=3)
    shards = sum(math.ceil(row.size / 2) for row in zero3)
    assert zero3.rank_bytes(1) == {"parameters": 4 * shards, "gradients": 4 * shards, "optimizer": 8 * shards, "offloaded": 0}
    zero1 = placement_table(PARAMS.model, Layout(dp=2), zero_stage=1).rank_bytes(0)
    assert zero1["parameters"] == 4 * elements and zero1["optimizer"] == 8 * shards
    offloaded = placement_table(PARAMS.model, Layout(dp=2), zero_stage=2, optimizer_offload=True).rank_bytes(0)
    assert offloaded["optimizer"] == 0 and offloaded["offloaded"] == 8 * shards  # the moments on disk, not in memory
    both = placement_table(PARAMS.model, Layout(dp=2), zero_stage=3, optimizer_offload=True, param_offload=True)
    assert both.rank_bytes(1) == {"parameters": 0, "gradients": 4 * shards, "optimizer": 0, "offloaded": 12 * shards}
    with pytest.raises(ValueError, match="zero_stage=2, dp=2"):
        placement_table(PARAMS.model, Layout(dp=2), zero_stage=2, param_offload=True)


# ------------------------------------------------------------------------- building a rank's shard


def _deferred_model(params) -> Llama:
    with deferred_weights():
        return Llama(params)


def _make(model, table, rank, seed, source):
    hold_blocks(model, table)
    materialize(model, table, rank, seed=seed, source=source)


def test_each_tp_block_of_the_seeded_initialisation_is_the_block_of_the_whole():
    whole = _deferred_model(PARAMS.model)
    _make(whole, placement_table(PARAMS.model, Layout()), 0, seed=7, source=None)
    full = model_weights(whole)
    table = placement_table(PARAMS.model, Layout(tp=2))
    for index in range(2):
        block = _deferred_model(PARAMS.model)
        _make(block, table, index, seed=7, source=None)
        for name, value in model_weights(block).items():
            np.testing.assert_array_equal(value, take_block(full[name], table[name].tp_axis, 2, index), err_msg=name)
    other = _deferred_model(PARAMS.model)
    _make(other, placement_table(PARAMS.model, Layout()), 0, seed=8, source=None)
    assert not np.array_equal(model_weights(other)["layers.0.mlp.up_proj.weight"], full["layers.0.mlp.up_proj.weight"])
    assert np.array_equal(full["norm.weight"], np.ones_like(full["norm.weight"]))


def test_blocks_are_read_from_a_weights_file_one_block_at_a_time(tmp_path):
    stored = model_weights(Llama(PARAMS.model))
    write_safetensors(tmp_path / "model.safetensors", stored, "bfloat16")
    table = placement_table(PARAMS.model, Layout(tp=2))
    block = _deferred_model(PARAMS.model)
    _make(block, table, 1, seed=0, source=tmp_path / "model.safetensors")
    rounded = read_safetensors(tmp_path / "model.safetensors")
    for name, value in model_weights(block).items():
        np.testing.assert_array_equal(value, take_block(rounded[name], table[name].tp_axis, 2, 1), err_msg=name)


def test_a_weights_file_of_another_model_is_refused_by_name_and_shape(tmp_path):
    stored = model_weights(Llama(PARAMS.model))
    table = placement_table(PARAMS.model, Layout())
    write_safetensors(tmp_path / "model.safetensors", {**stored, "layers.9.extra": np.zeros(2, np.float32)}, "float32")
    with pytest.raises(WeightMismatchError, match=r"missing \[\], unexpected \['layers.9.extra'\]"):
        check_weights_file(tmp_path / "model.safetensors", table)
    stored["norm.weight"] = np.ones(3, np.float32)
    write_safetensors(tmp_path / "model.safetensors", stored, "float32")
    with pytest.raises(WeightMismatchError, match=r"norm.weight has shape \(3,\), the model's is \(64,\)"):
        check_weights_file(tmp_path / "model.safetensors", table)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_zero3_rank_makes_only_its_shard_of_every_weight_and_adapter(stages):
    lora = PARAMS.lora.model_copy(update={"enabled": True, "target_modules": ["q", "down"]})
    whole = model_weights(build_shard(PARAMS.model, placement_table(PARAMS.model, Layout(), lora=lora), 0, seed=3).model)
    assert np.any(whole["layers.0.self_attn.q_proj.lora_a"]) and not np.any(whole["layers.0.self_attn.q_proj.lora_b"])
    layout = Layout(dp=2, pp=stages)
    table = placement_table(PARAMS.model, layout, zero_stage=3, lora=lora)
    for rank in range(layout.world_size):
        at = layout.coordinates(rank)
        dp_group = SimpleNamespace(size=2, index=at.dp)  # building needs only its size and this rank's place
        shard = build_shard(PARAMS.model, table, rank, seed=3, dp_group=dp_group)
        made = model_weights(shard.model)
        assert made.keys() == {row.name for row in table.on_stage(at.pp)} == shard.zero3.shards.keys()
        for name, value in made.items():
            np.testing.assert_array_equal(value, take_shard(whole[name], 2, at.dp), err_msg=name)
        assert all(made[row.name].size == math.ceil(row.size / 2) for row in table.on_stage(at.pp))
        trainable = {name for name, weight in named_weights(shard.model).items() if weight.requires_grad}
        assert trainable == {row.name for row in table.on_stage(at.pp) if row.adapter}


def test_each_weights_optimizer_state_is_read_off_its_placement():
    """What a rank keeps of a weight's master and moments follows the ZeRO stage, the group its shard spans (an
    expert stack's: expert-dp, a group of one keeping all of it) and where the moments live; frozen weights have
    none."""
    names = [row.name for row in placement_table(PARAMS.model, Layout())]
    whole = [placement_table(PARAMS.model, Layout()).optimizer_state(name) for name in names]
    assert {(p.kept, p.group, p.moments) for p in whole} == {(WHOLE, None, "memory")}
    assert [p.decays for p in whole] == [len(row.shape) >= 2 for row in placement_table(PARAMS.model, Layout())]
    assert not all(p.decays for p in whole) and any(p.decays for p in whole)
    for stage, kept, group, sharded in ((1, FLAT_SHARD, "dp", False), (2, FLAT_SHARD, "dp", True),
                                        (3, PARAMETER_SHARD, "dp", False)):
        table = placement_table(PARAMS.model, Layout(dp=2), zero_stage=stage, optimizer_offload=stage == 2)
        states = {(p.kept, p.group, p.gradient_sharded, p.moments) for p in map(table.optimizer_state, names)}
        assert states == {(kept, group, sharded, "file" if stage == 2 else "memory")}, stage
    moe = load_params("tiny", [*SMALL_MODEL, "model.moe={num_experts: 4, experts_per_token: 2, every: 1}"]).model
    for dp, expert_state in ((2, (WHOLE, None)), (4, (FLAT_SHARD, "expert_dp"))):
        table = placement_table(moe, Layout(dp=dp, ep=2), zero_stage=1)
        for row in table:
            state = table.optimizer_state(row.name)
            assert (state.kept, state.group) == (expert_state if row.expert else (FLAT_SHARD, "dp")), (dp, row.name)
        assert any(row.expert for row in table)
    lora = PARAMS.lora.model_copy(update={"enabled": True})
    adapted = placement_table(PARAMS.model, Layout(), lora=lora)
    frozen = next(row.name for row in adapted if not row.trainable)
    with pytest.raises(ValueError, match=f"{frozen} is frozen"):
        adapted.optimizer_state(frozen)


def test_each_weights_gradient_reduction_is_read_off_its_placement():
    """A gradient is summed over tp where a rank's is a share, then over dp (an expert stack's over expert-dp, a
    group of one left out); from ZeRO-2 on it is reduce-scattered over that group instead of summed."""
    table = placement_table(PARAMS.model, Layout(dp=2, tp=2), zero_stage=1, sequence_parallel=True)
    for row in table:
        reduction = table.gradient_reduction(row.name)
        assert reduction.all_reduced == (("tp", "dp") if row.tp_partial else ("dp",)), row.name
        assert reduction.scattered is None
    assert any(row.tp_partial for row in table)
    alone = placement_table(PARAMS.model, Layout())
    assert {alone.gradient_reduction(row.name).all_reduced for row in alone} == {()}
    zero2 = placement_table(PARAMS.model, Layout(dp=2), zero_stage=2)
    assert {(r.all_reduced, r.scattered) for r in map(zero2.gradient_reduction, (row.name for row in zero2))} == {
        ((), "dp")}
    moe = load_params("tiny", [*SMALL_MODEL, "model.moe={num_experts: 4, experts_per_token: 2, every: 1}"]).model
    for dp, stage, expert in ((2, 1, ((), None)), (4, 1, (("expert_dp",), None)), (2, 2, ((), "expert_dp"))):
        table = placement_table(moe, Layout(dp=dp, ep=2), zero_stage=stage)
        for row in table:
            reduction = table.gradient_reduction(row.name)
            dense = ((), "dp") if stage == 2 else (("dp",), None)
            assert (reduction.all_reduced, reduction.scattered) == (expert if row.expert else dense), (dp, row.name)
