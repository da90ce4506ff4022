"""Optimizer offload: the update, the run and its checkpoints equal those without offload bit for bit (one process,
and dp2 under ZeRO-1/2/3), a resumed offloaded run repeats the straight one, and no offload file outlives its run.
Parameter offload's pieces in one process: the update of weights kept in a file, and a ZeRO-3 step (over a group of
one) fetching its shards from the file; tests/test_offload_msrun.py trains with it under dp2."""

from __future__ import annotations

import os
import tempfile

import mindspore as ms
import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Parameter, ParameterTuple, Tensor, ops
from safetensors.numpy import load_file

from model_core.data import prepare_dataset
from model_core.model.llama import Llama
from model_core.model.weights import model_weights
from model_core.optim import offload
from model_core.parallel.optimizer import AdamW
from model_core.optim.offload import FILE_PREFIX, OffloadedMoments, Slot, offload_mappings
from model_core.optim.step import AccumulateGradients, ApplyGradients
from model_core.parallel import comm
from model_core.parallel.param_offload import ShardFile, offload_parameters
from model_core.parallel.zero3 import shard_parameters
from model_core.train.trainer import Trainer
from params import OptimizerParams, load_params

STEPS = 10
RUN = [*SMALL_MODEL, "train.log_interval=1", "train.eval_interval=5", "train.eval_batches=2", "optimizer.warmup_steps=2",
       "train.checkpoint_interval=5", f"train.steps={STEPS}"]
KEYS = ("step", "loss", "grad_norm", "lr", "validation_loss")


@pytest.fixture(scope="module")
def dataset_dir(corpus_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("offload-data")
    params = load_params("tiny", [f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={out}", *SMALL_MODEL])
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


@pytest.fixture
def small_buckets(monkeypatch):
    """Buckets of 10,240 elements: the test model's 106,816 moments pass in 11 buckets, cut inside matrices' rows."""
    monkeypatch.setattr(offload, "BUCKET_ELEMENTS", 10_240)


@pytest.fixture(scope="module")
def without_offload(dataset_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("no-offload")
    trainer = Trainer(load_params("tiny", [*RUN, f"train.output_dir={out}"]), dataset_dir, out / "ckpt")
    return trainer.run(), model_weights(trainer.model), out / "ckpt"


def metrics(history: list[dict]) -> list[list]:
    return [[record.get(key) for key in KEYS] for record in history]


def assert_same_checkpoint(got, expected) -> None:
    for name in ("model.safetensors", "optimizer.safetensors"):
        again, before = load_file(got / name), load_file(expected / name)
        assert again.keys() == before.keys(), name
        for key in before:
            np.testing.assert_array_equal(again[key], before[key], err_msg=f"{name}: {key}")


def test_the_update_equals_adamw_when_buckets_cut_weights_mid_row():
    rng = np.random.default_rng(0)
    # Sizes that are multiples of 256, as AdamW's own kernel needs to run them all 8-wide (see BUCKET_ALIGNMENT).
    shapes = [(16, 48), (256,), (32, 16), (8, 32)]
    initial = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    gradients = [[rng.normal(size=shape).astype(np.float32) for shape in shapes] for _ in range(3)]

    def weights_and_buffers(prefix):
        weights = [Parameter(Tensor(a.copy()), name=f"{prefix}{i}") for i, a in enumerate(initial)]
        buffers = [Parameter(Tensor(np.zeros(s, np.float32)), name=f"{prefix}g{i}", requires_grad=False) for i, s in enumerate(shapes)]
        return weights, buffers

    plain, plain_buffers = weights_and_buffers("a")
    apply = ApplyGradients(ParameterTuple(plain_buffers), AdamW(plain))
    ours, our_buffers = weights_and_buffers("b")
    slots = [Slot(f"w{i}", w, 0, w.size, i, 0, w.ndim >= 2) for i, w in enumerate(ours)]
    offloaded = OffloadedMoments(slots, 0.9, 0.95, 1e-8, 0.1, bucket_elements=256)
    assert len(offloaded.buckets) == 7  # 1,792 elements; (16, 48) is cut in the middle of rows 5 and 10
    for step in range(3):
        for buffers in (plain_buffers, our_buffers):
            for buffer, gradient in zip(buffers, gradients[step]):
                ops.assign(buffer, Tensor(gradient))
        scalars = (Tensor(1e-2, ms.float32), Tensor(step + 1, ms.float32), Tensor(0.5, ms.float32))
        apply(*scalars)
        offloaded.step(our_buffers, *scalars)
    for got, expected, start in zip(ours, plain, initial):
        assert not np.array_equal(expected.asnumpy(), start)
        np.testing.assert_array_equal(got.asnumpy(), expected.asnumpy())
    state = offloaded.local_state()
    for k, (m, v) in enumerate(zip(apply.optimizer.exp_avg, apply.optimizer.exp_avg_sq)):
        np.testing.assert_array_equal(state[("adam_m", k)], m.asnumpy().reshape(-1))
        np.testing.assert_array_equal(state[("adam_v", k)], v.asnumpy().reshape(-1))
    offloaded.close()
    assert not offload_mappings()


def test_the_update_of_weights_kept_in_a_file_equals_it_in_memory():
    rng = np.random.default_rng(1)
    shapes = {"w0": (2048,), "w1": (256,), "w2": (768,)}  # flat ZeRO-3 shards; w0 spans two buckets
    initial = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    gradients = [{name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()} for _ in range(3)]
    buffers = {name: Parameter(Tensor(np.zeros(shape, np.float32)), name=f"g.{name}", requires_grad=False)
               for name, shape in shapes.items()}
    in_memory = {name: Parameter(Tensor(value.copy()), name=name) for name, value in initial.items()}
    in_file = ShardFile(initial)
    optimizer = OptimizerParams(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def adamw(weights):
        slots = [Slot(name, weights[name], 0, initial[name].size, k, 0, name != "w1") for k, name in enumerate(shapes)]
        return OffloadedMoments(slots, optimizer.beta1, optimizer.beta2, optimizer.eps, optimizer.weight_decay,
                                bucket_elements=1024)

    updates = [adamw(in_memory), adamw(in_file.weights)]
    for step in range(3):
        for update in updates:
            for name, buffer in buffers.items():
                ops.assign(buffer, Tensor(gradients[step][name]))
            update.step(list(buffers.values()), Tensor(1e-2, ms.float32), Tensor(step + 1, ms.float32),
                        Tensor(0.5, ms.float32))
    assert updates[1].last_bytes == updates[0].last_bytes + 2 * 4 * 3072  # the weights read and written too
    for name in shapes:
        assert not np.array_equal(in_memory[name].asnumpy(), initial[name])
        np.testing.assert_array_equal(in_file.weights[name].read(), in_memory[name].asnumpy(), err_msg=name)
    for update in updates:
        update.close()
    in_file.close()
    assert not offload_mappings()


def test_a_zero3_step_with_its_shards_in_a_file_equals_it_with_them_in_memory():
    """Over a group of one: the fetched shards give the same loss and the same shard gradients, bit for bit, in the
    compiled step and in an evaluation forward, and checkpoints read and write the file."""
    params = load_params("tiny", SMALL_MODEL)
    group = comm.group((0,))
    rng = np.random.default_rng(2)
    tokens = Tensor(rng.integers(0, params.model.vocab_size, (2, params.model.seq_len)).astype(np.int32))
    inputs = (tokens, tokens, Tensor(np.ones(tokens.shape, np.float32)), None, None, Tensor(0.01, ms.float32))
    results = []
    for offloaded in (False, True):
        ms.set_seed(0)
        model = Llama(params.model)
        sharded = shard_parameters(model, group)
        if offloaded:
            sharded = offload_parameters(model, sharded)
            step = AccumulateGradients(model, ParameterTuple(model.trainable_params()))
        else:
            step = AccumulateGradients(model)
        summed = [float(step(*inputs).asnumpy()) for _ in range(2)]
        evaluated = float(step.loss(*inputs)[1].asnumpy())
        gradients = {name: buffer.asnumpy() for name, buffer in zip(sharded.shards, step.buffers)}
        results.append((summed, evaluated, gradients, sharded.full_weights(), sharded))
    (summed, evaluated, gradients, weights, _), (summed_again, evaluated_again, gradients_again, weights_again, sharded) = results
    assert summed_again == summed and evaluated_again == evaluated
    assert gradients_again.keys() == gradients.keys()
    for name, gradient in gradients.items():
        assert np.any(gradient), name
        np.testing.assert_array_equal(gradients_again[name], gradient, err_msg=name)
    for name, value in weights.items():
        np.testing.assert_array_equal(weights_again[name], value, err_msg=name)
    shards = sharded.offloaded
    assert shards.fetched_bytes > 2 * shards.nbytes  # every shard fetched in each forward and each backward
    sharded.load_full_weights({name: value * 2 for name, value in weights.items()})
    np.testing.assert_array_equal(shards.weights["norm.weight"].read(), weights["norm.weight"] * 2)
    shards.close()
    assert not offload_mappings()


def test_ten_steps_and_their_checkpoints_equal_the_run_without_offload(dataset_dir, tmp_path, without_offload, small_buckets):
    expected, expected_weights, expected_checkpoints = without_offload
    trainer = Trainer(load_params("tiny", [*RUN, "parallel.optimizer_offload=true", f"train.output_dir={tmp_path}"]),
                      dataset_dir, tmp_path / "ckpt")
    assert trainer.optimizer.moment_bytes() == 2 * 4 * 10_240  # the staging bucket, not the 854,528 bytes of moments
    during = []
    result = trainer.run(on_metrics=lambda record: during.append(offload_mappings()))
    assert metrics(result.history) == metrics(expected.history)
    for name, value in model_weights(trainer.model).items():
        np.testing.assert_array_equal(value, expected_weights[name], err_msg=name)
    for step in (5, STEPS):
        name = f"step-{step:08d}"
        assert_same_checkpoint(tmp_path / "ckpt" / name, expected_checkpoints / name)
    last = result.history[-1]
    assert last["offload_bytes_per_step"] == 2 * 2 * 4 * 11 * 10_240  # m and v, in and out, 11 buckets
    assert last["offload_seconds_per_step"] > 0
    assert all(len(mapped) == 1 and mapped[0].endswith("(deleted)") for mapped in during)  # unlinked from the start
    assert not offload_mappings()  # released when the run ended
    assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(FILE_PREFIX)]


def test_an_offloaded_run_stopped_by_an_exception_resumes_bit_exactly(dataset_dir, tmp_path, without_offload, small_buckets):
    expected, expected_weights, _ = without_offload
    params = load_params("tiny", [*RUN, "parallel.optimizer_offload=true", f"train.output_dir={tmp_path}"])

    def crash_at_step_7(record):
        if record["step"] == 7:
            raise KeyboardInterrupt

    crashed = Trainer(params, dataset_dir, tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        crashed.run(on_metrics=crash_at_step_7)
    assert not offload_mappings()  # the exception released the file too
    with pytest.raises(RuntimeError, match="offload file was released"):
        crashed.optimizer.state_dict()
    resumed_trainer = Trainer(params, dataset_dir, tmp_path / "ckpt")
    resumed = resumed_trainer.run(resume="auto")
    assert resumed.resumed_from.name == "step-00000005"
    assert metrics(resumed.history) == metrics(expected.history[5:])
    for name, value in model_weights(resumed_trainer.model).items():
        np.testing.assert_array_equal(value, expected_weights[name], err_msg=name)
