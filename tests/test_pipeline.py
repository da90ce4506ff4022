"""Pipeline parallelism in one process: the schedules, their lock-step ticks, which stage owns which weight,
a one-stage pipeline equal to the plain accumulation step, and checkpoints split into stages and joined
again exactly (the two-stage runs are in tests/test_pipeline_msrun.py)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Tensor

from model_core.model import Llama
from model_core.model.weights import model_weights
from model_core.optim.step import AccumulateGradients
from model_core.parallel.layout import Layout, ParallelConfigError
from model_core.parallel.pipeline import (
    SCHEDULES,
    Action,
    MicroBatch,
    PipelineStage,
    SummedTokenLoss,
    idle_fraction,
    most_in_flight,
    schedule,
    ticks,
)
from model_core.train import checkpoint as ckpt
from model_core.train.reshard import reshard, whole_tensors
from params import load_params


def names(order: list[Action]) -> str:
    return " ".join(f"{a.kind}{a.micro_batch}" for a in order)


def test_1f1b_warms_up_then_alternates_and_gpipe_runs_every_forward_first():
    one_f_one_b = schedule("1f1b", 3, 4)
    assert names(one_f_one_b[0]) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert names(one_f_one_b[1]) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert names(one_f_one_b[2]) == "F0 F1 F2 F3"  # the last stage's forward includes its backward
    assert names(schedule("gpipe", 3, 4)[0]) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert most_in_flight(one_f_one_b) == [3, 2, 1]
    assert most_in_flight(schedule("gpipe", 3, 4)) == [4, 4, 1]
    with pytest.raises(ValueError, match="pipeline_schedule='zigzag' is not one of"):
        schedule("zigzag", 2, 2)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 5), (4, 8)])
def test_ticks_run_every_action_once_after_its_inputs_arrive(kind, stages, micro_batches):
    orders = schedule(kind, stages, micro_batches)
    when: dict[tuple[int, str, int], int] = {}
    for t, tick in enumerate(ticks(orders)):
        for stage, actions in enumerate(tick.actions):
            assert len({a.kind for a in actions}) == len(actions)  # at most one forward and one backward
            for action in actions:
                key = (stage, action.kind, action.micro_batch)
                assert key not in when
                when[key] = t
    for stage, order in enumerate(orders):
        done = [when[(stage, a.kind, a.micro_batch)] for a in order]
        assert done == sorted(done)  # in the stage's own order
        for action in order:
            t, m = when[(stage, action.kind, action.micro_batch)], action.micro_batch
            if action.kind == "F" and stage > 0:
                assert t > when[(stage - 1, "F", m)]  # the activation came in an earlier tick
            if action.kind == "B":
                sender_kind = "F" if stage + 1 == stages - 1 else "B"
                assert t > when[(stage + 1, sender_kind, m)]  # so did the gradient
    assert len(when) == sum(len(order) for order in orders)


def test_1f1b_idles_less_than_gpipe_on_two_stages():
    modelled = {kind: idle_fraction(ticks(schedule(kind, 2, 8))) for kind in SCHEDULES}
    assert 0 < modelled["1f1b"] < modelled["gpipe"] < 1


def test_stage_sizes_come_from_pipeline_layers_or_an_even_split():
    assert Layout.from_params(load_params("tiny", ["model.num_layers=4", "parallel.pipeline_parallel=2", "parallel.micro_batches=2"])).stage_sizes(4) == (2, 2)
    uneven = load_params("tiny", ["model.num_layers=5", "parallel.pipeline_parallel=2", "parallel.micro_batches=2", "parallel.pipeline_layers=[3, 2]"])
    assert Layout.from_params(uneven).stage_sizes(5) == (3, 2)
    with pytest.raises(ValueError, match=r"parallel.pipeline_layers=\[3, 1\] sum to 4 layers but model.num_layers=5"):
        load_params("tiny", ["model.num_layers=5", "parallel.pipeline_parallel=2", "parallel.micro_batches=2", "parallel.pipeline_layers=[3, 1]"])
    with pytest.raises(ValueError, match=r"parallel.pipeline_layers lists 3 stages but parallel.pipeline_parallel=2"):
        load_params("tiny", ["model.num_layers=5", "parallel.pipeline_parallel=2", "parallel.micro_batches=2", "parallel.pipeline_layers=[3, 1, 1]"])
    with pytest.raises(ParallelConfigError, match="pipeline_parallel=2 does not divide model.num_layers=5"):
        Layout(pp=2).stage_sizes(5)


def test_a_one_stage_pipeline_accumulates_the_plain_steps_gradients():
    params = load_params("tiny", SMALL_MODEL).model
    rng = np.random.default_rng(0)

    def micro_batch():
        tokens, labels = (Tensor(rng.integers(0, params.vocab_size, (2, 16)).astype(np.int32)) for _ in range(2))
        return MicroBatch(tokens, labels, Tensor(np.ones((2, 16), np.int32)), None, None)

    batches = [micro_batch() for _ in range(3)]
    scale = Tensor(1 / 96, ms.float32)
    ms.set_seed(0)
    plain = AccumulateGradients(Llama(params))
    expected = sum(float(plain(b.tokens, b.labels, b.loss_mask, None, None, scale).asnumpy()) for b in batches)
    ms.set_seed(0)
    stage = PipelineStage(Llama(params), Layout(), 0, params, "1f1b", SummedTokenLoss())
    assert stage.run(batches, scale) == pytest.approx(expected, rel=1e-6)
    for want, got in zip(plain.buffers, stage.buffers):
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-8)
    assert 0.0 <= stage.last_timing.bubble() < 1.0


def test_checkpoint_split_into_stages_and_joined_again_is_exact(tmp_path):
    params = load_params("tiny", [*SMALL_MODEL, "model.num_layers=4", "model.tie_embeddings=true"]).model
    weights = model_weights(Llama(params))
    rng = np.random.default_rng(1)
    moments = {f"{k}.{n}": rng.standard_normal(v.shape).astype(np.float32) for n, v in weights.items() for k in ("adam_m", "adam_v")}
    state = {"step": 3, "model": params.model_dump(mode="json")}
    original = ckpt.save_checkpoint(tmp_path / "one", 3, weights, moments, state, keep=1)
    staged = reshard(original.path, Layout(tp=2, pp=2), tmp_path / "pp2tp2")
    files = sorted(p.name for p in staged.path.glob("model*"))
    assert files == [f"model-pp{s}-of-2-tp{t}-of-2.safetensors" for s in (0, 1) for t in (0, 1)]
    stage1, _ = staged.load_shard(ckpt.block_index(Layout(tp=2, pp=2), 1, 0))
    assert "layers.3.mlp.down_proj.weight" in stage1 and "layers.1.mlp.down_proj.weight" not in stage1
    assert "embed_tokens.weight" in stage1  # the tied table's copy on the last stage
    joined_weights, joined_moments = whole_tensors(staged)
    assert joined_weights.keys() == weights.keys() and joined_moments.keys() == moments.keys()
    assert all(np.array_equal(joined_weights[n], weights[n]) for n in weights)
    back = reshard(staged.path, Layout(), tmp_path / "back")
    for again, before in zip(back.load()[:2], original.load()[:2]):
        assert all(np.array_equal(again[n], before[n]) for n in before)
    uneven = reshard(original.path, Layout(pp=2, pipeline_layers=(3, 1)), tmp_path / "uneven")
    assert uneven.layout() == Layout(pp=2, pipeline_layers=(3, 1))
    last, _ = uneven.load_shard(1)
    assert {n.split(".")[1] for n in last if n.startswith("layers.")} == {"3"}
    assert all(np.array_equal(whole_tensors(uneven)[0][n], weights[n]) for n in weights)
    with pytest.raises(ParallelConfigError, match="pipeline_parallel=3 does not divide model.num_layers=4"):
        reshard(original.path, Layout(pp=3), tmp_path / "bad")
