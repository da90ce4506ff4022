"""The model-family registry: llama built in, double registration refused with the owner named, isolated
scopes for tests, and conversions dispatched by config.json's model_type."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from model_core.convert import (
    ConversionError,
    ModelFamily,
    RegistryError,
    family_for,
    hf_to_ms,
    hf_to_ms_cached,
    isolated_registry,
    register,
    registered,
    unregister,
)
from model_core.convert.llama import tensor_names, to_hf
from model_core.convert.registry import LLAMA
from model_core.storage import write_safetensors
from params.schema import ModelParams

PARAMS = ModelParams(
    vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=48, seq_len=8
)


def toy_family(model_type: str = "toy-llama", owner: str = "tests.test_registry") -> ModelFamily:
    return replace(LLAMA, model_type=model_type, owner=owner)


def write_hf_dir(directory: Path, model_type: str) -> Path:
    """A Hugging Face-format directory made without torch: random weights through the llama adapter."""
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape).astype(np.float32) for name, (_, shape) in tensor_names(PARAMS).items()}
    state, config = to_hf(weights, PARAMS)
    directory.mkdir()
    write_safetensors(directory / "model.safetensors", state, "float32", {"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return directory


def test_llama_is_registered_by_default():
    assert "llama" in registered() and family_for("llama").owner == "model_core.convert.llama"


def test_registering_a_taken_name_names_the_owner_and_asks_for_another():
    with isolated_registry():
        register(toy_family(owner="plugin_a"))
        with pytest.raises(
            RegistryError,
            match=r"'toy-llama' is already registered by plugin_a; register plugin_b's family under another model_type",
        ):
            register(toy_family(owner="plugin_b"))
        with pytest.raises(RegistryError, match="already registered by model_core.convert.llama"):
            register(toy_family("llama"))
        assert family_for("toy-llama").owner == "plugin_a"


def test_isolated_scope_undoes_registrations_and_removals():
    with isolated_registry():
        register(toy_family())
        unregister("llama")
        assert registered() == ["mixtral", "toy-llama"]
    assert "toy-llama" not in registered() and "llama" in registered()
    with pytest.raises(RegistryError, match="'toy-llama' is not registered"):
        unregister("toy-llama")


def test_conversion_dispatches_on_model_type(tmp_path):
    source = write_hf_dir(tmp_path / "toy", "toy-llama")
    with pytest.raises(
        ConversionError, match=r"model_type='toy-llama' has no registered adapter \(registered: \['llama', 'mixtral'\]\)"
    ):
        hf_to_ms(source, tmp_path / "out")
    with isolated_registry():
        register(toy_family())
        converted = hf_to_ms(source, tmp_path / "out")
    assert converted.params == PARAMS
    assert json.loads((converted.path / "conversion.json").read_text())["model_type"] == "toy-llama"


def test_cache_directories_are_per_call(tmp_path):
    source = write_hf_dir(tmp_path / "hf", "llama")
    first, second = hf_to_ms_cached(source, tmp_path / "run-a"), hf_to_ms_cached(source, tmp_path / "run-b")
    assert first.path.parent == tmp_path / "run-a" and second.path.parent == tmp_path / "run-b"
    assert not first.reused and not second.reused
