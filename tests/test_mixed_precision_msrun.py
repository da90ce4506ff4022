"""Mixed precision (float16 compute) at dp2 under ZeRO-1 and ZeRO-2: the model holds its matmul weights in float16
and the optimizer the fp32 masters of its shard; training matches one process in the same precision on the same
global batch, and the checkpoint holds the whole fp32 masters, of which the model's weights are the casts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import PARALLEL_RUN, TWO_WORKER_JOBS
from test_parallel_msrun import assert_same_metrics, zero_job

from model_core.storage import read_weights
from model_core.train.trainer import Trainer
from params import load_params

pytestmark = pytest.mark.slow

FP16 = "precision.compute_dtype=float16"
TWO_WORKER_JOBS.update({f"dp2-zero{stage}-fp16": zero_job(stage, FP16) for stage in (1, 2)})


@pytest.fixture(scope="module")
def single_process_fp16(dataset_dir, tmp_path_factory) -> list[dict]:
    """The metrics of one process training PARALLEL_RUN in float16 on the jobs' global batch."""
    out = tmp_path_factory.mktemp("single-fp16")
    params = load_params("tiny", [*PARALLEL_RUN, FP16, "parallel.micro_batches=4", f"train.output_dir={out}"])
    return Trainer(params, dataset_dir, out / "ckpt").run().history


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_dp2_zero_in_float16_matches_one_process_and_checkpoints_the_fp32_masters(
    two_worker_jobs, single_process_fp16, zero_stage
):
    out, ranks = two_worker_jobs[f"dp2-zero{zero_stage}-fp16"]
    # float16's own precision (2^-11): the dp sum adds the fp32 gradients in another order, a last-bit difference in
    # a master flips the float16 rounding of its working weight, and the float16 matmuls show it (ZeRO-2's gradient
    # norm drifts up to 3e-4 over 20 steps; fp32 layouts match to 1e-5, tests/test_parallel_msrun.py).
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process_fp16, rtol=1e-3)
    saved = read_weights(Path(ranks[0]["checkpoint"]))
    for rank in (0, 1):
        final = np.load(out / "out" / f"rank{rank}_final.npz")
        # The table too: its gradient is taken by rows (`step.rows_table`), added into its buffer in fp32.
        assert final["layers.0.mlp.up_proj.weight"].dtype == final["embed_tokens.weight"].dtype == np.float16
        assert final["norm.weight"].dtype == np.float32
        for name in final:
            np.testing.assert_array_equal(final[name], saved[name].astype(final[name].dtype), err_msg=name)
    master = saved["layers.0.mlp.up_proj.weight"]
    assert master.dtype == np.float32 and not np.array_equal(master, master.astype(np.float16).astype(np.float32))
