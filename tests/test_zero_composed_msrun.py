"""ZeRO-2 and ZeRO-3 composed with pipeline and tensor parallelism, on four msrun workers, against one process on the
same global batch (8 rows a step, 8 steps): dp2 x pp2 with ZeRO-2 and a tied table (its gradient pieces cut alike on
both end stages and summed over them), dp2 x pp2 with ZeRO-3 (-m extended), dp2 x tp2 with ZeRO-3 (each tp block
sharded over dp). Each gives the single-process losses, gradient norms and validation losses; each rank holds half
the gradients (ZeRO-2) or weights (ZeRO-3) of its stage or block; the checkpoints join into the single-process
weights; a ZeRO-2 pipeline checkpoint resumes bit-exactly, and under dp2 x tp2 ZeRO-3."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import FOUR_WORKER_JOBS
from test_parallel_msrun import (
    RUN,
    SHORT,
    assert_resumed_tail,
    assert_same_metrics,
    resume_from_step,
    shared_or_own_job,
    train_jobs,
)

from model_core.model.weights import model_weights
from model_core.parallel.layout import Layout
from model_core.parallel.placement import placement_table
from model_core.train.reshard import reshard
from model_core.train.trainer import Trainer
from params import load_params

pytestmark = pytest.mark.slow


# A narrow MLP makes a stage's weights small enough that the tied table (32,768 elements) is cut between the two
# dp shards (a shard holds 27,712 of a first stage's 55,424 elements): the case where the two end stages must cut
# it at the same offset.
NARROW = "model.ffn_hidden_size=32"
DP2_PP2 = ("parallel.data_parallel=2", "parallel.pipeline_parallel=2", "parallel.micro_batches=2")
DP2_TP2 = ("parallel.data_parallel=2", "parallel.tensor_parallel=2", "parallel.micro_batches=2")


@pytest.fixture(scope="module")
def one_process(dataset_dir, tmp_path_factory):
    """The reference: one process, 4 micro-batches of 2 rows a step, 8 steps; its metrics and final weights."""
    out = tmp_path_factory.mktemp("one")
    trainer = Trainer(load_params("tiny", [*RUN, SHORT, NARROW, "parallel.micro_batches=4", f"train.output_dir={out}"]), dataset_dir, out / "ckpt")
    history = trainer.run().history
    return {"history": history, "final": model_weights(trainer.model)}


def _held_bytes(layout: Layout, rank: int) -> int:
    """Bytes of the weights rank `rank` of `layout` holds without ZeRO: its stage's layers, its tp blocks."""
    table = placement_table(load_params("tiny", [*RUN, NARROW]).model, layout)
    return sum(4 * math.prod(row.block_shape(layout.tp)) for row in table.on_stage(layout.coordinates(rank).pp))


LAYOUTS = {
    "dp2_pp2_zero2": ((*DP2_PP2, "parallel.zero_stage=2"), Layout(dp=2, pp=2), "gradient_bytes"),
    "dp2_pp2_zero3": ((*DP2_PP2, "parallel.zero_stage=3"), Layout(dp=2, pp=2), "parameter_bytes"),
    "dp2_tp2_zero3": ((*DP2_TP2, "parallel.zero_stage=3"), Layout(dp=2, tp=2), "parameter_bytes"),
}
EVERY_4 = "train.checkpoint_interval=4"


EXTENDED = "dp2_tp2_zero3"  # the resume test below trains under it against one process by default
# ZeRO-3 under another layout runs by default as dp2 x tp2 (below) and dp2 x cp2 (tests/test_context_parallel.py),
# ZeRO under a pipeline as dp2 x pp2 ZeRO-2
EXTENDED_LAYOUTS = (EXTENDED, "dp2_pp2_zero3")
FOUR_WORKER_JOBS.update({name: (SHORT, NARROW, EVERY_4, *LAYOUTS[name][0])
                         for name in LAYOUTS if name not in EXTENDED_LAYOUTS})


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """name -> (output directory, every rank's report) of that layout's 8-step job, run when first asked for
    (the default ones with the other four-worker jobs)."""
    done = {}

    def job(name: str):
        if name not in done:
            overrides = (SHORT, NARROW, EVERY_4, *LAYOUTS[name][0])
            done[name] = shared_or_own_job(request, name, tmp_path_factory.mktemp(name), *overrides, workers=4)
        return done[name]

    return job


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.extended] if name in EXTENDED_LAYOUTS else [])
                                  for name in LAYOUTS])
def test_zero_composes_with_pipeline_and_tensor_parallelism(name, jobs, one_process, tmp_path):
    _, layout, held = LAYOUTS[name]
    out, ranks = jobs(name)
    for rank in ranks:
        assert_same_metrics(rank["history"], one_process["history"])

    for rank, report in enumerate(ranks):  # half of the stage's or block's bytes, give or take padding
        unsharded = _held_bytes(layout, rank)
        assert 0.45 * unsharded <= report[held] <= 0.55 * unsharded, (rank, report[held], unsharded)
    for group in layout.all_groups("dp"):  # the dp shards of one stage or block add up to it
        sizes = [ranks[rank][held] for rank in group]
        assert 0 <= sum(sizes) - _held_bytes(layout, group[0]) < 4 * 64, sizes  # padding

    saved = out / "out" / "checkpoints" / "step-00000008"
    weights, _, _ = reshard(saved, Layout(), tmp_path / "joined").load()
    assert weights.keys() == one_process["final"].keys()
    for weight, value in one_process["final"].items():
        assert np.linalg.norm(weights[weight] - value) <= 1e-5 * np.linalg.norm(value), weight


def test_a_dp2_pp2_zero2_checkpoint_resumes_bit_exactly_and_under_dp2_tp2_zero3(jobs, one_process, dataset_dir, tmp_path):
    """Stopped after step 4: the same layout repeats steps 5-8 to the bit; dp2 x tp2 with ZeRO-3 reshards the
    stages into tp blocks on resuming and follows the single-process run."""
    out, uninterrupted = jobs("dp2_pp2_zero2")
    starts = {name: resume_from_step(out / "out" / "checkpoints", 4, tmp_path / name / "out" / "checkpoints") for name in ("same", "other")}
    resumed = train_jobs(tmp_path, dataset_dir, {  # one launch; "same" first, so it resumes in fresh processes
        "same": (SHORT, NARROW, EVERY_4, *LAYOUTS["dp2_pp2_zero2"][0]),
        "other": (SHORT, NARROW, *LAYOUTS[EXTENDED][0]),
    }, workers=4, resume=starts)
    assert_resumed_tail(uninterrupted, resumed["same"][1], after=4)
    for rank in resumed["other"][1]:
        assert_same_metrics(rank["history"], [r for r in one_process["history"] if r["step"] > 4])
