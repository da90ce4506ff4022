"""LoRA adapters: fresh ones change nothing, only they train, merge/unmerge are exact, files round-trip and
refuse another base, merged checkpoints load and export, and the summary counts what it says."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from model_core.convert import merge_into_checkpoint, ms_to_hf, read_converted
from model_core.model import Llama
from model_core.model.lora import (
    AdapterMismatchError,
    LoraLinear,
    adapter_weights,
    apply_lora,
    base_sha256,
    load_adapters,
    lora_layers,
    merge_lora,
    save_adapters,
    unmerge_lora,
)
from model_core.model.weights import load_weights, model_weights
from model_core.parallel.optimizer import AdamW
from model_core.optim.step import AccumulateGradients, ApplyGradients, scalar
from model_core.storage import read_safetensors, read_weights, write_safetensors
from params.schema import LoraParams, ModelParams

PARAMS = ModelParams(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=176, seq_len=32
)
BATCH = 2


def build(seed: int = 0) -> Llama:
    ms.set_seed(seed)
    return Llama(PARAMS)


def lora_params(targets=("q", "v", "gate"), rank: int = 4, alpha: float = 8.0, dropout: float = 0.0) -> LoraParams:
    return LoraParams(rank=rank, alpha=alpha, dropout=dropout, target_modules=list(targets))


def with_lora(lora: LoraParams, seed: int = 0) -> Llama:
    model = build(seed)
    apply_lora(model, lora)
    return model


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, PARAMS.vocab_size, (BATCH, PARAMS.seq_len + 1)).astype(np.int32)


def logits(model: Llama, seed: int = 0) -> np.ndarray:
    return model(Tensor(tokens(seed)[:, :-1])).asnumpy()


def randomise_b(model: Llama, seed: int = 1) -> None:
    """Give every B a nonzero value, so the adapters change the output."""
    rng = np.random.default_rng(seed)
    for layer in lora_layers(model).values():
        ops.assign(layer.lora_b, Tensor(rng.normal(0, 0.05, layer.lora_b.shape).astype(np.float32)))


def base_weights(model: Llama) -> dict[str, np.ndarray]:
    """Copies of every non-adapter weight (asnumpy can share the parameter's memory)."""
    return {name: value.copy() for name, value in model_weights(model).items() if not name.endswith((".lora_a", ".lora_b"))}


def write_base(directory, model: Llama) -> str:
    """A checkpoint directory holding the model's base weights; returns its sha256."""
    directory.mkdir(parents=True)
    write_safetensors(directory / "model.safetensors", base_weights(model), "float32")
    return base_sha256(directory)


# ------------------------------------------------------------------------------------------- applying


def test_fresh_adapters_leave_logits_unchanged():
    model = build()
    before = logits(model)
    apply_lora(model, lora_params(targets=("q", "k", "v", "o", "gate", "up", "down")))
    np.testing.assert_array_equal(logits(model), before)


def test_base_paths_stay_and_names_equal_paths():
    model = build()
    base_paths = [name for name, _ in model.parameters_and_names()]
    apply_lora(model, lora_params(targets=("q", "down")))
    after = dict(model.parameters_and_names())
    assert [name for name in after if not name.endswith((".lora_a", ".lora_b"))] == base_paths
    assert {name for name in after if name.endswith((".lora_a", ".lora_b"))} == {
        f"layers.{i}.{module}.{part}"
        for i in range(2)
        for module in ("self_attn.q_proj", "mlp.down_proj")
        for part in ("lora_a", "lora_b")
    }
    assert all(param.name == name for name, param in after.items())
    assert isinstance(model.layers[1].mlp.down_proj, LoraLinear) and not isinstance(model.layers[1].mlp.up_proj, LoraLinear)


def test_summary_counts_adapter_elements_by_hand():
    # base: embedding 512x64 (tied head), final norm 64, per layer 2 norms of 64, q/o 64x64, k/v 32x64
    # (2 kv heads x 16), gate/up/down 176x64
    base = 512 * 64 + 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64)
    # rank 4, A [4, in] and B [out, 4]: q 64 -> 64, v 64 -> 32, gate 64 -> 176
    adapters = 2 * ((4 * 64 + 64 * 4) + (4 * 64 + 32 * 4) + (4 * 64 + 176 * 4))
    model = build()
    assert sum(param.size for param in model.get_parameters()) == base == 125_248
    summary = apply_lora(model, lora_params(targets=("q", "v", "gate"), rank=4))
    assert summary.adapted_modules == 6
    assert summary.trainable_parameters == adapters == 3712
    assert summary.total_parameters == base + adapters
    assert summary.trainable_share == pytest.approx(3712 / 128_960)
    assert summary.saved_state_bytes == 12 * base


def test_applying_twice_is_refused():
    model = with_lora(lora_params())
    with pytest.raises(ValueError, match="layers.0.self_attn.q_proj already has LoRA adapters"):
        apply_lora(model, lora_params())


def test_dropout_acts_in_training_mode_only():
    model = with_lora(lora_params(dropout=0.5))
    randomise_b(model)
    model.set_train(True)
    first, second = logits(model), logits(model)
    model.set_train(False)
    evaluated = logits(model)
    assert np.abs(first - second).max() > 1e-4
    np.testing.assert_array_equal(evaluated, logits(model))
    assert np.abs(first - evaluated).max() > 1e-4


# ------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("gate", "up", "down")], ids=["attention", "mlp"])
def test_only_adapters_train_and_the_base_stays_bit_identical(targets):
    model = with_lora(lora_params(targets=targets))
    accumulate = AccumulateGradients(model)
    names = {id(param): name for name, param in model.parameters_and_names()}
    assert sorted(names[id(w)] for w in accumulate.weights) == sorted(adapter_weights(model))
    apply = ApplyGradients(accumulate.buffers, AdamW(accumulate.weights, weight_decay=0.0))
    base_before, adapters_before, logits_before = base_weights(model), adapter_weights(model), logits(model)
    batch = tokens(3)
    for step in range(3):
        accumulate(Tensor(batch[:, :-1]), Tensor(batch[:, 1:]), Tensor(np.ones((BATCH, PARAMS.seq_len), np.float32)),
                   None, None, scalar(1.0 / batch[:, 1:].size))
        apply(scalar(1e-2), scalar(step + 1), scalar(1.0))
    base_after, adapters_after = base_weights(model), adapter_weights(model)
    for name, value in base_before.items():
        np.testing.assert_array_equal(base_after[name], value, err_msg=name)
    assert all(np.abs(adapters_after[name] - value).max() > 1e-4 for name, value in adapters_before.items())
    assert np.abs(logits(model) - logits_before).max() > 1e-4


# -------------------------------------------------------------------------------------------- merging


def test_merge_matches_adapters_and_unmerge_restores_the_exact_base():
    model = with_lora(lora_params(targets=("q", "k", "v", "o", "gate", "up", "down")))
    randomise_b(model)
    base_before, adapters, with_adapters = base_weights(model), adapter_weights(model), logits(model)
    assert np.abs(with_adapters - logits(build())).max() > 1e-3  # the adapters do change the output
    merge_lora(model)
    np.testing.assert_allclose(logits(model), with_adapters, atol=1e-5)
    assert all(np.abs(base_weights(model)[name] - base_before[name]).max() > 0 for name in base_before if "_proj" in name)
    assert all(np.array_equal(adapter_weights(model)[name], value) for name, value in adapters.items())
    with pytest.raises(ValueError, match="already merged"):
        merge_lora(model)
    unmerge_lora(model)
    for name, value in base_weights(model).items():
        np.testing.assert_array_equal(value, base_before[name], err_msg=name)
    np.testing.assert_array_equal(logits(model), with_adapters)


def test_a_graph_compiled_before_merging_counts_the_adapters_once():
    model = with_lora(lora_params())
    randomise_b(model)
    accumulate = AccumulateGradients(model)
    batch = tokens(5)
    inputs = (Tensor(batch[:, :-1]), Tensor(batch[:, 1:]), Tensor(np.ones((BATCH, PARAMS.seq_len), np.float32)), None, None)
    before = float(accumulate(*inputs, scalar(1.0)).asnumpy())
    merge_lora(model)
    assert float(accumulate(*inputs, scalar(1.0)).asnumpy()) == pytest.approx(before, rel=1e-5)


def test_merge_into_checkpoint_equals_base_plus_adapters_and_exports(tmp_path):
    lora = lora_params(targets=("q", "o", "up"))
    model = with_lora(lora)
    randomise_b(model)
    base_hash = write_base(tmp_path / "base", model)
    save_adapters(tmp_path / "adapters", model, lora, base_hash)
    merged_dir = merge_into_checkpoint(tmp_path / "base", tmp_path / "adapters", tmp_path / "merged", PARAMS)

    plain = build(seed=7)
    load_weights(plain, read_weights(merged_dir))
    np.testing.assert_allclose(logits(plain), logits(model), atol=1e-5)
    merge_lora(model)
    for name, value in read_weights(merged_dir).items():
        np.testing.assert_array_equal(value, base_weights(model)[name], err_msg=name)
    weights, params, vocab = read_converted(merged_dir)
    assert params == PARAMS and vocab == PARAMS.vocab_size
    record = json.loads((merged_dir / "conversion.json").read_text())
    assert record["source_hash"] == base_hash and record["adapters"]["target_modules"] == ["q", "o", "up"]
    exported = ms_to_hf(merged_dir, tmp_path / "hf")
    hf = read_safetensors(exported.path / "model.safetensors")
    np.testing.assert_array_equal(hf["model.layers.1.self_attn.o_proj.weight"], weights["layers.1.self_attn.o_proj.weight"])
    with pytest.raises(FileExistsError, match="not empty"):
        merge_into_checkpoint(tmp_path / "base", tmp_path / "adapters", merged_dir, PARAMS)


def test_merge_into_checkpoint_refuses_another_base(tmp_path):
    lora = lora_params()
    model = with_lora(lora)
    base_hash = write_base(tmp_path / "base", model)
    save_adapters(tmp_path / "adapters", model, lora, base_hash)
    other_hash = write_base(tmp_path / "other", build(seed=1))
    with pytest.raises(AdapterMismatchError, match=f"{base_hash}.*{other_hash}"):
        merge_into_checkpoint(tmp_path / "other", tmp_path / "adapters", tmp_path / "merged", PARAMS)
    assert not (tmp_path / "merged").exists()


# ---------------------------------------------------------------------------------------------- files


def test_adapters_round_trip_through_files(tmp_path):
    lora = lora_params(targets=("k", "down"))
    model = with_lora(lora)
    randomise_b(model)
    base_hash = write_base(tmp_path / "base", model)
    saved = save_adapters(tmp_path / "adapters", model, lora, base_hash)
    assert sorted(path.name for path in saved.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["rank"] == 4 and config["alpha"] == 8.0 and config["target_modules"] == ["k", "down"]
    assert config["base_sha256"] == base_hash and config["adapter_parameters"] == sum(v.size for v in adapter_weights(model).values())

    fresh = with_lora(lora, seed=0)
    assert np.abs(logits(fresh) - logits(model)).max() > 1e-4
    load_adapters(fresh, saved, base_hash)
    for name, value in adapter_weights(model).items():
        np.testing.assert_array_equal(adapter_weights(fresh)[name], value, err_msg=name)
    np.testing.assert_array_equal(logits(fresh), logits(model))


def test_loading_refuses_another_base_and_names_both_hashes(tmp_path):
    lora = lora_params()
    model = with_lora(lora)
    save_adapters(tmp_path / "adapters", model, lora, "a" * 64)
    with pytest.raises(AdapterMismatchError, match=f"{'a' * 64}.*{'b' * 64}"):
        load_adapters(with_lora(lora), tmp_path / "adapters", "b" * 64)


@pytest.mark.parametrize(
    "other, message",
    [(dict(targets=("q", "v")), r"target_modules=\['q', 'v', 'gate'\].*target_modules=\['q', 'v'\]"), (dict(rank=8), "rank=4.*rank=8")],
    ids=["targets", "rank"],
)
def test_loading_refuses_other_targets_or_rank(tmp_path, other, message):
    model = with_lora(lora_params())
    save_adapters(tmp_path / "adapters", model, lora_params(), "a" * 64)
    with pytest.raises(AdapterMismatchError, match=message):
        load_adapters(with_lora(lora_params(**other)), tmp_path / "adapters", "a" * 64)


def test_saving_refuses_params_that_do_not_describe_the_model(tmp_path):
    model = with_lora(lora_params(rank=4))
    with pytest.raises(AdapterMismatchError, match="lora.rank=8 but the model's adapters have rank=4"):
        save_adapters(tmp_path / "adapters", model, lora_params(rank=8), "a" * 64)
