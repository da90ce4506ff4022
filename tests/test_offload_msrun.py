"""Offload over two msrun workers: dp2 under ZeRO-2 and -3 with the moments offloaded, and under ZeRO-3 with the
parameter shards offloaded too, equals the same job without offload bit for bit (metrics, final weights where the
model holds them, checkpoint); a resumed parameter-offload job repeats the uninterrupted one; no offload file
outlives its job."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PARALLEL_STEPS, TWO_WORKER_JOBS
from test_parallel_msrun import assert_resumed_tail, assert_same_blocks, resume_from_step, train_job

from model_core.optim.offload import FILE_PREFIX
from model_core.train.checkpoint import Checkpoint

pytestmark = pytest.mark.slow


STEPS = PARALLEL_STEPS  # the shared dp2 ZeRO jobs' steps: those jobs are the references
KEYS = ("step", "loss", "grad_norm", "lr", "validation_loss")
PARAM_OFFLOAD = ("parallel.optimizer_offload=true", "parallel.param_offload=true")


def layout(zero_stage: int) -> tuple[str, ...]:
    """The params of the shared launch's dp2 ZeRO job (tests/test_parallel_msrun.py registers it)."""
    return TWO_WORKER_JOBS[f"dp2-zero{zero_stage}"]


def metrics(report: dict) -> list[list]:
    return [[record.get(key) for key in KEYS] for record in report["history"]]


def checkpoint(run, step: int = STEPS) -> Checkpoint:
    return Checkpoint(run / "out" / "checkpoints" / f"step-{step:08d}", step)


@pytest.fixture
def plain_job(two_worker_jobs):
    """job(zero_stage): (its directory, its reports) of the job without offload: the shared launch's dp2 ZeRO job
    (tests/test_parallel_msrun.py registers it), which trains the same params."""

    def job(zero_stage: int):
        return two_worker_jobs[f"dp2-zero{zero_stage}"]

    return job


@pytest.fixture
def offload_dir(tmp_path, monkeypatch):
    """The workers' temp directory, where their offload files are made (and unlinked at once)."""
    directory = tmp_path / "offload-tmp"
    directory.mkdir()
    monkeypatch.setenv("TMPDIR", str(directory))
    return directory


def leftover_files(directory) -> list[str]:
    return [path.name for path in directory.iterdir() if path.name.startswith(FILE_PREFIX)]


# -m extended: the parameter offload test below offloads ZeRO-3's moments too, by default; ZeRO-1 shares all but
# the gradient source with ZeRO-2.
@pytest.mark.extended
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_dp2_zero_with_offload_equals_the_job_without(dataset_dir, plain_job, tmp_path, zero_stage):
    plain_dir, plain = plain_job(zero_stage)
    offloaded = train_job(tmp_path / "offloaded", dataset_dir, *layout(zero_stage), "parallel.optimizer_offload=true")
    for before, again in zip(plain, offloaded, strict=True):
        assert metrics(again) == metrics(before)
        assert again["history"][-1]["offload_bytes_per_step"] > 0
    for rank in (0, 1):
        final = [np.load(run / "out" / f"rank{rank}_final.npz") for run in (plain_dir, tmp_path / "offloaded")]
        for name in final[0]:
            np.testing.assert_array_equal(final[1][name], final[0][name], err_msg=name)
    assert_same_blocks(checkpoint(tmp_path / "offloaded"), checkpoint(plain_dir), blocks=1)


TWO_WORKER_JOBS["dp2-zero3-param-offload"] = (*layout(3), *PARAM_OFFLOAD)


def test_dp2_zero3_with_param_offload_equals_the_job_without(plain_job, two_worker_jobs):
    plain_dir, plain = plain_job(3)
    offloaded_dir, offloaded = two_worker_jobs["dp2-zero3-param-offload"]
    for before, again in zip(plain, offloaded, strict=True):
        assert metrics(again) == metrics(before)
        # the moments and the shards the update reads and writes, and the shards the step's gathers fetch
        assert again["history"][-1]["offload_bytes_per_step"] > 2 * before["moment_bytes"]
        assert again["parameter_bytes"] == before["parameter_bytes"]  # in the model: the shards' gradient buffers
        assert again["offload_mappings_after_run"] == 0
    assert_same_blocks(checkpoint(offloaded_dir), checkpoint(plain_dir), blocks=1)
    assert leftover_files(offloaded_dir.parent / "tmp") == []  # the launch's temporary directory (tests/conftest.py)


@pytest.mark.extended
def test_dp2_zero3_with_param_offload_resumes_bit_exactly(dataset_dir, tmp_path, offload_dir):
    every_5 = (*layout(3), *PARAM_OFFLOAD, "train.checkpoint_interval=5", "train.eval_interval=5",
               "train.keep_checkpoints=4")  # step 5's too, which it resumes from
    straight = train_job(tmp_path / "straight", dataset_dir, *every_5)
    start = resume_from_step(checkpoint(tmp_path / "straight").path.parent, 5, tmp_path / "resumed" / "out" / "checkpoints")
    resumed = train_job(tmp_path / "resumed", dataset_dir, *every_5, resume=start)
    assert_resumed_tail(straight, resumed, after=5)
    assert_same_blocks(checkpoint(tmp_path / "resumed"), checkpoint(tmp_path / "straight"), blocks=1)
    assert leftover_files(offload_dir) == []
