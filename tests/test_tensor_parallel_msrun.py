"""Tensor parallelism over two msrun workers against one process on the same global batch: the same initial
weights, losses and gradient norms for 20 steps; its checkpoint resharded to one rank holds the single-process
weights and resumes there; and resuming tp2 from its own checkpoint is bit-exact. On four workers, dp2 x tp2
with ZeRO-2 matches one process too, and a vocabulary padded for tp2 trains as the unpadded one."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TWO_WORKER_JOBS
from test_parallel_msrun import (
    RUN,
    SHORT,
    assert_resumed_tail,
    assert_same_blocks,
    assert_same_metrics,
    one_process,
    resume_from_step,
    resumes_in_one_process,
    train_job,
)

from model_core.parallel.layout import Layout
from model_core.parallel.placement import placement_table
from model_core.train.checkpoint import Checkpoint
from model_core.train.reshard import join_blocks, reshard
from params import load_params

pytestmark = pytest.mark.slow


TP2 = ("parallel.tensor_parallel=2", "parallel.micro_batches=4")
TWO_WORKER_JOBS["tp2"] = TP2


@pytest.fixture(scope="module")
def tp2_run(two_worker_jobs):
    return two_worker_jobs["tp2"]


def test_tp2_starts_from_the_single_process_weights_and_matches_its_training(tp2_run, single_process):
    out, ranks = tp2_run
    blocks = [dict(np.load(out / "out" / f"rank{rank}_initial.npz")) for rank in (0, 1)]
    initial = join_blocks(blocks, placement_table(load_params("tiny", RUN).model, Layout(tp=2)))
    assert initial.keys() == single_process["initial"].keys()
    for name, value in single_process["initial"].items():
        np.testing.assert_array_equal(initial[name], value, err_msg=name)
    assert blocks[0]["embed_tokens.weight"].shape[0] == initial["embed_tokens.weight"].shape[0] // 2
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert [r["step"] for r in rank["history"] if "validation_loss" in r] == [10, 20]  # both tp ranks evaluate


def test_tp2_checkpoint_resharded_to_one_rank_holds_the_single_process_weights(tp2_run, single_process, tmp_path):
    out, _ = tp2_run
    saved = out / "out" / "checkpoints" / "step-00000020"
    assert Checkpoint(saved, 20).layout() == Layout(dp=1, tp=2, pp=1)
    single = reshard(saved, Layout(), tmp_path / "tp1")
    assert sorted(p.name for p in single.path.glob("*.safetensors")) == ["model.safetensors", "optimizer.safetensors"]
    weights, _, _ = single.load()
    assert weights.keys() == single_process["final"].keys()
    for name, value in single_process["final"].items():  # 20 AdamW steps on sums taken in another order
        assert np.linalg.norm(weights[name] - value) <= 1e-5 * np.linalg.norm(value), name
    assert_same_blocks(reshard(single.path, Layout(tp=2), tmp_path / "tp2"), Checkpoint(saved, 20), blocks=2)


def test_a_tp2_checkpoint_resumes_in_one_process(tp2_run, single_process, dataset_dir, tmp_path):
    """Resharded in memory at resume: steps 11-20 on one rank follow the single-process run."""
    resumes_in_one_process(tp2_run[0] / "out" / "checkpoints", single_process, dataset_dir, tmp_path)


@pytest.mark.extended  # a tp2 checkpoint resumes in one process, and a dp2 x pp2 one under dp2 x tp2, by default
def test_tp2_resume_is_bit_exact(tp2_run, dataset_dir, tmp_path):
    out, uninterrupted = tp2_run
    start = resume_from_step(out / "out" / "checkpoints", 10, tmp_path / "out" / "checkpoints")
    assert_resumed_tail(uninterrupted, train_job(tmp_path, dataset_dir, *TP2, resume=start))


@pytest.mark.extended  # four workers; dp2 x tp2 with ZeRO-3 (tests/test_zero_composed_msrun.py) runs by default
def test_dp2_tp2_zero2_on_four_workers_matches_one_process(dataset_dir, tmp_path):
    """ZeRO-2 shards each tp block's gradients over its dp group; the norm adds split blocks over tp."""
    expected = one_process(dataset_dir, tmp_path / "one", SHORT)
    layout = ("parallel.data_parallel=2", "parallel.tensor_parallel=2", "parallel.micro_batches=2", "parallel.zero_stage=2")
    ranks = train_job(tmp_path, dataset_dir, SHORT, *layout, workers=4)
    for rank in ranks:
        assert_same_metrics(rank["history"], expected)
    for rank in ranks:  # half of this rank's tp block, up to one fp32 element of padding
        assert abs(2 * rank["gradient_bytes"] - rank["parameter_bytes"]) <= 8, rank["parameter_bytes"]


@pytest.mark.extended  # ~30 s; tests/test_model.py checks the padded vocabulary's loss and gradients in one process by default
def test_tp2_with_a_vocabulary_padded_for_it_matches_the_unpadded_single_process(dataset_dir, tmp_path):
    """Two padding rows (the seeded draw of the padded table starts with the unpadded one): their logits are kept
    out of the softmax on the rank whose block holds them, so loss and gradient norm are the unpadded model's,
    step 1 within 1e-6."""
    expected = one_process(dataset_dir, tmp_path / "one", SHORT)
    vocab = load_params("tiny", RUN).model.vocab_size
    padded = (f"model.vocab_size={vocab + 2}", "model.vocab_padding=2")
    ranks = train_job(tmp_path, dataset_dir, SHORT, *TP2, *padded)
    for rank in ranks:
        assert_same_metrics(rank["history"], expected)
        assert rank["history"][0]["loss"] == pytest.approx(expected[0]["loss"], rel=1e-6)
