"""Expert parallelism over msrun workers against one process on the same global batch: dp2 x ep2 with ZeRO-1
and 2, and pp2 (two workers), dp2 x ep2 x tp2 and dp2 x pp2 x ep2 with ZeRO-0 and 2 (four) train 10 steps with
the losses, gradient norms and routing metrics of one process; the ep2 checkpoint holds the whole expert stacks
and loads into one process. The all-to-all and its gradient are checked with the other collectives in
tests/test_parallel_msrun.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TWO_WORKER_JOBS
from test_parallel_msrun import RUN, assert_same_metrics, shared_or_own_job, train_job

from model_core.model.weights import model_weights
from model_core.parallel.zero import BLOCK_ALIGNMENT, flat_shards
from model_core.train.checkpoint import Checkpoint
from model_core.train.reshard import whole_tensors
from model_core.train.trainer import Trainer
from params import load_params

pytestmark = pytest.mark.slow


# Dropless routing (no capacity factor): no choice is dropped, whatever tokens share a micro-batch. Both blocks
# are MoE, so each stage of pp2 routes, and a z-loss joins the aux loss in the objective.
MOE = ("model.moe={num_experts: 4, experts_per_token: 2, z_loss_coef: 0.001}", "train.steps=10")
EP2 = ("parallel.data_parallel=2", "parallel.expert_parallel=2", "parallel.micro_batches=2")


@pytest.fixture(scope="module")
def single_process(dataset_dir, tmp_path_factory):
    """One process, 8 rows a step (4 micro-batches of 2): metrics and final weights."""
    out = tmp_path_factory.mktemp("moe-single")
    trainer = Trainer(load_params("tiny", [*RUN, *MOE, "parallel.micro_batches=4", f"train.output_dir={out}"]), dataset_dir, out / "ckpt")
    history = trainer.run().history
    return {"history": history, "final": model_weights(trainer.model)}


TWO_WORKER_JOBS["moe-dp2-ep2-zero1"] = (*MOE, *EP2, "parallel.zero_stage=1")


@pytest.mark.parametrize("zero", [1, pytest.param(2, marks=pytest.mark.extended)])  # ZeRO-2: ~1.5 min more
def test_dp2_ep2_zero_trains_equal_to_one_process_and_checkpoints_whole_experts(dataset_dir, single_process, request, tmp_path, zero):
    """ZeRO-1 shards the dense weights' moments over dp (ZeRO-2 their gradients too); each expert block is held by
    one rank (expert-dp of 1), which keeps all of its moments and gradients. The checkpoint gathers both into
    whole tensors."""
    out, ranks = shared_or_own_job(request, f"moe-dp2-ep2-zero{zero}", tmp_path, *MOE, *EP2, f"parallel.zero_stage={zero}")
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert_same_routing(rank["history"], single_process["history"])
        assert rank["history"][-1]["moe_dropped_fraction"] == 0
    held = [dict(np.load(out / "out" / f"rank{r}_final.npz")) for r in range(2)]
    stack = "layers.1.mlp.experts.gate_proj"
    assert held[0][stack].shape[0] == held[1][stack].shape[0] == 2  # each rank trains 2 of the 4 experts
    saved = Checkpoint(out / "out" / "checkpoints" / "step-00000010", 10)
    weights, moments = whole_tensors(saved)
    assert weights.keys() == single_process["final"].keys()
    for name, value in single_process["final"].items():
        assert np.linalg.norm(weights[name] - value) <= 1e-5 * np.linalg.norm(value), name
    np.testing.assert_array_equal(weights[stack], np.concatenate([held[0][stack], held[1][stack]]))
    assert moments[f"adam_m.{stack}"].shape == weights[stack].shape
    experts = sum(v.size for name, v in weights.items() if ".mlp.experts." in name)
    dense = sum(v.size for v in weights.values()) - experts
    held = [rank["moment_bytes"] for rank in ranks]  # 8 bytes of moments per element: dense / dp, experts / ep
    # The dense half is the rank's blocks, cut at multiples of the alignment: the last one padded.
    assert held == [8 * (flat_shards([dense], 2).length + experts // 2)] * 2, held
    assert 0 <= flat_shards([dense], 2).length - dense / 2 < BLOCK_ALIGNMENT
    one_params = load_params("tiny", [*RUN, *MOE, "parallel.micro_batches=4", f"train.output_dir={tmp_path / 'one'}"])
    one = Trainer(one_params, dataset_dir, tmp_path / "one")
    one.resume(saved.path)  # the whole expert stacks load into one process
    loaded = model_weights(one.model)
    assert all(np.array_equal(loaded[name], weights[name]) for name in weights)


TWO_WORKER_JOBS["moe-dp2-ep2-zero2-offload"] = (*MOE, *EP2, "parallel.zero_stage=2", "parallel.optimizer_offload=true")


def test_dp2_ep2_with_optimizer_offload_trains_equal_to_one_process(single_process, request, tmp_path):
    """The offload file holds the dense shard's moments (over dp) and the expert blocks' (over expert-dp) alike, and
    the update writes an expert stack's 3-D pieces back in place."""
    _, ranks = shared_or_own_job(request, "moe-dp2-ep2-zero2-offload", tmp_path)
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert_same_routing(rank["history"], single_process["history"])


@pytest.mark.extended  # four workers: ~2.5 min on 2 cores; dp2 x ep2 above runs by default
def test_dp2_ep2_tp2_on_four_workers_trains_equal_to_one_process(dataset_dir, single_process, tmp_path):
    """tp splits attention and the dense blocks; every tp rank runs the same experts on the same tokens."""
    ranks = train_job(tmp_path, dataset_dir, *MOE, *EP2, "parallel.tensor_parallel=2", workers=4)
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert_same_routing(rank["history"], single_process["history"])



def assert_same_routing(got: list[dict], expected: list[dict]) -> None:
    """Every routing metric of every step (aux, z, dropped, each block's load) as one process reports it."""
    keys = sorted(key for key in expected[-1] if key.startswith("moe_"))
    assert {"moe_z_loss", "moe_load_max_layer0", "moe_load_max_layer1"} <= set(keys)
    for key in keys:
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in expected], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.extended  # ~40 s; pp2 (tests/test_pipeline_msrun.py) and dp2 x ep2 above run by default
def test_pp2_trains_an_moe_model_equal_to_one_process_with_its_routing_metrics(dataset_dir, single_process, tmp_path):
    """Each stage adds its own block's routing losses to its objective; the statistics meet over the pipeline."""
    ranks = train_job(tmp_path, dataset_dir, *MOE, "parallel.pipeline_parallel=2", "parallel.micro_batches=4")
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert_same_routing(rank["history"], single_process["history"])


@pytest.mark.extended  # four workers, ~2 min each; dp2 x ep2 (expert-dp of one) runs by default
@pytest.mark.parametrize("emulate", ["", "reduce_scatter"])
def test_dp4_ep2_zero2_shards_each_experts_state_over_its_expert_dp_pair(dataset_dir, single_process, tmp_path, emulate):
    """dp4 x ep2: each expert block is held by two ranks (an expert-dp group of two, a subgroup of the world), which
    reduce-scatter its gradients and shard its moments between them, while the dense weights' are sharded over all
    four. The two stores' sums run as one chain, in the order the backward makes the gradients (the same on every
    rank, which collectives of two groups need); with `emulate` through the native reduce-scatter path."""
    ranks = train_job(tmp_path, dataset_dir, *MOE, "parallel.data_parallel=4", "parallel.expert_parallel=2",
                      "parallel.micro_batches=1", "parallel.zero_stage=2", f"--emulate={emulate}", workers=4)
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert_same_routing(rank["history"], single_process["history"])
        assert rank["zero2_native_reduce_scatter"] is bool(emulate)


@pytest.mark.extended  # four workers; pp2 above and dp2 x ep2 check each half by default
@pytest.mark.parametrize("zero", [0, 2])
def test_dp2_pp2_ep2_on_four_workers_trains_equal_to_one_process(dataset_dir, single_process, tmp_path, zero):
    """Under ZeRO-2 each stage reduce-scatters its dense gradients over dp and its expert shards' over expert-dp
    (here a group of one: over dp they would mix the two ranks' different experts); the tied table's pieces,
    cut alike on the two end stages, are summed over them."""
    ranks = train_job(
        tmp_path, dataset_dir, *MOE, *EP2, "parallel.pipeline_parallel=2", f"parallel.zero_stage={zero}", workers=4
    )
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert_same_routing(rank["history"], single_process["history"])
