"""Mixture-of-experts blocks: the routed block against a per-token reference (dropless and capacity-bound, with
exactly the documented drops), the load-balancing loss, training with routing metrics, the layouts refused
for now, and Mixtral conversion against `transformers`."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Tensor

from model_core.data import prepare_dataset
from model_core.model.llama import Llama
from model_core.model.moe import MoE, capacity
from model_core.parallel.layout import Layout, ParallelConfigError
from model_core.train.trainer import Trainer
from params import load_params
from params.schema import ModelParams

MOE = ["model.moe={num_experts: 4, experts_per_token: 2, every: 2}"]


def moe_params(**moe) -> ModelParams:
    return ModelParams(
        vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=24, seq_len=8,
        moe={"num_experts": 4, "experts_per_token": 2, **moe},
    )


def reference(block: MoE, x: np.ndarray, params: ModelParams) -> tuple[np.ndarray, int]:
    """The block's output computed token by token in float64, and the number of choices it drops, by the rule
    MoEParams documents: first choices before second ones, token order within each."""
    moe = params.moe
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    router = block.router.weight.asnumpy().astype(np.float64)
    gate, up, down = (getattr(block.experts, name).asnumpy().astype(np.float64) for name in ("gate_proj", "up_proj", "down_proj"))
    logits = flat @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : moe.experts_per_token]
    weights = np.take_along_axis(probs, chosen, -1)
    if moe.normalize_top_k:
        weights /= weights.sum(-1, keepdims=True)
    slots = capacity(params, len(flat))
    taken = np.zeros(moe.num_experts, int)
    out, dropped = np.zeros_like(flat), 0
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


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_the_routed_block_equals_a_per_token_reference_and_drops_what_the_rule_says(capacity_factor):
    params = moe_params(capacity_factor=capacity_factor)
    ms.set_seed(3)
    block = MoE(params, output_std=0.02)
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    out, (aux, z, load, dropped) = block(Tensor(x))
    expected, expected_dropped = reference(block, x, params)
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-7)
    assert float(dropped.asnumpy()) == expected_dropped
    assert load.asnumpy().sum() == 2 * 16  # every choice counted, dropped or not
    if capacity_factor is None:
        assert expected_dropped == 0
    else:
        assert capacity(params, 16) == math.ceil(0.5 * 16 * 2 / 4) == 4 and expected_dropped > 0


def test_a_router_sending_every_token_to_one_expert_pays_more_balancing_loss_than_a_uniform_one():
    params = moe_params(experts_per_token=1)
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
    assert float(uniform.asnumpy()) == pytest.approx(1.0, abs=1e-6) and float(skewed.asnumpy()) > 3.9
    assert float(uniform_z.asnumpy()) == pytest.approx(math.log(4) ** 2, rel=1e-5)
    assert float(skewed_z.asnumpy()) > float(uniform_z.asnumpy())


def test_dense_and_moe_blocks_mix_and_the_compiled_forward_equals_the_eager_one():
    params = ModelParams(**{**moe_params().model_dump(), "num_layers": 4, "moe": {"num_experts": 4, "every": 2}})
    assert params.moe_layers == (1, 3)
    model = Llama(params)
    assert [block.is_moe for block in model.layers] == [False, True, False, True]
    tokens = Tensor(np.random.default_rng(2).integers(0, 64, (2, 8)), ms.int32)
    logits, (aux, z, loads, dropped) = model.routed(tokens)
    assert loads.shape == (2, 4) and float(dropped.asnumpy()) == 0
    np.testing.assert_allclose(model.compiled_forward(tokens).asnumpy(), logits.asnumpy(), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def dataset_dir(corpus_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-data")
    params = load_params("tiny", [f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={out}", *SMALL_MODEL])
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


def test_an_moe_model_trains_and_reports_its_routing(dataset_dir, tmp_path):
    params = load_params("tiny", [
        *SMALL_MODEL, *MOE, "train.steps=30", "train.log_interval=1", "train.eval_interval=1000",
        "optimizer.warmup_steps=2", "optimizer.lr=3e-3", "parallel.micro_batches=2", f"train.output_dir={tmp_path}",
    ])
    records = []
    result = Trainer(params, dataset_dir, tmp_path / "ckpt").run(on_metrics=records.append)
    assert result.final_loss < result.initial_loss - 1.0
    last = records[-1]
    assert 0.99 < last["moe_aux_loss"] < 2.0 and last["moe_z_loss"] > 0 and last["moe_dropped_fraction"] == 0
    assert {"moe_load_min_layer1", "moe_load_max_layer1", "moe_load_cv_layer1"} <= last.keys()
    choices = 2 * last["tokens_seen"] / last["step"]  # two per token of a step, dropped or not
    assert last["moe_load_min_layer1"] <= choices / 4 <= last["moe_load_max_layer1"] < choices


@pytest.mark.parametrize(
    ("setting", "value"),
    [("parallel.tensor_parallel", 2), ("parallel.pipeline_parallel", 2), ("parallel.zero_stage", 2)],
)
def test_layouts_that_do_not_carry_routing_yet_are_refused_with_the_setting_named(setting, value):
    extra = ["parallel.micro_batches=2"] if setting == "parallel.pipeline_parallel" else []
    dp = ["parallel.data_parallel=2"] if setting == "parallel.zero_stage" else []
    params = load_params("tiny", [*SMALL_MODEL, *MOE, f"{setting}={value}", *extra, *dp])
    with pytest.raises(ParallelConfigError, match=rf"{setting}={value} with model.moe \(1 MoE blocks\)"):
        Layout.from_params(params)
