"""Pipeline parallelism over two msrun workers (one stage each) against one process on the same global batch:
1F1B over 4 micro-batches gives its losses and gradient norms for 20 steps from the same initial weights
(GPipe with uneven stages, 2 + 1 layers, for 8 steps); the stages' checkpoint joins into the single-process
weights, resharded to one rank and back byte for byte, resumes in one process, and resumes bit-exactly
under pp2 itself. On four workers, pipeline stages compose with tensor parallelism (tp2 pp2) and with data
parallelism, ZeRO-1 and an untied head (dp2 pp2)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FOUR_WORKER_JOBS, TWO_WORKER_JOBS
from test_parallel_msrun import (
    SHORT,
    assert_resumed_tail,
    assert_same_blocks,
    assert_same_metrics,
    one_process,
    resume_from_step,
    resumes_in_one_process,
    train_job,
)

from model_core.eval.evaluate import load_model
from model_core.model.weights import model_weights
from model_core.parallel.layout import Layout
from model_core.train.checkpoint import Checkpoint
from model_core.train.reshard import reshard

pytestmark = pytest.mark.slow


PP2 = ("parallel.pipeline_parallel=2", "parallel.micro_batches=4")
TWO_WORKER_JOBS["pp2"] = PP2


@pytest.fixture(scope="module")
def pp2_run(two_worker_jobs):
    return two_worker_jobs["pp2"]


def test_pp2_stages_start_from_the_single_process_weights_and_match_its_training(pp2_run, single_process):
    out, ranks = pp2_run
    stages = [dict(np.load(out / "out" / f"rank{rank}_initial.npz")) for rank in (0, 1)]
    assert "layers.0.self_attn.q_proj.weight" in stages[0] and "layers.0.self_attn.q_proj.weight" not in stages[1]
    assert "layers.1.mlp.down_proj.weight" in stages[1] and "norm.weight" in stages[1] and "norm.weight" not in stages[0]
    joined = {**stages[1], **stages[0]}
    assert joined.keys() == single_process["initial"].keys()
    for name, value in single_process["initial"].items():
        np.testing.assert_array_equal(joined[name], value, err_msg=name)
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
        assert all(0.0 <= record["pipeline_bubble"] < 1.0 for record in rank["history"])


@pytest.mark.extended  # the 1F1B schedule on even stages runs by default; GPipe and uneven stages share its send path
def test_pp2_gpipe_with_uneven_stages_matches_one_process(dataset_dir, tmp_path):
    three_layers = ("model.num_layers=3", SHORT)
    expected = one_process(dataset_dir, tmp_path / "one", *three_layers)
    ranks = train_job(tmp_path, dataset_dir, *three_layers, *PP2, "parallel.pipeline_schedule=gpipe", "parallel.pipeline_layers=[2, 1]")
    for rank in ranks:
        assert_same_metrics(rank["history"], expected)
    saved = Checkpoint(tmp_path / "out" / "checkpoints" / "step-00000008", 8)
    assert saved.layout() == Layout(pp=2, pipeline_layers=(2, 1))
    assert {name.split(".")[1] for name in saved.load_shard(0)[0] if name.startswith("layers.")} == {"0", "1"}


def test_pp2_checkpoint_joins_into_the_single_process_weights_and_reshards_back_exactly(pp2_run, single_process, tmp_path):
    out, _ = pp2_run
    saved = out / "out" / "checkpoints" / "step-00000020"
    assert Checkpoint(saved, 20).layout() == Layout(dp=1, tp=1, pp=2)
    assert sorted(p.name for p in saved.glob("model*.safetensors")) == ["model-pp0-of-2.safetensors", "model-pp1-of-2.safetensors"]
    single = reshard(saved, Layout(), tmp_path / "pp1")
    weights, moments, _ = single.load()
    assert weights.keys() == single_process["final"].keys()
    assert moments.keys() == {f"adam_{m}.{name}" for m in "mv" for name in weights}
    for name, value in single_process["final"].items():
        assert np.linalg.norm(weights[name] - value) <= 1e-5 * np.linalg.norm(value), name
    model = load_model(saved)  # evaluation reads the stages joined
    assert all(np.array_equal(model_weights(model)[name], value) for name, value in weights.items())
    assert_same_blocks(reshard(single.path, Layout(pp=2), tmp_path / "pp2"), Checkpoint(saved, 20), blocks=2)


def test_a_pp2_checkpoint_resumes_in_one_process(pp2_run, single_process, dataset_dir, tmp_path):
    resumes_in_one_process(pp2_run[0] / "out" / "checkpoints", single_process, dataset_dir, tmp_path)


def test_pp2_resume_is_bit_exact(pp2_run, dataset_dir, tmp_path):
    out, uninterrupted = pp2_run
    start = resume_from_step(out / "out" / "checkpoints", 10, tmp_path / "out" / "checkpoints")
    assert_resumed_tail(uninterrupted, train_job(tmp_path, dataset_dir, *PP2, resume=start))


FOUR_WORKER_JOBS["tp2-pp2"] = (SHORT, *PP2, "parallel.tensor_parallel=2")


def test_tp2_pp2_on_four_workers_matches_one_process(dataset_dir, four_worker_jobs, tmp_path):
    expected = one_process(dataset_dir, tmp_path / "one", SHORT)
    out, ranks = four_worker_jobs["tp2-pp2"]
    for rank in ranks:
        assert_same_metrics(rank["history"], expected)
    files = sorted(p.name for p in (out / "out" / "checkpoints" / "step-00000008").glob("model*"))
    assert files == [f"model-pp{s}-of-2-tp{t}-of-2.safetensors" for s in (0, 1) for t in (0, 1)]


@pytest.mark.extended  # four workers; dp2 x pp2 with ZeRO-2 and -3 (tests/test_zero_composed_msrun.py) run by default
def test_dp2_pp2_zero1_untied_on_four_workers_matches_one_process(dataset_dir, tmp_path):
    untied = "model.tie_embeddings=false"
    expected = one_process(dataset_dir, tmp_path / "one", SHORT, untied)
    ranks = train_job(
        tmp_path, dataset_dir, SHORT, untied, "parallel.data_parallel=2", "parallel.pipeline_parallel=2",
        "parallel.micro_batches=2", "parallel.zero_stage=1", workers=4,
    )
    for rank in ranks:
        assert_same_metrics(rank["history"], expected)
