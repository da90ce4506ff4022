"""AdamW against torch.optim.AdamW in PyNative, jit and graph mode; gradient clipping; the LR schedule."""

from __future__ import annotations

import math
import shutil

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model_core.optim.adamw import clip_by_global_norm
from model_core.parallel.optimizer import AdamW
from model_core.optim.step import ApplyGradients
from model_core.parallel import comm
from model_core.parallel.optimizer import RankState
from model_core.parallel.placement import FLAT_SHARD, WHOLE, StatePlacement
from model_core.train.schedule import learning_rate
from params.schema import OptimizerParams

SHAPES = {
    "embed_tokens.weight": (32, 8),
    "layers.0.input_layernorm.weight": (8,),
    "layers.0.self_attn.q_proj.weight": (8, 8),
    "layers.0.mlp.down_proj.bias": (8,),
    "norm.weight": (8,),
}
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1


@pytest.fixture
def graph_mode():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


class JitStep(nn.Cell):
    """The optimizer called from a jit-compiled construct, the way a train step calls it."""

    def __init__(self, optimizer: AdamW):
        super().__init__()
        self.optimizer = optimizer

    @ms.jit
    def construct(self, grads, lr, step):
        self.optimizer(grads, lr, step)


def initial_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def gradient_steps(count: int, seed: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES.values()] for _ in range(count)]


def make_optimizer(values: dict[str, np.ndarray]) -> tuple[list[Parameter], AdamW]:
    parameters = [Parameter(Tensor(value), name=name) for name, value in values.items()]
    return parameters, AdamW(parameters, BETAS, EPS, WEIGHT_DECAY)


def run_steps(mode: str, optimizer: AdamW, grads: list[list[np.ndarray]], lrs: list[float]) -> None:
    call = JitStep(optimizer) if mode == "jit" else optimizer
    for step, (step_grads, lr) in enumerate(zip(grads, lrs)):
        grad_tuple = tuple(Tensor(g) for g in step_grads)
        if mode != "pynative":
            grad_tuple = ms.mutable(grad_tuple)
        call(grad_tuple, Tensor(lr, ms.float32), Tensor(step + 1, ms.int32))


def torch_adamw(values: dict[str, np.ndarray], grads: list[list[np.ndarray]], lrs: list[float]) -> list[np.ndarray]:
    params = [torch.nn.Parameter(torch.tensor(value)) for value in values.values()]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lrs[0], betas=BETAS, eps=EPS)
    for step_grads, lr in zip(grads, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        for param, grad in zip(params, step_grads):
            param.grad = torch.tensor(grad)
        optimizer.step()
    return [p.detach().numpy() for p in params]


@pytest.mark.parametrize("mode", ["pynative", "jit", "graph"])
def test_twenty_steps_match_torch_adamw(mode, request):
    if mode == "graph":
        request.getfixturevalue("graph_mode")
    values = initial_values()
    grads = gradient_steps(20)
    schedule = OptimizerParams(lr=1e-2, min_lr=1e-3, warmup_steps=5)
    lrs = [learning_rate(step, 20, schedule) for step in range(20)]
    parameters, optimizer = make_optimizer(values)

    run_steps(mode, optimizer, grads, lrs)

    expected = torch_adamw(values, grads, lrs)
    for parameter, start, want in zip(parameters, values.values(), expected):
        got = parameter.asnumpy()
        assert np.abs(got - start).max() > 1e-3, f"{parameter.name} did not change in {mode} mode"
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), parameter.name


def apply_three_steps(make, values, grads, grad_scale: float, flat: bool = False) -> list[np.ndarray]:
    """Three `ApplyGradients` updates (lr 1e-2) of `make(parameters)`'s optimizer from buffers holding `grads`
    (`flat`: flattened, as ZeRO-2's gradient shards over a group of one hold them); the parameters after them."""
    parameters = [Parameter(Tensor(value), name=name) for name, value in values.items()]
    buffers = ParameterTuple(
        Parameter(Tensor(np.zeros((int(np.prod(shape)),) if flat else shape, np.float32)), name=f"grad.{name}",
                  requires_grad=False)
        for name, shape in SHAPES.items()
    )
    apply = ApplyGradients(buffers, make(parameters))
    for step, step_grads in enumerate(grads, start=1):
        for buffer, grad in zip(buffers, step_grads):
            ops.assign(buffer, Tensor(grad.reshape(-1) if flat else grad))
        apply(Tensor(1e-2, ms.float32), Tensor(step, ms.int32), Tensor(grad_scale, ms.float32))
        assert all(not buffer.asnumpy().any() for buffer in buffers), "the buffers are zeroed after the update"
    return [parameter.asnumpy() for parameter in parameters]


def placed(kinds: dict[str, tuple[str, str | None]], master_apart: bool = False,
           gradient_sharded: bool = False) -> list[StatePlacement]:
    """The placements of SHAPES' weights: name -> (kept, group)."""
    return [StatePlacement(name, kept, group, gradient_sharded and kept == FLAT_SHARD,
                           master_apart and kept == FLAT_SHARD, "memory", len(SHAPES[name]) >= 2)
            for name, (kept, group) in kinds.items()]


def test_the_gradient_scale_applied_inside_the_update_equals_scaled_gradients_whatever_the_placement():
    """The update scales each gradient as it uses it: bit for bit AdamW over gradients scaled beforehand, also for
    a flat ZeRO-1 shard over a group of one (in buckets of 64 bytes: every weight but the smallest in several pieces
    cut from its full buffer, which the first of them scales, and gathered back from several buckets), for dense shards over dp beside expert
    shards over expert-dp, for kept fp32 masters of that shard, and for ZeRO-2's flat gradient pieces beside whole
    weights that read theirs flat."""
    values, grads = initial_values(), gradient_steps(3)
    scaled = [[g * np.float32(0.25) for g in step] for step in grads]
    names = list(SHAPES)
    expected = apply_three_steps(lambda p: AdamW(p, BETAS, EPS, WEIGHT_DECAY), values, scaled, 1.0)
    one = comm.Group((0,), 0)
    groups = {"dp": one, "expert_dp": one, "ep": one}
    owners = tuple(range(len(names)))
    sharded = placed({name: (FLAT_SHARD, "dp") for name in names})
    beside = placed({name: (FLAT_SHARD, "dp" if k % 2 == 0 else "expert_dp") for k, name in enumerate(names)})
    mixed = placed({name: (FLAT_SHARD, "dp") if k < 3 else (WHOLE, None) for k, name in enumerate(names)}, True)

    def over(placements, **state):
        return lambda p: AdamW(p, BETAS, EPS, WEIGHT_DECAY, names, RankState(tuple(placements), groups, owners,
                                                                             bucket_bytes=64, **state))

    makers = {
        "whole": lambda p: AdamW(p, BETAS, EPS, WEIGHT_DECAY),
        "flat shard": over(sharded),
        "dense and expert shards": over(beside),
        "kept masters": over(mixed),
    }
    for kind, make in makers.items():
        for name, want, got in zip(names, expected, apply_three_steps(make, values, grads, 0.25)):
            np.testing.assert_array_equal(got, want, err_msg=f"{kind}: {name}")
    # ZeRO-2's gradients arrive flat: a shard's pieces over dp, and whole expert stacks beside them (expert-dp of one).
    zero2 = placed({name: (FLAT_SHARD, "dp") if k % 2 == 0 else (WHOLE, None) for k, name in enumerate(names)},
                   gradient_sharded=True)
    # (the store cut the shard in one bucket, as `GradientShards` with large buckets: one buffer a weight here)
    one_bucket = {"dp": sum(int(np.prod(SHAPES[name])) for k, name in enumerate(names) if k % 2 == 0)}
    flat = apply_three_steps(over(zero2, shard_chunks=one_bucket), values, grads, 0.25, flat=True)
    for name, want, got in zip(names, expected, flat):
        np.testing.assert_array_equal(got, want, err_msg=f"flat gradients: {name}")


def test_weight_decay_skips_norms_and_biases():
    values = initial_values()
    parameters, optimizer = make_optimizer(values)
    zero_grads = tuple(Tensor(np.zeros(shape, np.float32)) for shape in SHAPES.values())

    optimizer(zero_grads, Tensor(0.5, ms.float32), Tensor(1, ms.int32))

    for parameter, start in zip(parameters, values.values()):
        factor = 1.0 - 0.5 * WEIGHT_DECAY if start.ndim >= 2 else 1.0
        np.testing.assert_allclose(parameter.asnumpy(), start * factor, rtol=1e-6, err_msg=parameter.name)


def test_changing_lr_and_step_reuses_one_compiled_graph(graph_mode):
    _, optimizer = make_optimizer(initial_values())
    grads = ms.mutable(tuple(Tensor(g) for g in gradient_steps(1)[0]))
    for step, lr in enumerate([1e-3, 5e-4, 2e-4], start=1):
        optimizer(grads, Tensor(lr, ms.float32), Tensor(step, ms.int32))
    assert len(optimizer.compile_cache) == 1


def test_moments_round_trip_exactly():
    values = initial_values()
    grads = gradient_steps(3)
    first_parameters, first = make_optimizer(values)
    run_steps("pynative", first, grads[:2], [1e-2, 1e-2])
    state = first.state_dict()
    assert set(state) == {f"adam_{kind}.{name}" for kind in "mv" for name in SHAPES}

    second_parameters, second = make_optimizer({p.name: p.asnumpy() for p in first_parameters})
    second.load_state_dict(state)
    for name, value in second.state_dict().items():
        np.testing.assert_array_equal(value, state[name])

    for optimizer in (first, second):
        optimizer(tuple(Tensor(g) for g in grads[2]), Tensor(1e-2, ms.float32), Tensor(3, ms.int32))
    for resumed, original in zip(second_parameters, first_parameters):
        np.testing.assert_array_equal(resumed.asnumpy(), original.asnumpy())


def test_loading_mismatched_moments_names_the_problem():
    _, optimizer = make_optimizer(initial_values())
    state = optimizer.state_dict()
    state.pop("adam_v.norm.weight")
    with pytest.raises(KeyError, match="adam_v.norm.weight"):
        optimizer.load_state_dict(state)
    state = optimizer.state_dict()
    state["adam_m.norm.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"adam_m.norm.weight: saved shape \(3,\)"):
        optimizer.load_state_dict(state)


def test_from_params_reads_the_optimizer_config():
    parameters, _ = make_optimizer(initial_values())
    optimizer = AdamW.from_params(parameters, OptimizerParams(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0))
    assert (optimizer.beta1, optimizer.beta2, optimizer.eps, optimizer.weight_decay) == (0.8, 0.99, 1e-6, 0.0)


class ClipCell(nn.Cell):
    def construct(self, grads, max_norm):
        return clip_by_global_norm(grads, max_norm)


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_clip_by_global_norm_matches_torch(mode, max_norm, request):
    if mode == "graph":
        request.getfixturevalue("graph_mode")
    grads = gradient_steps(1)[0]
    clipped, norm = ClipCell()(ms.mutable(tuple(Tensor(g) for g in grads)), max_norm)

    torch_grads = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for param, grad in zip(torch_grads, grads):
        param.grad = torch.tensor(grad)
    torch_norm = torch.nn.utils.clip_grad_norm_(torch_grads, max_norm)
    np.testing.assert_allclose(norm.asnumpy(), torch_norm.numpy(), rtol=1e-6)
    for got, want in zip(clipped, torch_grads):
        np.testing.assert_allclose(got.asnumpy(), want.grad.numpy(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------ schedule


def schedule_params(**overrides) -> OptimizerParams:
    return OptimizerParams(**{"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, **overrides})


def test_warmup_is_linear_from_the_first_step_to_the_peak():
    params = schedule_params()
    assert [learning_rate(step, 100, params) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert max(learning_rate(step, 100, params) for step in range(100)) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_is_monotone_and_ends_at_min_lr(schedule):
    params = schedule_params(schedule=schedule)
    rates = [learning_rate(step, 50, params) for step in range(3, 50)]
    assert all(later < earlier for earlier, later in zip(rates, rates[1:]))
    assert rates[-1] == pytest.approx(0.1, abs=1e-12)


def test_cosine_passes_the_midpoint_halfway_through_the_decay():
    params = schedule_params(warmup_steps=0)
    assert learning_rate(50, 101, params) == pytest.approx(0.55)
    assert learning_rate(50, 101, schedule_params(warmup_steps=0, schedule="linear")) == pytest.approx(0.55)
    assert learning_rate(25, 101, params) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))


def test_constant_holds_the_peak_after_warmup():
    params = schedule_params(schedule="constant")
    assert [learning_rate(step, 10, params) for step in range(10)] == [0.25, 0.5, 0.75] + [1.0] * 7


def test_warmup_ratio_is_a_share_of_the_run():
    params = schedule_params(warmup_steps=None, warmup_ratio=0.1)
    assert [learning_rate(step, 100, params) for step in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert learning_rate(10, 100, params) < 1.0
    no_warmup = schedule_params(warmup_steps=None)
    assert learning_rate(0, 100, no_warmup) == 1.0


def test_a_run_shorter_than_its_warmup_only_warms_up():
    params = schedule_params(warmup_steps=10)
    assert [learning_rate(step, 5, params) for step in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert [learning_rate(step, 4, schedule_params()) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_a_single_step_run_trains_at_the_peak():
    assert learning_rate(0, 1, schedule_params(warmup_steps=0)) == 1.0
    assert learning_rate(0, 1, schedule_params(warmup_steps=None, warmup_ratio=0.4)) == 1.0


def test_steps_outside_the_run_are_errors():
    with pytest.raises(ValueError, match="step=10 is outside the run's steps 0..9"):
        learning_rate(10, 10, schedule_params())
    with pytest.raises(ValueError, match="step=-1"):
        learning_rate(-1, 10, schedule_params())


def test_mixed_precision_keeps_fp32_masters_in_the_optimizer_and_resumes_bit_exactly(dataset_dir, tmp_path):
    """float16 compute: the model's matmul weights and its embedding table (whose gradient the step takes by rows)
    are float16, its norms fp32, the optimizer holds the fp32 masters, the checkpoint stores the masters, and a run
    resumed from its step-2 checkpoint repeats its losses and weights."""
    from model_core.model.weights import named_weights
    from model_core.storage import read_weights
    from model_core.train.trainer import Trainer
    from test_trainer import small

    params = small(tmp_path, "train.steps=4", "train.checkpoint_interval=2", "precision.compute_dtype=float16")
    straight = Trainer(params, dataset_dir, tmp_path / "straight")
    dtypes = {name: weight.dtype for name, weight in named_weights(straight.model).items()}
    assert dtypes["layers.0.self_attn.q_proj.weight"] == dtypes["embed_tokens.weight"] == ms.float16
    assert dtypes["norm.weight"] == ms.float32
    expected = straight.run()
    masters = straight.optimizer.master_weights()
    assert masters["layers.0.self_attn.q_proj.weight"].dtype == np.float32
    saved = read_weights(expected.checkpoint)
    for name, master in masters.items():
        np.testing.assert_array_equal(saved[name], master, err_msg=name)
        np.testing.assert_array_equal(named_weights(straight.model)[name].asnumpy(), master.astype(np.float16))

    shutil.copytree(tmp_path / "straight" / "step-00000002", tmp_path / "stopped" / "step-00000002")
    resumed = Trainer(params, dataset_dir, tmp_path / "stopped").run(resume="auto")
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in expected.history[2:]]
    for name, value in read_weights(expected.checkpoint).items():
        np.testing.assert_array_equal(read_weights(resumed.checkpoint)[name], value, err_msg=name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("compute_dtype", ["float32", "float16"])
def test_the_embedding_gradient_taken_by_rows_equals_the_dense_lookup_gradient(tied, compute_dtype, monkeypatch):
    """The step differentiates the looked-up rows and adds them into the table's buffer in place (`rows_table`):
    two micro-batches of accumulated gradients, every buffer, equal those of the dense lookup gradient, tied and
    untied, in fp32 and with float16 matmul weights (and, by rows, a float16 table: its rows are added in fp32)."""
    from test_model import SEQ, VOCAB, random_tokens, tiny_params

    from model_core.model.llama import Llama
    from model_core.optim import step
    from model_core.parallel import parallelize

    def accumulated(by_rows: bool):
        ms.set_seed(0)
        model = Llama(tiny_params(tie_embeddings=tied), compute_dtype)
        if not by_rows:  # a dense lookup's table also stays fp32, as `to_compute_dtype` leaves it
            monkeypatch.setattr(step, "rows_table", lambda model: None)
            monkeypatch.setattr(parallelize, "rows_table", lambda model: None)
        if compute_dtype != "float32":
            parallelize.to_compute_dtype(model, model.compute_dtype)
        accumulate = step.AccumulateGradients(model)
        monkeypatch.undo()
        assert (accumulate.lookup >= 0) == by_rows
        mask = Tensor(np.ones((2, SEQ), np.float32))
        for seed in (1, 2):
            tokens = random_tokens(seed=seed)
            tokens[0, :4] = tokens[0, 4]  # repeated tokens: their rows' gradients add in one row
            losses = accumulate(Tensor(tokens, ms.int32), Tensor(random_tokens(seed=seed + 10) % VOCAB, ms.int32),
                                mask, None, None, Tensor(1.0, ms.float32))
        return float(losses.asnumpy()), [buffer.asnumpy() for buffer in accumulate.buffers]

    (rows_loss, rows), (dense_loss, dense) = accumulated(True), accumulated(False)
    assert rows_loss == dense_loss
    for got, expected in zip(rows, dense):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7 * np.abs(expected).max())


@pytest.mark.parametrize("tied", [True, False])
def test_gradients_are_added_in_the_order_the_backward_makes_them(tied):
    """The head's gradient first (a tied table's too, though the table is the first weight), then the layers' from the
    last to the first: the adds run in program order, and a gradient waiting for its add stays alive."""
    from test_model import tiny_params

    from model_core.model.llama import Llama
    from model_core.optim.step import AccumulateGradients, backward_order

    assert backward_order(4) == (3, 2, 1, 0)
    assert backward_order(4, head=0) == (0, 3, 2, 1)
    accumulate = AccumulateGradients(Llama(tiny_params(tie_embeddings=tied), "float32"))
    names = [accumulate.weights[accumulate.dense[j]].name.removeprefix("loss.model.") for j in accumulate.add_order]
    assert names[:3] == ["embed_tokens.weight" if tied else "lm_head.weight", "norm.weight",
                         "layers.1.mlp.down_proj.weight"]
    assert names[-1] == "layers.0.input_layernorm.weight"
