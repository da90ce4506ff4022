"""Tensor parallelism in one process: which parameters split along which axis, exact reshard round trips,
and the checks that stop a checkpoint read or written under the wrong layout (the two-rank runs are in
tests/test_tensor_parallel_msrun.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_MODEL

from model_core.model import Llama
from model_core.model.weights import model_weights
from model_core.parallel.layout import Layout, ParallelConfigError
from model_core.parallel.placement import placement_table
from model_core.train import checkpoint as ckpt
from model_core.train.reshard import blocks_for, join_blocks, reshard
from params import load_params


@pytest.fixture(scope="module")
def model_params():
    return load_params("tiny", [*SMALL_MODEL, "model.tie_embeddings=false"]).model


@pytest.fixture()
def tp1_checkpoint(model_params, tmp_path):
    """A one-rank checkpoint of an untied small model with random moments, at step 7."""
    weights = model_weights(Llama(model_params))
    rng = np.random.default_rng(0)
    moments = {f"{kind}.{name}": rng.standard_normal(value.shape).astype(np.float32) for name, value in weights.items() for kind in ("adam_m", "adam_v")}
    state = {"step": 7, "model": model_params.model_dump(mode="json")}
    return ckpt.save_checkpoint(tmp_path / "tp1", 7, weights, moments, state, keep=1), weights, moments


def test_column_row_and_vocab_splits_and_replicated_norms(model_params):
    axes = {row.name: row.tp_axis for row in placement_table(model_params, Layout(tp=2))}
    assert list(axes) == list(model_weights(Llama(model_params)))
    assert {name.split(".")[-2] for name, axis in axes.items() if axis == 0} == {
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head",
    }
    assert {name.split(".")[-2] for name, axis in axes.items() if axis == 1} == {"o_proj", "down_proj"}
    assert {name for name, axis in axes.items() if axis is None} == {
        "norm.weight", *(f"layers.{i}.{norm}.weight" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")),
    }


def test_reshard_to_tp2_and_back_is_exact(tp1_checkpoint, tmp_path):
    original, weights, moments = tp1_checkpoint
    split = reshard(original.path, Layout(tp=2), tmp_path / "tp2")
    assert split.path.name == "step-00000007" and split.layout() == Layout(tp=2) and ckpt.verify(split) is None
    block_weights, block_moments = split.load_shard(1)
    np.testing.assert_array_equal(block_weights["layers.0.mlp.down_proj.weight"], np.split(weights["layers.0.mlp.down_proj.weight"], 2, axis=1)[1])
    np.testing.assert_array_equal(block_moments["adam_v.lm_head.weight"], np.split(moments["adam_v.lm_head.weight"], 2)[1])
    np.testing.assert_array_equal(block_weights["norm.weight"], weights["norm.weight"])
    joined = reshard(split.path, Layout(), tmp_path / "back")
    again_weights, again_moments, state = joined.load()
    assert state["step"] == 7
    for again, before in ((again_weights, weights), (again_moments, moments)):
        assert again.keys() == before.keys() and all(np.array_equal(again[k], before[k]) for k in before)
    from_split = blocks_for(split, 1, 0)[0]
    assert all(np.array_equal(from_split[k], weights[k]) for k in weights)


def test_reshard_refuses_a_tensor_parallel_size_that_does_not_divide_the_model(tp1_checkpoint, tmp_path):
    original, _, _ = tp1_checkpoint
    with pytest.raises(ParallelConfigError, match="parallel.tensor_parallel=3 does not divide model.num_heads=4"):
        reshard(original.path, Layout(tp=3), tmp_path / "tp3")
    assert not (tmp_path / "tp3").exists()


def test_replicated_tensors_must_agree_between_blocks(model_params):
    blocks = [{"norm.weight": np.ones(4, np.float32)}, {"norm.weight": np.full(4, 2, np.float32)}]
    with pytest.raises(ValueError, match="replicated tensor norm.weight differs between tp blocks 0 and 1"):
        join_blocks(blocks, placement_table(model_params, Layout(tp=2)))


def test_a_split_checkpoint_read_as_one_block_says_how_to_join_it(tp1_checkpoint, tmp_path):
    split = reshard(tp1_checkpoint[0].path, Layout(tp=2), tmp_path / "tp2")
    with pytest.raises(ckpt.CheckpointLayoutError, match="tensor_parallel=2.*reshard"):
        split.load()


def test_a_block_no_rank_wrote_stops_the_commit(tp1_checkpoint, tmp_path):
    _, weights, moments = tp1_checkpoint
    with pytest.raises(FileNotFoundError, match=r"no rank wrote \['model-tp1-of-2.safetensors', 'optimizer-tp1-of-2"):
        ckpt.save_shards(tmp_path / "run", 3, {0: (weights, moments)}, {"step": 3}, Layout(tp=2), keep=1)
    assert ckpt.list_checkpoints(tmp_path / "run") == [] and not list((tmp_path / "run").iterdir())


def test_cli_ckpt_reshard_round_trip_gives_the_same_bytes(tp1_checkpoint, tmp_path, capsys):
    from flows.cli import main

    original = tp1_checkpoint[0]
    assert main(["ckpt", "reshard", "--checkpoint", str(original.path), "--tensor-parallel", "2", "--output", str(tmp_path / "tp2")]) == 0
    assert "(dp1 tp2 pp1)" in capsys.readouterr().out
    split = tmp_path / "tp2" / original.path.name
    assert main(["ckpt", "reshard", "--checkpoint", str(split), "--tensor-parallel", "1", "--output", str(tmp_path / "tp1")]) == 0
    back = tmp_path / "tp1" / original.path.name
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (back / name).read_bytes() == (original.path / name).read_bytes()
    assert main(["ckpt", "reshard", "--checkpoint", str(split), "--tensor-parallel", "3", "--output", str(tmp_path / "x")]) == 1
    assert "does not divide" in capsys.readouterr().err
