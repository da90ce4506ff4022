"""Two msrun workers on this machine: every collective (the all-to-all too) against numpy, a late rank waited
for, dp2 and dp2 + ZeRO-1/2/3 training equal to one process on the same global batch, ZeRO's halved optimizer
state (ZeRO-2's halved gradient buffers, ZeRO-3's halved weights), bit-exact resume, checkpoints that load
across layouts, and a killed worker failing fast. The other *_msrun.py files reuse the helpers here; the
reference run is tests/conftest.py's."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import FOUR_WORKER_JOBS, PARALLEL_RUN, PARALLEL_STEPS, TWO_WORKER_JOBS

from model_core.model.weights import model_weights
from model_core.parallel.launch import LaunchError, launch
from model_core.parallel.zero import flat_shards
from model_core.train.checkpoint import Checkpoint
from model_core.train.trainer import Trainer
from params import load_params

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("parallel_worker.py"))
STEPS, RUN = PARALLEL_STEPS, PARALLEL_RUN  # the reference run `single_process` (tests/conftest.py) trains


def run_workers(tmp_path, *args: str, workers: int = 2) -> list[dict]:
    echo = io.StringIO()
    launch([WORKER, *args], workers, tmp_path / "logs", grace_s=10, echo=echo)
    return [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(workers)]


def _options(out: Path, overrides: tuple[str, ...], resume: Path | None) -> list[str]:
    """The worker's options: `--set` for each params override; an override "--flag=value" is the worker's own flag."""
    options = [a for o in (*RUN, f"train.output_dir={out}", *overrides)
               for a in (o.split("=", 1) if o.startswith("--") else ("--set", o))]
    return options if resume is None else [*options, "--resume", str(resume)]


def train_job(out: Path, dataset_dir: Path, *overrides: str, resume: Path | None = None, workers: int = 2) -> list[dict]:
    """A training job of RUN + overrides on `workers` msrun workers (from `resume` if given); each rank's report."""
    return run_workers(out, "train", str(out / "out"), str(dataset_dir), *_options(out, overrides, resume), workers=workers)


def train_jobs(
    root: Path, dataset_dir: Path, jobs: dict[str, tuple[str, ...]], workers: int = 2, resume: dict[str, Path] | None = None
) -> dict[str, tuple[Path, list[dict]]]:
    """train_job for each of `jobs` (name -> overrides; from resume[name] where given), one after another in one
    msrun launch, so that its start-up is paid once: name -> (the job's directory, as train_job's `out`; each
    rank's report)."""
    resume = resume or {}
    spec = [{"out": str(root / name / "out"), "arguments": [str(dataset_dir), *_options(root / name, overrides, resume.get(name))]}
            for name, overrides in jobs.items()]
    (root / "jobs.json").write_text(json.dumps(spec))
    launch([WORKER, "jobs", str(root / "logs"), str(root / "jobs.json")], workers, root / "logs", grace_s=10, echo=io.StringIO())
    return {name: (root / name, [json.loads((root / name / "out" / f"rank{r}.json").read_text()) for r in range(workers)])
            for name in jobs}


def shared_or_own_job(request, name: str, out: Path, *overrides: str, workers: int = 2) -> tuple[Path, list[dict]]:
    """Job `name` from `two_worker_jobs` or `four_worker_jobs` where it is registered there (the default variants
    of a parametrized test), else a job of its own of `overrides` in `out` (the -m extended ones, which the shared
    launches leave out)."""
    if name in TWO_WORKER_JOBS:
        return request.getfixturevalue("two_worker_jobs")[name]
    if name in FOUR_WORKER_JOBS:
        return request.getfixturevalue("four_worker_jobs")[name]
    return out, train_job(out, request.getfixturevalue("dataset_dir"), *overrides, workers=workers)


SHORT = "train.steps=8"  # runs that bring their own reference: fewer steps than the shared 20-step one


def one_process(dataset_dir: Path, out: Path, *overrides: str) -> list[dict]:
    """The metrics of one process training RUN + overrides on 8 sequences a step (4 micro-batches of 2)."""
    params = load_params("tiny", [*RUN, *overrides, "parallel.micro_batches=4", f"train.output_dir={out}"])
    return Trainer(params, dataset_dir, out / "ckpt").run().history


def assert_same_metrics(got: list[dict], expected: list[dict], rtol: float = 1e-5) -> None:
    """Loss and gradient norm of every logged step, and the validation loss where both runs measured it."""
    assert [record["step"] for record in got] == [record["step"] for record in expected]
    for key in ("loss", "grad_norm", "validation_loss"):
        pairs = [(g[key], e[key]) for g, e in zip(got, expected) if key in g and key in e]
        assert len(pairs) == len(expected) or key == "validation_loss", key
        if pairs:
            np.testing.assert_allclose(*zip(*pairs), rtol=rtol, err_msg=key)


def resume_from_step(checkpoints: Path, step: int, into: Path) -> Path:
    """A copy of one checkpoint alone in a fresh directory (as if the run had stopped there)."""
    name = f"step-{step:08d}"
    shutil.copytree(checkpoints / name, into / name)
    return into / name


def assert_resumed_tail(uninterrupted: list[dict], resumed: list[dict], after: int = 10) -> None:
    """Every rank's metrics after step `after` of a resumed job repeat the uninterrupted job's to the bit."""
    keys = ("step", "loss", "grad_norm", "lr", "validation_loss")
    for before, again in zip(uninterrupted, resumed, strict=True):
        tail = [r for r in before["history"] if r["step"] > after]
        assert [[r.get(k) for k in keys] for r in again["history"]] == [[r.get(k) for k in keys] for r in tail]


def assert_same_blocks(checkpoint: Checkpoint, original: Checkpoint, blocks: int) -> None:
    """The two checkpoints' block files hold the same tensors, bit for bit."""
    for index in range(blocks):
        for again, before in zip(checkpoint.load_shard(index), original.load_shard(index)):
            assert again.keys() == before.keys()
            assert all(np.array_equal(again[name], before[name]) for name in before)


def resumes_in_one_process(checkpoints: Path, single_process: dict, dataset_dir: Path, tmp_path: Path) -> None:
    """Step 10 of `checkpoints`, resumed by one process (resharded in memory), follows the single-process run."""
    resume_from_step(checkpoints, 10, tmp_path / "ckpt")
    params = load_params("tiny", [*RUN, "parallel.micro_batches=4", f"train.output_dir={tmp_path}"])
    result = Trainer(params, dataset_dir, tmp_path / "ckpt").run(resume="auto")
    assert result.resumed_from.name == "step-00000010"
    assert_same_metrics(result.history, [r for r in single_process["history"] if r["step"] > 10])


def zero_job(stage: int, *overrides: str) -> tuple[str, ...]:
    return ("parallel.data_parallel=2", "parallel.micro_batches=2", f"parallel.zero_stage={stage}", *overrides)


# buckets of 64 KiB: the small model's gradients are summed in several of them, the table's alone (under ZeRO-2,
# on CPU, the last buckets hold nothing of rank 1's shard, whose all-reduces it must still run)
SMALL_BUCKETS = "parallel.gradient_bucket_mb=0.0625"
# The sum goes inside the backward only in a step of one micro-batch (`Parallelized.gradients`): the same global
# batch of 8 rows as one micro-batch of 4 on each rank.
ONE_MICRO_BATCH = ("parallel.micro_batches=1", "train.micro_batch_size=4")
TWO_WORKER_JOBS.update({
    "dp2-zero0": zero_job(0, SMALL_BUCKETS),
    "dp2-zero0-summed-in-backward": zero_job(
        0, SMALL_BUCKETS, *ONE_MICRO_BATCH, "parallel.overlap_gradient_reduction=true"
    ),
    "dp2-zero0-one-micro-batch": zero_job(0, SMALL_BUCKETS, *ONE_MICRO_BATCH),
    "dp2-zero1": zero_job(1), "dp2-zero2": zero_job(2, SMALL_BUCKETS), "dp2-zero3": zero_job(3),
    # ZeRO-2 as on Ascend and GPU: the buckets reduce-scattered by the native operator, here its stand-in
    "dp2-zero2-native-reduce-scatter": zero_job(2, SMALL_BUCKETS, "--emulate=reduce_scatter"),
})


def test_every_collective_matches_numpy_and_a_rank_late_to_one_by_more_than_the_node_timeout_is_waited_for(tmp_path):
    """One job for three checks (starting it costs more than they do): every collective, native, fallback and
    through its native path with stand-ins (`LLMFLOW_EMULATED_COLLECTIVES`), PyNative and jit, against numpy; the all-to-all and its gradient likewise; and a late rank. MindSpore's CPU
    collectives give up on a late peer after MS_NODE_TIMEOUT, which the launcher keeps short for its scheduler:
    a rank 12 s late (as one compiling its first graph can be) would fail a job whose node timeout is 5 s. The
    ranks wait for the collective timeout instead, and the sum arrives."""
    launch([WORKER, "collectives", str(tmp_path / "out"), "12"], 2, tmp_path / "logs", node_timeout_s=5,
           collective_timeout_s=60, echo=io.StringIO())
    for rank in (0, 1):
        found = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert found["comm"] and all(found["comm"].values()), [k for k, ok in found["comm"].items() if not ok]
        assert found["all_to_all"]["path/native=False"] == "fallback"
        assert found["all_to_all"]["path/native=emulated"] == "native"
        assert all(found["all_to_all"].values()), found["all_to_all"]
        assert found["late"] == [3.0, 3.0]


def test_a_silent_rank_stops_the_job_when_the_scheduler_gives_up_on_it(tmp_path):
    """A rank that stops answering without exiting (as one behind a lost network does) is found by the scheduler
    after the node timeout, not by its peer's collective, which waits far longer: the job stops then, naming it."""
    started = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 on node 0 stopped answering the job's scheduler") as failed:
        launch([WORKER, "freeze", str(tmp_path / "out")], 2, tmp_path / "logs", node_timeout_s=5,
               collective_timeout_s=300, echo=io.StringIO())
    assert time.monotonic() - started < 200, failed.value  # the peer's collective alone would wait 300 s


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_dp2_matches_one_process_on_the_global_batch(two_worker_jobs, single_process, zero_stage):
    _, ranks = two_worker_jobs[f"dp2-zero{zero_stage}"]
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
    held = [rank["moment_bytes"] for rank in ranks]
    full_moment_bytes = single_process["moment_bytes"]
    if zero_stage:
        # Its block of every bucket: half the moments and the last bucket's padding. Besides them the fp32 update
        # holds one block of scratch, no copy of the rank's shard.
        bucket_bytes = 2**16 if zero_stage == 2 else 2**25  # SMALL_BUCKETS; the default
        layout = flat_shards([full_moment_bytes // 8], 2, bucket_bytes)
        assert held == [8 * layout.length] * 2, (held, full_moment_bytes)
        assert [rank["optimizer_bytes"] for rank in ranks] == [8 * layout.length + 4 * layout.chunk] * 2
    else:
        assert held == [full_moment_bytes] * 2
        assert [rank["optimizer_bytes"] for rank in ranks] == [full_moment_bytes] * 2


def test_dp2_sums_gradients_inside_the_backward_or_after_it_to_the_same_bits(two_worker_jobs):
    """parallel.overlap_gradient_reduction sums a step's gradients in its backward graph, bucket by bucket, where the
    step is one micro-batch; summed after the backward instead (the default, in the same buckets), the job gives the
    same losses, gradient norms and final weights, bit for bit."""
    overlapped_out, overlapped = two_worker_jobs["dp2-zero0-summed-in-backward"]
    after_out, after = two_worker_jobs["dp2-zero0-one-micro-batch"]
    assert_resumed_tail(overlapped, after, after=0)
    for rank in (0, 1):
        final = [np.load(out / "out" / f"rank{rank}_final.npz") for out in (overlapped_out, after_out)]
        for name in final[0]:
            np.testing.assert_array_equal(final[1][name], final[0][name], err_msg=name)


def test_dp2_zero2_through_the_native_reduce_scatter_path_trains_to_the_same_bits(two_worker_jobs, single_process):
    """ZeRO-2 through the native reduce-scatter (each bucket reduce-scattered by the operator), which the CPU backend
    would never run, run with the operator's stand-in: it follows one process and ends on the same weights as the
    all-reduce fallback, bit for bit."""
    native_out, native = two_worker_jobs["dp2-zero2-native-reduce-scatter"]
    fallback_out, fallback = two_worker_jobs["dp2-zero2"]
    assert [rank["zero2_native_reduce_scatter"] for rank in native + fallback] == [True, True, False, False]
    for rank in native:
        assert_same_metrics(rank["history"], single_process["history"])
    assert_resumed_tail(native, fallback, after=0)
    for rank in (0, 1):
        final = [np.load(out / "out" / f"rank{rank}_final.npz") for out in (native_out, fallback_out)]
        for name in final[0]:
            np.testing.assert_array_equal(final[0][name], final[1][name], err_msg=name)


def test_dp2_zero2_holds_half_the_gradient_buffers_of_zero1(two_worker_jobs):
    full = [rank["gradient_bytes"] for rank in two_worker_jobs["dp2-zero1"][1]]
    held = [rank["gradient_bytes"] for rank in two_worker_jobs["dp2-zero2"][1]]
    assert full[0] == full[1] and sum(held) == full[0]
    assert max(held) - min(held) <= 4 * padding(full[0] // 4, 2**16)  # halves, up to the padding (SMALL_BUCKETS)


def padding(parameters: int, bucket_bytes: int) -> int:
    """Elements of padding at the end of the last bucket of the model's dp2 shards."""
    layout = flat_shards([parameters], 2, bucket_bytes)
    return layout.buckets * 2 * layout.chunk - parameters


def test_dp2_zero3_matches_one_process_holding_half_the_weights_and_moments(two_worker_jobs, single_process):
    _, ranks = two_worker_jobs["dp2-zero3"]
    for rank in ranks:
        assert_same_metrics(rank["history"], single_process["history"])
    padding = 4 * len(single_process["final"])  # each parameter's shard rounds up by at most one fp32 element
    for key, full in (("parameter_bytes", single_process["parameter_bytes"]), ("moment_bytes", single_process["moment_bytes"])):
        per_parameter_padding = padding * (2 if key == "moment_bytes" else 1)
        for rank in ranks:
            assert full / 2 <= rank[key] <= full / 2 + per_parameter_padding, (key, rank[key], full)


def test_a_zero3_checkpoint_loads_in_one_process_as_the_joined_shards(two_worker_jobs, single_process, dataset_dir, tmp_path):
    out, _ = two_worker_jobs["dp2-zero3"]
    shards = [np.load(out / "out" / f"rank{rank}_final.npz") for rank in (0, 1)]
    trainer = Trainer(load_params("tiny", [*RUN, "parallel.micro_batches=4"]), dataset_dir, tmp_path / "ckpt")
    trainer.resume(out / "out" / "checkpoints" / f"step-{STEPS:08d}")
    loaded = model_weights(trainer.model)
    assert loaded.keys() == single_process["final"].keys()
    for name, full in loaded.items():
        joined = np.concatenate([shard[name] for shard in shards])[: full.size].reshape(full.shape)
        np.testing.assert_array_equal(full, joined, err_msg=name)
        np.testing.assert_allclose(full, single_process["final"][name], rtol=1e-4, atol=1e-6, err_msg=name)


# ZeRO-3's resume runs by default; ZeRO-1 and ZeRO-2 restore moment shards as it does and run with -m extended
# (tests/test_zero_composed_msrun.py resumes a dp2 x pp2 ZeRO-2 job by default).
@pytest.mark.parametrize("zero_stage", [pytest.param(1, marks=pytest.mark.extended), pytest.param(2, marks=pytest.mark.extended), 3])
def test_dp2_zero_resume_is_bit_exact(two_worker_jobs, dataset_dir, tmp_path, zero_stage):
    """Stopped after step 10 and resumed in a new job, steps 11-20 repeat the uninterrupted run to the bit."""
    first_out, uninterrupted = two_worker_jobs[f"dp2-zero{zero_stage}"]
    start = resume_from_step(first_out / "out" / "checkpoints", 10, tmp_path / "out" / "checkpoints")
    resumed = train_job(tmp_path, dataset_dir, *TWO_WORKER_JOBS[f"dp2-zero{zero_stage}"], resume=start)
    assert_resumed_tail(uninterrupted, resumed)
    for rank in (0, 1):
        final = [np.load(out / "out" / f"rank{rank}_final.npz") for out in (first_out, tmp_path)]
        for name in final[0]:
            np.testing.assert_array_equal(final[1][name], final[0][name], err_msg=name)


def test_a_killed_worker_fails_the_job_fast_with_its_log_tail(dataset_dir, tmp_path):
    overrides = [*RUN, "train.steps=100000", "parallel.data_parallel=2", f"train.output_dir={tmp_path}"]
    failure: list[BaseException] = []

    def job():
        try:
            run_workers(tmp_path, "train", str(tmp_path / "out"), str(dataset_dir), *[a for o in overrides for a in ("--set", o)])
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            failure.append(error)

    before = {process.pid for process in psutil.Process().children(recursive=True)}  # e.g. a Prefect test server
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        victim = _wait_for_worker(rank="1", log=tmp_path / "logs" / "worker_1.log", timeout_s=90)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        thread.join(timeout=60)
    finally:  # a failed wait must not leave a 100,000-step job (and this pytest process) running
        if thread.is_alive():
            for process in psutil.Process().children(recursive=True):
                if process.pid not in before:
                    process.kill()
    assert not thread.is_alive(), "the launcher did not return within 60 s of the kill"
    assert time.monotonic() - killed_at < 30
    assert failure and isinstance(failure[0], LaunchError)
    assert "rank 1 exited with code -9" in str(failure[0]) and "worker_1.log" in str(failure[0])
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE]


def _wait_for_worker(rank: str, log: Path, timeout_s: float, settle_s: float = 8.0) -> psutil.Process:
    """Worker `rank` once it has run for `settle_s` (past start-up; with 100,000 steps it is mid-run then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in psutil.Process().children(recursive=True):
            try:
                environ = process.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            is_worker = environ.get("MS_ROLE") == "MS_WORKER" and environ.get("RANK_ID") == rank
            if is_worker and log.exists() and time.time() - process.create_time() > settle_s:
                return process
        time.sleep(0.5)
    raise AssertionError(f"worker {rank} did not start within {timeout_s} s")


def test_llmflow_train_launches_its_ranks_under_msrun(corpus_jsonl, tmp_path, capsys):
    from flows.cli import main

    sets = [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={tmp_path / 'data'}",
        *RUN, "train.steps=3", f"train.output_dir={tmp_path / 'train'}", "parallel.data_parallel=2",
    ]
    args = ["train", *[arg for item in sets for arg in ("--set", item)]]
    assert main(args) == 0
    assert list((tmp_path / "train").rglob("step-00000003/manifest.json"))
    logs = list((tmp_path / "train").rglob("logs/worker_1.log"))
    assert logs and "trained 3 steps" in logs[0].read_text()

    # The ranks refuse a checkpoint made with another model: a rank's own reason is the last line, not a lost rank.
    checkpoint = next((tmp_path / "train").rglob("step-00000003"))
    capsys.readouterr()
    assert main([*args, "--set", "model.ffn_hidden_size=96", "--resume", str(checkpoint)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"llmflow train: rank [01]: checkpoint {re.escape(str(checkpoint))} was made with model.ffn_hidden_size=128, "
        r"this run has model.ffn_hidden_size=96", last
    ), last

    refused = ["--set", "parallel.pipeline_parallel=2", "--set", "parallel.micro_batches=2", "--set", "model.num_layers=3"]
    assert main([*args, *refused]) == 2  # bad params: refused as they are read
    assert "parallel.pipeline_parallel=2 does not divide model.num_layers=3 into equal stages" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
