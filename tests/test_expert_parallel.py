"""Fast checks of expert parallelism in one process: the layout's validation messages and groups, the all-to-all
fallback's arithmetic, and the placement of expert shards. tests/test_expert_parallel_msrun.py trains under ep."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Tensor

from model_core.parallel.comm import all_to_all_contribution, received_blocks
from model_core.parallel.layout import Layout
from model_core.parallel.placement import placement_table
from params import ParamsError, load_params

MOE = "model.moe={num_experts: 4, experts_per_token: 2, every: 2}"


def layout_of(*overrides: str) -> Layout:
    return Layout.from_params(load_params("tiny", [*SMALL_MODEL, *overrides]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("parallel.data_parallel=3", "parallel.expert_parallel=3"), "parallel.expert_parallel=3 does not divide model.moe.num_experts=4"),
        (("parallel.data_parallel=3", "parallel.expert_parallel=2"), "parallel.expert_parallel=2 does not divide parallel.data_parallel=3"),
        (("parallel.data_parallel=2", "parallel.expert_parallel=4"), "parallel.expert_parallel=4 does not divide parallel.data_parallel=2"),
    ],
)
def test_an_expert_parallel_degree_that_does_not_divide_is_refused_naming_both_numbers(overrides, message):
    with pytest.raises(ParamsError, match=message):
        layout_of(MOE, *overrides)


def test_expert_parallelism_without_experts_is_refused():
    with pytest.raises(ParamsError, match="parallel.expert_parallel=2 but model.moe is null"):
        layout_of("parallel.data_parallel=2", "parallel.expert_parallel=2")


def test_ep_groups_are_consecutive_dp_replicas_and_expert_dp_groups_hold_the_same_experts():
    layout = Layout(dp=4, tp=2, ep=2)  # rank = dp_index * 2 + tp_index
    assert layout_of(MOE, "parallel.data_parallel=4", "parallel.tensor_parallel=2", "parallel.expert_parallel=2") == layout
    assert layout.all_groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.all_groups("expert_dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [layout.ep_index(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert str(layout) == "dp4 tp2 pp1 ep2"


def test_the_all_to_all_fallback_sums_zero_filled_buffers_into_every_members_block():
    """Three simulated members: summing their contributions (the all-reduce) and cutting block i gives member i
    block i of every member's x, exactly."""
    size, rows = 3, 2
    xs = [np.random.default_rng(r).standard_normal((size * rows, 4)).astype(np.float32) for r in range(size)]
    total = sum(all_to_all_contribution(Tensor(x), r, size).asnumpy() for r, x in enumerate(xs))
    for member in range(size):
        got = received_blocks(Tensor(total), member, size).asnumpy()
        expected = np.concatenate([x[member * rows : (member + 1) * rows] for x in xs])
        np.testing.assert_array_equal(got, expected)


def test_each_ep_rank_holds_its_block_of_the_expert_stacks_and_their_moments_shard_over_expert_dp():
    params = load_params("tiny", [*SMALL_MODEL, MOE])
    model = params.model
    dense = placement_table(model, Layout(dp=4), zero_stage=1)
    sharded = placement_table(model, Layout(dp=4, ep=2), zero_stage=1)
    stacks = [row for row in sharded if row.expert]
    assert [row.name for row in stacks] == [f"layers.1.mlp.experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    for row in stacks:
        assert row.block_shape(1, 2) == (2,) + row.shape[1:] and row.block_shape(1) == row.shape
    assert not sharded["layers.1.mlp.router.weight"].expert
    expert_elements = sum(row.size for row in stacks)
    saved = dense.rank_bytes(0)["parameters"] - sharded.rank_bytes(0)["parameters"]
    assert saved == 4 * expert_elements // 2  # half of the experts' fp32 bytes
    # ZeRO-1: the dense moments shard over dp=4, each ep rank's expert block over its 2 expert-dp ranks.
    moments = sharded.rank_bytes(0)["optimizer"]
    assert moments == 8 * (sum(math.ceil(row.size / 4) for row in sharded if not row.expert)
                           + sum(math.ceil(row.size // 2 / 2) for row in stacks))


def test_the_planner_shares_expert_parameters_over_ep_and_counts_the_all_to_all_volume():
    from model_core.parallel.planner import all_to_all_bytes_per_step, expert_parameters, stage_parameters

    params = load_params("tiny_moe")
    model = params.model
    experts = expert_parameters(model)
    assert experts == 2 * 3 * 4 * 352 * 128  # two MoE blocks of 4 experts, gate, up and down [352, 128]
    assert stage_parameters(model, 1, 1, 0) - stage_parameters(model, 1, 1, 0, ep=2) == experts // 2
    tokens = params.train.micro_batch_size * model.seq_len  # dropless: every expert has a slot per token
    buffer = 4 * tokens * 128 * 4
    assert all_to_all_bytes_per_step(params, 1) == 0
    assert all_to_all_bytes_per_step(params, 2) == 4 * 2 * buffer // 2  # 4 all-to-alls x 2 blocks, half leaves
    assert all_to_all_bytes_per_step(params, 4) == 4 * 2 * buffer * 3 // 4
    # Under pp2 each stage holds one of the two MoE blocks, and its backward recomputes the forward's two exchanges.
    assert all_to_all_bytes_per_step(params, 2, pp=2, stage=1) == 6 * 1 * buffer // 2


def test_the_planner_adds_ep_only_when_the_experts_do_not_fit_under_dp_alone():
    from model_core.parallel.planner import parse_bytes, plan

    # Every block MoE: the experts dominate, so holding half of them (ep2) saves more than ZeRO-2's sharding does.
    params = load_params("tiny_moe", ["model.moe.every=1"])
    ample = plan(params, devices=2, device_memory_bytes=parse_bytes("8GiB"))
    assert ample.recommended.candidate.ep == 1
    no_ep = min(e.memory.total for e in ample.estimates if e.candidate.ep == 1 and e.candidate.tp == 1)
    with_ep = min(e.memory.total for e in ample.estimates if e.candidate.ep == 2)
    assert with_ep < no_ep
    tight = plan(params, devices=2, device_memory_bytes=no_ep - 1)
    assert (tight.recommended.candidate.dp, tight.recommended.candidate.ep) == (2, 2)
    assert tight.recommended.all_to_all_bytes_per_step > 0
    # Within a node only: an ep group of ep x tp ranks must fit one node.
    cramped = plan(params, devices=2, device_memory_bytes=parse_bytes("8GiB"), devices_per_node=1)
    assert {e.candidate.ep for e in cramped.estimates} == {1}
