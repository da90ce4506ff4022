"""Mixture-of-experts blocks: the routed block against a per-token reference (dropless and capacity-bound, with
exactly the documented drops), the load-balancing loss, training with routing metrics, the layouts refused
for now, and Mixtral conversion against `transformers`."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Tensor, nn, ops
from pydantic import ValidationError

from model_core.eval.evaluate import load_model
from model_core.model.llama import Llama, SwiGLU
from model_core.model.moe import MoE, router_noise
from model_core.parallel.layout import Layout
from model_core.train.trainer import Trainer
from params import ParamsError, load_params
from params.schema import ModelParams

MOE = ["model.moe={num_experts: 4, experts_per_token: 2, every: 2}"]


def moe_params(**moe) -> ModelParams:
    return ModelParams(
        vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=24, seq_len=8,
        moe={"num_experts": 4, "experts_per_token": 2, **moe},
    )


def reference(block: MoE, x: np.ndarray, params: ModelParams, noise: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The block's output computed token by token in float64, and the number of choices it drops, by the rule
    MoEParams documents: first choices before second ones, token order within each. `noise`: router jitter
    factors the router's input (only) is multiplied by."""
    moe = params.moe
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    router = block.router.weight.asnumpy().astype(np.float64)
    gate, up, down = (getattr(block.experts, name).asnumpy().astype(np.float64) for name in ("gate_proj", "up_proj", "down_proj"))
    logits = (flat if noise is None else flat * noise.reshape(flat.shape)) @ router.T
    if moe.gating == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    chosen = np.argsort(-scores, axis=-1, kind="stable")[:, : moe.experts_per_token]
    weights = np.take_along_axis(scores, chosen, -1)
    if moe.normalize_top_k:
        weights /= weights.sum(-1, keepdims=True)
    if moe.shared_expert_ffn_hidden_size is not None:
        weights_of = {n: getattr(block.shared_expert, n).weight.asnumpy().astype(np.float64) for n in ("gate_proj", "up_proj", "down_proj")}
        hidden = flat @ weights_of["gate_proj"].T
        shared = (hidden / (1 + np.exp(-hidden)) * (flat @ weights_of["up_proj"].T)) @ weights_of["down_proj"].T
        if moe.shared_expert_gate:
            shared *= 1 / (1 + np.exp(-(flat @ block.shared_expert_gate.weight.asnumpy().astype(np.float64).T)))
    slots = params.moe.capacity(len(flat))
    taken = np.zeros(moe.num_experts, int)
    out = shared if moe.shared_expert_ffn_hidden_size is not None else np.zeros_like(flat)
    dropped = 0
    for rank in range(moe.experts_per_token):
        for token in range(len(flat)):
            expert = chosen[token, rank]
            if taken[expert] == slots:
                dropped += 1
                continue
            taken[expert] += 1
            hidden = flat[token] @ gate[expert].T
            hidden = hidden / (1 + np.exp(-hidden)) * (flat[token] @ up[expert].T)
            out[token] += weights[token, rank] * (hidden @ down[expert].T)
    return out.reshape(x.shape), dropped


@pytest.mark.parametrize(
    ("capacity_factor", "shared"), [(None, {}), (0.5, {}), (None, {"shared_expert_ffn_hidden_size": 20}),
                                    (0.5, {"shared_expert_ffn_hidden_size": 20, "shared_expert_gate": True}),
                                    (None, {"gating": "sigmoid"}), (0.5, {"gating": "sigmoid", "normalize_top_k": False})],
    ids=["dropless", "capacity", "dropless-shared", "capacity-gated-shared", "sigmoid", "capacity-sigmoid-unnormalised"],
)
def test_the_routed_block_equals_a_per_token_reference_and_drops_what_the_rule_says(capacity_factor, shared):
    params = moe_params(capacity_factor=capacity_factor, **shared)
    ms.set_seed(3)
    block = MoE(params, output_std=0.02, dense=SwiGLU)
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    out, (aux, z, load, dropped) = block(Tensor(x))
    expected, expected_dropped = reference(block, x, params)
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-7)
    assert float(dropped.asnumpy()) == expected_dropped
    assert load.asnumpy().sum() == 2 * 16  # every choice counted, dropped or not
    if capacity_factor is None:
        assert expected_dropped == 0
    else:
        assert params.moe.capacity(16) == math.ceil(0.5 * 16 * 2 / 4) == 4 and expected_dropped > 0


class DerivedDispatch(nn.Cell):
    """`Dispatch` with MindSpore's derived backward (a scatter of the slot gradients)."""

    def construct(self, flat, filler, slot, kept):
        return ops.gather(flat, filler, 0)


class DerivedCombine(nn.Cell):
    """`Combine` with MindSpore's derived backward."""

    def __init__(self, top_k: int):
        super().__init__()
        self.top_k = top_k

    def construct(self, done, slot, gate, filler, slot_gate):
        return (ops.gather(done, slot, 0) * gate.reshape(-1, 1)).reshape(self.top_k, -1, done.shape[-1]).sum(0)


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_the_hand_written_dispatch_and_combine_backwards_equal_the_derived_ones(capacity_factor):
    params = moe_params(capacity_factor=capacity_factor)
    ms.set_seed(3)
    block = MoE(params, output_std=0.02, dense=SwiGLU)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32))
    upstream = Tensor(np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32))

    def objective(x):
        out, (aux, _, _, dropped) = block(x)
        return (out * upstream).sum() + 0.1 * aux, dropped

    def gradients():
        (_, dropped), grads = ms.value_and_grad(objective, 0, block.trainable_params(), has_aux=True)(x)
        return float(dropped.asnumpy()), [grads[0].asnumpy()] + [g.asnumpy() for g in grads[1]]

    dropped, ours = gradients()
    block.dispatch, block.combine = DerivedDispatch(), DerivedCombine(params.moe.experts_per_token)
    assert gradients()[0] == dropped and (dropped > 0) == (capacity_factor is not None)
    for mine, derived in zip(ours, gradients()[1], strict=True):
        np.testing.assert_allclose(mine, derived, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("gating", "least_skewed_aux"), [("softmax", 3.9), ("sigmoid", 1.5)])
def test_a_router_sending_every_token_to_one_expert_pays_more_balancing_loss_than_a_uniform_one(gating, least_skewed_aux):
    # Sigmoid scores of the forced router are 1 for expert 2 and 0.5 for the others: its share is 1 / 2.5.
    params = moe_params(experts_per_token=1, gating=gating)
    values = np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)
    values[..., 0] = 1.0
    x = Tensor(values)
    block = MoE(params, output_std=0.02)
    block.router.weight.set_data(Tensor(np.zeros((4, 16), np.float32)))
    _, (uniform, uniform_z, _, _) = block(x)
    forced = np.zeros((4, 16), np.float32)
    forced[2, 0] = 100.0  # every token's logit for expert 2 is 100, the others 0
    block.router.weight.set_data(Tensor(forced))
    _, (skewed, skewed_z, load, _) = block(x)
    assert load.asnumpy().tolist() == [0, 0, 16, 0]
    assert float(uniform.asnumpy()) == pytest.approx(1.0, abs=1e-6) and float(skewed.asnumpy()) > least_skewed_aux
    assert float(uniform_z.asnumpy()) == pytest.approx(math.log(4) ** 2, rel=1e-5)
    assert float(skewed_z.asnumpy()) > float(uniform_z.asnumpy())


@pytest.mark.parametrize("eps", [-0.1, 1.0])
def test_router_jitter_outside_zero_to_one_is_refused_naming_the_field(eps):
    with pytest.raises(ValidationError, match=rf"model.moe.router_jitter={eps} must be at least 0 and below 1"):
        moe_params(router_jitter=eps)


def test_router_noise_is_keyed_by_seed_step_and_row_and_jitters_only_the_routers_input():
    noise = router_noise(0.5, 7, 3, range(4), 2, 8, 16)  # 2 MoE blocks, 4 rows of 8 tokens, hidden 16
    assert noise.shape == (2, 4, 8, 16) and noise.dtype == np.float32
    assert 0.5 <= noise.min() < 0.6 and 1.4 < noise.max() <= 1.5
    np.testing.assert_array_equal(router_noise(0.5, 7, 3, range(4), 2, 8, 16), noise)
    np.testing.assert_array_equal(router_noise(0.5, 7, 3, range(2, 4), 2, 8, 16), noise[:, 2:])  # by row, not batch
    for other in (router_noise(0.5, 8, 3, range(4), 2, 8, 16), router_noise(0.5, 7, 4, range(4), 2, 8, 16)):
        assert not np.any(other == noise)  # another seed or step: other draws everywhere
    params = moe_params()
    ms.set_seed(3)
    block = MoE(params, output_std=0.02)
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    plain, (plain_aux, _, _, _) = block(Tensor(x))
    jittered, (jittered_aux, _, _, _) = block(Tensor(x), Tensor(noise[0, :2]))
    np.testing.assert_allclose(jittered.asnumpy(), reference(block, x, params, noise[0, :2])[0], rtol=1e-5, atol=1e-7)
    assert not np.allclose(jittered.asnumpy(), plain.asnumpy(), atol=1e-4)
    assert float(jittered_aux.asnumpy()) != float(plain_aux.asnumpy())
    np.testing.assert_array_equal(block(Tensor(x), Tensor(np.ones((2, 8, 16), np.float32)))[0].asnumpy(), plain.asnumpy())


# Four steps of the MoE model, checkpointed after step 2: the plain run and its router-jittered variant.
SHORT_RUN = [*SMALL_MODEL, *MOE, "train.steps=4", "train.log_interval=1", "train.eval_interval=1000",
             "train.checkpoint_interval=2", "optimizer.warmup_steps=2"]
JITTER = "model.moe={num_experts: 4, experts_per_token: 2, every: 2, router_jitter: 0.3}"


@pytest.fixture(scope="module")
def plain_history(dataset_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-plain")
    return Trainer(load_params("tiny", [*SHORT_RUN, f"train.output_dir={out}"]), dataset_dir, out / "ckpt").run().history


@pytest.mark.extended  # ~40 s; the noise's keying by seed, step and row is checked by the test above, in-process
def test_router_jitter_changes_training_repeats_with_its_seed_and_resumes_bit_exactly(dataset_dir, plain_history, tmp_path):
    """A run stopped after its step-2 checkpoint and resumed repeats the uninterrupted run to the bit: the noise is
    keyed by the step, not drawn from a generator's state. Evaluation passes no noise (`Llama.construct` has none)."""
    def trainer(name: str) -> Trainer:
        params = load_params("tiny", [*SHORT_RUN, JITTER, f"train.output_dir={tmp_path / name}"])
        return Trainer(params, dataset_dir, tmp_path / name / "ckpt")

    uninterrupted = trainer("jitter").run().history

    def stop_after_step_3(record):
        stopped.append(record)
        if record["step"] == 3:
            raise KeyboardInterrupt

    stopped = []
    with pytest.raises(KeyboardInterrupt):
        trainer("again").run(on_metrics=stop_after_step_3)
    resumed = trainer("again").run(resume="auto")
    assert resumed.resumed_from.name == "step-00000002"
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_load_cv_layer1")
    assert [[r.get(k) for k in keys] for r in stopped] == [[r.get(k) for k in keys] for r in uninterrupted[:3]]
    assert [[r.get(k) for k in keys] for r in resumed.history] == [[r.get(k) for k in keys] for r in uninterrupted[2:]]
    assert all(r["loss"] != p["loss"] and r["moe_aux_loss"] != p["moe_aux_loss"] for r, p in zip(uninterrupted, plain_history))


def test_dense_and_moe_blocks_mix_and_the_compiled_forward_equals_the_eager_one():
    params = ModelParams(**{**moe_params().model_dump(), "num_layers": 4, "moe": {"num_experts": 4, "every": 2}})
    assert params.moe_layers == (1, 3)
    model = Llama(params)
    assert [block.is_moe for block in model.layers] == [False, True, False, True]
    tokens = Tensor(np.random.default_rng(2).integers(0, 64, (2, 8)), ms.int32)
    logits, (aux, z, loads, dropped) = model.routed(tokens)
    assert loads.shape == (2, 4) and float(dropped.asnumpy()) == 0
    np.testing.assert_allclose(model.compiled_forward(tokens).asnumpy(), logits.asnumpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("moe", [MOE, ["model.moe={num_experts: 4, every: 2, shared_expert_ffn_hidden_size: 64, shared_expert_gate: true}"]],
                         ids=["routed", "with-gated-shared-expert"])
def test_an_moe_model_trains_and_reports_its_routing(dataset_dir, tmp_path, moe):
    params = load_params("tiny", [
        *SMALL_MODEL, *moe, "train.steps=30", "train.log_interval=1", "train.eval_interval=1000",
        "optimizer.warmup_steps=2", "optimizer.lr=3e-3", "parallel.micro_batches=2", f"train.output_dir={tmp_path}",
    ])
    records = []
    trainer = Trainer(params, dataset_dir, tmp_path / "ckpt")
    result = trainer.run(on_metrics=records.append)
    assert result.final_loss < result.initial_loss - 1.0
    last = records[-1]
    assert 0.99 < last["moe_aux_loss"] < 2.0 and last["moe_z_loss"] > 0 and last["moe_dropped_fraction"] == 0
    assert {"moe_load_min_layer1", "moe_load_max_layer1", "moe_load_cv_layer1"} <= last.keys()
    choices = 2 * last["tokens_seen"] / last["step"]  # two per token of a step, dropped or not
    assert last["moe_load_min_layer1"] <= choices / 4 <= last["moe_load_max_layer1"] < choices
    # The checkpoint loads back as the model the evaluate stage scores, checked against the run's params.
    loaded = load_model(result.checkpoint, model=params.model)
    tokens = Tensor(np.random.default_rng(4).integers(0, 512, (2, 32)), ms.int32)
    np.testing.assert_allclose(loaded(tokens).asnumpy(), trainer.model(tokens).asnumpy(), rtol=1e-5, atol=1e-5)


def test_layouts_that_do_not_carry_experts_yet_are_refused_with_the_setting_named():
    with pytest.raises(ParamsError, match=r"parallel.zero_stage=3 with model.moe \(1 MoE blocks\)"):
        load_params("tiny", [*SMALL_MODEL, *MOE, "parallel.zero_stage=3", "parallel.data_parallel=2"])
    pipelined = ["parallel.pipeline_parallel=2", "parallel.micro_batches=2"]
    assert Layout.from_params(load_params("tiny", [*SMALL_MODEL, *MOE, *pipelined])).pp == 2
    expert_zero2 = ["parallel.data_parallel=2", "parallel.expert_parallel=2", "parallel.zero_stage=2"]
    assert Layout.from_params(load_params("tiny", [*SMALL_MODEL, *MOE, *expert_zero2])).ep == 2
    four = ["parallel.pipeline_parallel=2", "parallel.micro_batches=2"]
    layout = Layout.from_params(load_params("tiny", [*SMALL_MODEL, *MOE, *expert_zero2, *four]))
    assert (layout.dp, layout.pp, layout.ep) == (2, 2, 2)


# ------------------------------------------------------------------------------------- Mixtral conversion

VOCAB, SEQ = 256, 16
TOKENS = np.random.default_rng(7).integers(0, VOCAB, (2, SEQ)).astype(np.int32)


def hf_mixtral(tie: bool = False, seed: int = 0):
    """A small random MixtralForCausalLM (4 experts, top 2, GQA); norms randomised to take part too."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, rope_theta=500.0, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=tie, sliding_window=None,
    )
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    return model


def hf_logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_converted_mixtral_matches_transformers_logits_and_round_trips_bit_for_bit(tmp_path, tie):
    from model_core.convert import hf_to_ms, ms_to_hf, read_converted
    from model_core.model.weights import load_weights

    transformers = pytest.importorskip("transformers")
    model = hf_mixtral(tie)
    model.save_pretrained(tmp_path / "hf")
    saved = set(load_file_names(tmp_path / "hf"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved  # the per-expert layout on disk
    converted = hf_to_ms(tmp_path / "hf", tmp_path / "ours")
    weights, params, vocab_size = read_converted(converted.path)
    assert params.moe_layers == (0, 1) and params.moe.num_experts == 4 and params.moe.experts_per_token == 2
    assert weights["layers.1.mlp.experts.down_proj"].shape == (4, 64, 96)
    ours = Llama(params)
    load_weights(ours, weights)
    difference = np.abs(ours(Tensor(TOKENS)).asnumpy() - hf_logits(model)).max()
    print(f"max |logit difference| against transformers' Mixtral ({'tied' if tie else 'untied'}, fp32): {difference:.2e}")
    assert difference <= 1e-4

    exported = ms_to_hf(converted.path, tmp_path / "back")
    reloaded = transformers.MixtralForCausalLM.from_pretrained(exported.path).eval()
    np.testing.assert_array_equal(hf_logits(reloaded), hf_logits(model))
    original, again = model.state_dict(), reloaded.state_dict()
    assert original.keys() == again.keys()
    assert all(np.array_equal(original[name].numpy(), again[name].numpy()) for name in original)


def load_file_names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "np") as handle:
        return list(handle.keys())


def test_a_model_with_dense_blocks_has_no_mixtral_form_and_says_why():
    from model_core.convert import ConversionError
    from model_core.convert.mixtral import to_hf

    params = ModelParams(**{**moe_params().model_dump(), "num_layers": 4, "moe": {"num_experts": 4, "every": 2}})
    ms.set_seed(0)
    weights = {name: param.asnumpy() for name, param in Llama(params).parameters_and_names()}
    with pytest.raises(ConversionError, match=r"every layer; model.moe gives them in blocks \[1, 3\] of model.num_layers=4"):
        to_hf(weights, params)
    sigmoid = ModelParams(**{**moe_params().model_dump(), "moe": {"num_experts": 4, "gating": "sigmoid"}})
    with pytest.raises(ConversionError, match="softmax over the experts; model.moe.gating=sigmoid"):
        to_hf(weights, sigmoid)


# ------------------------------------------------------------------------------------------- layouts


@pytest.mark.slow
# -m extended: dp2 x ep2 with ZeRO-1 (tests/test_expert_parallel_msrun.py) routes each rank's rows and sums the
# experts' gradients over dp by default.
@pytest.mark.extended
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_dp2_trains_an_moe_model_equal_to_one_process(dataset_dir, tmp_path, zero):
    """Each rank routes its own micro-batches, the same rows one process routes in its micro-batches, so the
    routing losses, their gradients and the routing metrics summed over dp repeat the single process."""
    from test_parallel_msrun import SHORT, assert_same_metrics, one_process, train_job

    # A capacity bound that drops some choices, on both sides alike.
    moe = ["model.moe={num_experts: 4, experts_per_token: 2, every: 2, capacity_factor: 1.5}", SHORT]
    expected = one_process(dataset_dir, tmp_path / "one", *moe)
    ranks = train_job(
        tmp_path / "dp2", dataset_dir, *moe, "parallel.data_parallel=2", "parallel.micro_batches=2", f"parallel.zero_stage={zero}"
    )
    assert_same_metrics(ranks[0]["history"], expected)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_cv_layer1"):
        np.testing.assert_allclose([r[key] for r in ranks[0]["history"]], [r[key] for r in expected], rtol=1e-5, err_msg=key)
    assert max(r["moe_dropped_fraction"] for r in expected) > 0


def test_mfu_counts_a_mixtral_8x7b_shaped_models_active_parameters():
    """Mixtral 8x7B: 46.7B parameters, 12.9B of them active per token (2 of 8 experts, the router, attention,
    norms, embedding and head)."""
    from model_core.train.flops import non_embedding_parameters

    mixtral = ModelParams(
        vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
        seq_len=4096, tie_embeddings=False, moe={"num_experts": 8, "experts_per_token": 2},
    )
    active = non_embedding_parameters(mixtral)
    assert active == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 4096 + 2 * 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert round((active + 2 * 32000 * 4096) / 1e9, 1) == 12.9


def test_the_planner_counts_experts_and_offers_every_layout_moe_trains_with():
    from model_core.parallel.planner import parse_bytes, plan, stage_parameters

    params = load_params("tiny_moe")
    dense = load_params("tiny")
    experts = 2 * (4 * 128 + 3 * 4 * 352 * 128 - 3 * 352 * 128)  # two MoE blocks: router + 4 experts, not 1 MLP
    assert stage_parameters(params.model, 1, 1, 0) - stage_parameters(dense.model, 1, 1, 0) == experts
    result = plan(params, devices=2, device_memory_bytes=parse_bytes("8GiB"))
    layouts = {(c.dp, c.tp, c.pp, c.ep, c.zero_stage) for c in (e.candidate for e in result.estimates)}
    assert layouts == {
        (2, 1, 1, 1, 0), (2, 1, 1, 1, 1), (2, 1, 1, 1, 2), (2, 1, 1, 2, 0), (2, 1, 1, 2, 1), (2, 1, 1, 2, 2), (1, 2, 1, 1, 0)
    }
    pipelined = plan(load_params("tiny_moe", ["parallel.micro_batches=2"]), devices=2, device_memory_bytes=parse_bytes("8GiB"))
    assert (1, 1, 2, 1, 0) in {(c.dp, c.tp, c.pp, c.ep, c.zero_stage) for c in (e.candidate for e in pipelined.estimates)}
    four = plan(load_params("tiny_moe", ["parallel.micro_batches=2"]), devices=4, device_memory_bytes=parse_bytes("8GiB"))
    assert (2, 1, 2, 2, 2) in {(c.dp, c.tp, c.pp, c.ep, c.zero_stage) for c in (e.candidate for e in four.estimates)}


def test_recomputing_moe_blocks_changes_nothing(dataset_dir, plain_history, tmp_path):
    params = load_params("tiny", [*SHORT_RUN, "recompute.mode=all", f"train.output_dir={tmp_path}"])
    recomputed = Trainer(params, dataset_dir, tmp_path / "ckpt").run().history
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_load_cv_layer1"):
        np.testing.assert_allclose([r[key] for r in recomputed], [r[key] for r in plain_history], rtol=1e-6, err_msg=key)
