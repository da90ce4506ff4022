"""Optimizer offload over two msrun workers: dp2 under ZeRO-2 and -3 with the moments offloaded equals the same
job without offload, bit for bit: metrics, final weights (ZeRO-3: shards) and checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from test_parallel_msrun import assert_same_blocks, dataset_dir, train_job

from model_core.train.checkpoint import Checkpoint

pytestmark = pytest.mark.slow

__all__ = ["dataset_dir"]  # the module fixture shared with the dp tests

STEPS = 10
KEYS = ("step", "loss", "grad_norm", "lr", "validation_loss")


@pytest.mark.parametrize("zero_stage", [2, 3])  # ZeRO-1 shares all but the gradient source with ZeRO-2
def test_dp2_zero_with_offload_equals_the_job_without(dataset_dir, tmp_path, zero_stage):
    layout = ("parallel.data_parallel=2", "parallel.micro_batches=2", f"parallel.zero_stage={zero_stage}", f"train.steps={STEPS}")
    plain = train_job(tmp_path / "plain", dataset_dir, *layout)
    offloaded = train_job(tmp_path / "offloaded", dataset_dir, *layout, "parallel.optimizer_offload=true")
    for before, again in zip(plain, offloaded, strict=True):
        assert [[r.get(k) for k in KEYS] for r in again["history"]] == [[r.get(k) for k in KEYS] for r in before["history"]]
        assert again["history"][-1]["offload_bytes_per_step"] > 0
    for rank in (0, 1):
        final = [np.load(tmp_path / run / "out" / f"rank{rank}_final.npz") for run in ("plain", "offloaded")]
        for name in final[0]:
            np.testing.assert_array_equal(final[1][name], final[0][name], err_msg=name)
    name = f"step-{STEPS:08d}"
    checkpoints = [Checkpoint(tmp_path / run / "out" / "checkpoints" / name, STEPS) for run in ("plain", "offloaded")]
    assert_same_blocks(checkpoints[1], checkpoints[0], blocks=1)
