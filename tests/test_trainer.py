"""The trainer on a small real corpus: it learns, accumulation and recompute are exact, precision and
non-finite handling behave, and checkpoints resume bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Tensor, ops
from safetensors.numpy import load_file

from model_core.model.weights import model_weights
from model_core.storage import read_weights
from model_core.train import checkpoint as ckpt
from model_core.train.flops import flops_per_token
from model_core.train.precision import PrecisionError
from model_core.train.trainer import NonFiniteError, ResumeError, Trainer
from params import load_params


def small(tmp_path, *overrides: str):
    base = [*SMALL_MODEL, "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2", "optimizer.warmup_steps=2"]
    return load_params("tiny", [*base, f"train.output_dir={tmp_path}", *overrides])


def _weights(trainer: Trainer) -> dict[str, np.ndarray]:
    return model_weights(trainer.model)


@pytest.fixture(scope="module")
def trained(dataset_dir, tmp_path_factory) -> tuple[Trainer, Path]:
    """A 3-step run's trainer and final checkpoint, which the tests that start from a trained model share; they
    only read them."""
    out = tmp_path_factory.mktemp("trained")
    trainer = Trainer(small(out, "train.steps=3"), dataset_dir, out / "ckpt")
    return trainer, trainer.run().checkpoint


def test_loss_falls_and_metrics_are_complete(dataset_dir, tmp_path):
    params = small(tmp_path, "train.steps=40", "optimizer.lr=3e-3", "train.eval_interval=20")
    records = []
    result = Trainer(params, dataset_dir, tmp_path / "ckpt").run(on_metrics=records.append)
    assert result.final_loss < result.initial_loss - 1.0
    assert [r["step"] for r in records] == list(range(1, 41))
    last = records[-1]
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "peak_memory_bytes", "loss_scale", "skipped_steps", "mfu"} <= last.keys()
    assert last["tokens_per_second"] > 0 and last["peak_memory_bytes"] > 100e6 and 0 < last["mfu"] < 1
    # On CPU the MFU divides by the matmul peak measured on this machine, and the record says so.
    assert last["mfu_peak_measured"] == 1.0 and last["mfu_peak_flops"] > 1e8
    per_token = flops_per_token(params.model)
    assert last["mfu"] == pytest.approx(last["tokens_per_second"] * per_token / last["mfu_peak_flops"])
    assert "validation_loss" in records[19] and records[39]["validation_loss"] < records[19]["validation_loss"]
    assert last["lr"] == pytest.approx(params.optimizer.min_lr)
    assert result.checkpoint.name == "step-00000040" and ckpt.verify(ckpt.Checkpoint(result.checkpoint, 40)) is None


def test_accumulation_equals_one_larger_batch(dataset_dir, tmp_path):
    # AdamW divides by sqrt(v) + eps, so a gradient element near zero moves its weight by ~lr whatever its last
    # bits: summation-order rounding (micro-batches of 2 rows against 8) in such elements would decide the weights.
    # eps = 1e-6 keeps updates of elements that small proportional to their gradients.
    common = ("train.steps=3", "optimizer.eps=1e-6")
    one = Trainer(small(tmp_path, *common, "train.micro_batch_size=8"), dataset_dir, tmp_path / "a")
    four = Trainer(small(tmp_path, *common, "train.micro_batch_size=2", "train.grad_accum_steps=4"), dataset_dir, tmp_path / "b")
    history_one, history_four = one.run().history, four.run().history
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in history_four], [r[key] for r in history_one], rtol=1e-5, err_msg=key)
    for name, value in _weights(one).items():
        np.testing.assert_allclose(_weights(four)[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_a_step_reads_the_device_twice_whatever_its_micro_batches(dataset_dir, tmp_path, monkeypatch):
    # One process, four micro-batches: the summed losses are read once, after the last backward, and the gradient
    # norm once, for the non-finite check and the clip. Under dp one host all-reduce adds the token count and one
    # the summed loss (with MoE routing statistics riding along): four in all.
    trainer = Trainer(small(tmp_path, "train.steps=2", "train.micro_batch_size=2", "train.grad_accum_steps=4"),
                      dataset_dir, tmp_path / "a")
    trainer._optimizer_step()  # compiles
    reads = []
    read = Tensor.asnumpy
    monkeypatch.setattr(Tensor, "asnumpy", lambda self: reads.append(tuple(self.shape)) or read(self))
    trainer._optimizer_step()
    assert reads == [(4,), ()], reads


def test_recompute_gives_the_same_gradients(dataset_dir, tmp_path):
    plain = Trainer(small(tmp_path, "train.steps=2"), dataset_dir, tmp_path / "a")
    recomputed = Trainer(small(tmp_path, "train.steps=2", "recompute.mode=all"), dataset_dir, tmp_path / "b")
    assert [r["grad_norm"] for r in plain.run().history] == pytest.approx(
        [r["grad_norm"] for r in recomputed.run().history], rel=1e-5
    )
    for name, value in _weights(plain).items():
        np.testing.assert_allclose(_weights(recomputed)[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("layers", [pytest.param(12), pytest.param(48, marks=pytest.mark.extended)])
def test_a_deep_model_trains(dataset_dir, tmp_path, layers):
    """The compiled step unrolls its loops over the weights (the update, the norm) into chains of graph calls, which
    MindSpore stops at 1000 by default: a branch in a loop's body nested calls for every weight, and a 12-layer
    model's update passed the limit (Llama-2 13B has 40 layers); a model of more than some 400 weights (48 layers
    here) passes it even with plain loops."""
    trainer = Trainer(small(tmp_path, "train.steps=2", f"model.num_layers={layers}"), dataset_dir, tmp_path / "ckpt")
    before = _weights(trainer)
    history = trainer.run().history
    assert len(history) == 2 and all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in history)
    after = _weights(trainer)
    assert all(not np.array_equal(after[name], value) for name, value in before.items())


def test_fp16_stays_close_to_fp32(dataset_dir, tmp_path):
    fp32 = Trainer(small(tmp_path, "train.steps=8"), dataset_dir, tmp_path / "a").run()
    fp16 = Trainer(small(tmp_path, "train.steps=8", "precision.compute_dtype=float16"), dataset_dir, tmp_path / "b").run()
    assert fp16.skipped_steps == 0
    np.testing.assert_allclose([r["loss"] for r in fp16.history], [r["loss"] for r in fp32.history], rtol=2e-2)


def test_fp16_overflow_is_skipped_and_the_scale_backs_off(dataset_dir, tmp_path):
    params = small(
        tmp_path, "train.steps=6", "precision.compute_dtype=float16",
        "precision.initial_loss_scale=1.0e+30", "precision.loss_scale_factor=1.0e+10",
    )
    result = Trainer(params, dataset_dir, tmp_path / "ckpt").run()
    scales = [r["loss_scale"] for r in result.history]
    assert result.skipped_steps >= 1 and scales[0] < 1e30 and scales[-1] <= 1e10
    assert result.history[-1]["skipped_steps"] == result.skipped_steps
    assert np.isfinite(result.final_loss)


def test_nonfinite_steps_stop_the_run_and_keep_the_last_good_checkpoint(dataset_dir, tmp_path):
    params = small(tmp_path, "train.steps=20", "train.checkpoint_interval=1", "train.max_consecutive_nonfinite=3")
    trainer = Trainer(params, dataset_dir, tmp_path / "ckpt")
    stop_after = 3

    def poison(record):
        if record["step"] == stop_after:
            raise KeyboardInterrupt  # stand-in for "something went wrong now"

    with pytest.raises(KeyboardInterrupt):
        trainer.run(on_metrics=poison)
    embedding = trainer.model.embed_tokens.weight
    ops.assign(embedding, embedding * float("nan"))
    with pytest.raises(NonFiniteError, match=r"step 6: .* not finite for 3 steps in a row"):
        trainer.run()
    good = ckpt.latest_valid(tmp_path / "ckpt")
    assert good.step == stop_after - 1  # the step-3 save was interrupted; no NaN step was saved
    assert np.isfinite(good.load()[0]["embed_tokens.weight"]).all()


def test_interrupted_run_resumes_bit_exactly(dataset_dir, tmp_path):
    params = small(tmp_path, "train.steps=6", "train.checkpoint_interval=2")
    straight = Trainer(params, dataset_dir, tmp_path / "straight")
    expected = straight.run()

    def crash_at_step_5(record):
        if record["step"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(params, dataset_dir, tmp_path / "crashed").run(on_metrics=crash_at_step_5)
    resumed_trainer = Trainer(params, dataset_dir, tmp_path / "crashed")
    resumed = resumed_trainer.run(resume="auto")
    assert resumed.resumed_from.name == "step-00000004"
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in expected.history[4:]]
    for name, value in _weights(straight).items():
        np.testing.assert_array_equal(_weights(resumed_trainer)[name], value, err_msg=name)


def test_resume_skips_a_corrupted_checkpoint(dataset_dir, tmp_path):
    params = small(tmp_path, "train.steps=4", "train.checkpoint_interval=2")
    Trainer(params, dataset_dir, tmp_path / "ckpt").run()
    newest = tmp_path / "ckpt" / "step-00000004" / "optimizer.safetensors"
    newest.write_bytes(b"\0" * 64)
    resumed = Trainer(params, dataset_dir, tmp_path / "ckpt").run(resume="auto")
    assert resumed.resumed_from.name == "step-00000002" and resumed.steps == 4


def test_resume_refuses_a_checkpoint_of_another_model(dataset_dir, trained, tmp_path):
    _, saved = trained
    shutil.copytree(saved, tmp_path / "ckpt" / saved.name)
    other = small(tmp_path, "train.steps=4", "model.ffn_hidden_size=96")
    with pytest.raises(ResumeError, match="model.ffn_hidden_size=128, this run has model.ffn_hidden_size=96"):
        Trainer(other, dataset_dir, tmp_path / "ckpt").run(resume="auto")


def test_params_the_run_cannot_honour_fail_at_start_up(dataset_dir, tmp_path):
    with pytest.raises(ValueError, match="prepared for seq_len=32 but model.seq_len=64"):
        Trainer(small(tmp_path, "model.seq_len=64"), dataset_dir, tmp_path / "ckpt")
    with pytest.raises(PrecisionError, match="bfloat16 cannot train on CPU"):
        Trainer(small(tmp_path, "precision.compute_dtype=bfloat16"), dataset_dir, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Trainer(small(tmp_path, "train.micro_batch_size=100000"), dataset_dir, tmp_path / "ckpt")


@pytest.mark.slow
def test_killed_cli_run_resumes_to_identical_weights(corpus_jsonl, tmp_path):
    """`llmflow train` killed with SIGKILL mid-run, then `--resume auto`: same weights as an unbroken run."""
    common = [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={tmp_path / 'data'}",
        *SMALL_MODEL, "train.steps=12", "train.checkpoint_interval=2", "train.log_interval=1",
    ]

    def command(output: str, *extra: str) -> list[str]:
        sets = [arg for item in [*common, f"train.output_dir={tmp_path / output}"] for arg in ("--set", item)]
        return [sys.executable, "-m", "flows.cli", "train", *sets, *extra]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(command("straight"), check=True, env=env, capture_output=True, timeout=600)
    victim = subprocess.Popen(command("killed", "--metrics-jsonl", str(tmp_path / "killed.jsonl")), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not list((tmp_path / "killed").rglob("step-00000006")) and time.monotonic() < deadline:
        assert victim.poll() is None, "the run finished before it could be killed"
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    done = subprocess.run(command("killed", "--resume", "auto", "--metrics-jsonl", str(tmp_path / "killed.jsonl")),
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stdout

    final = [load_file(next((tmp_path / run).rglob("step-00000012")) / "model.safetensors") for run in ("straight", "killed")]
    assert final[0].keys() == final[1].keys()
    for name in final[0]:
        np.testing.assert_array_equal(final[1][name], final[0][name], err_msg=name)
    logged = [json.loads(line) for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 12


def test_initial_weights_replace_the_random_initialisation(dataset_dir, trained, tmp_path):
    first, saved = trained
    fresh = Trainer(small(tmp_path, "train.steps=3", "train.seed=99"), dataset_dir, tmp_path / "b")
    started = Trainer(small(tmp_path, "train.steps=3", "train.seed=99"), dataset_dir, tmp_path / "c", initial_weights=saved)
    started.resume("none")
    assert started.evaluate() == first.evaluate() != fresh.evaluate()


def test_initial_weights_may_be_stored_in_bf16(dataset_dir, trained, tmp_path):
    from model_core.storage import write_safetensors

    first, _ = trained
    (tmp_path / "bf16").mkdir()
    write_safetensors(tmp_path / "bf16" / "model.safetensors", model_weights(first.model), "bfloat16")
    started = Trainer(small(tmp_path, "train.steps=1"), dataset_dir, tmp_path / "b", initial_weights=tmp_path / "bf16")
    started.resume("none")
    assert abs(started.evaluate() - first.evaluate()) < 1e-2


def test_lora_starts_from_the_initial_weights_and_trains_only_the_adapters(dataset_dir, trained, tmp_path):
    _, saved = trained
    before = read_weights(saved)
    params = small(tmp_path, "train.steps=2")
    tuned = Trainer(params, dataset_dir, tmp_path / "b", initial_weights=saved, lora=params.lora)
    assert tuned.adaptation.adapted_modules == 2 * len(params.lora.target_modules)
    started = model_weights(tuned.model)
    tuned.run()
    after = model_weights(tuned.model)
    assert all(np.array_equal(before[name], after[name]) for name in before)  # the base is frozen
    adapters = set(after) - set(before)
    assert adapters and all(name.endswith((".lora_a", ".lora_b")) for name in adapters)
    assert all(not np.array_equal(started[name], after[name]) for name in adapters)
