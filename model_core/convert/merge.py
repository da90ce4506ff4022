"""LoRA adapters merged into their base checkpoint on disk: a new converted checkpoint that export, evaluation
and training read like any other, whose record names the base and the adapters it came from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from model_core.convert.checkpoint import FORMAT_VERSION, PARAMS, RECORD
from model_core.model.lora import (
    ADAPTERS,
    TARGETS,
    AdapterMismatchError,
    base_sha256,
    check_adapter_names,
    merged_weight,
    read_adapters,
)
from model_core.storage import WEIGHTS, build_directory, file_sha256, read_weights, write_safetensors
from params.schema import ModelParams


def merge_into_checkpoint(
    base_dir: str | Path, adapters_dir: str | Path, output_dir: str | Path, model_params: ModelParams
) -> Path:
    """Write base + adapters, merged in fp32, to the new directory `output_dir` and return it.

    The output is a converted checkpoint (model.safetensors, params.json, conversion.json, see
    model_core.convert.checkpoint), so `ms_to_hf`, `read_converted` and a trainer's `initial_weights` take it.
    Its record names the base and the adapters (with their sha256). Refuses adapters made for another base.
    """
    base_dir, adapters_dir, output = Path(base_dir), Path(adapters_dir), Path(output_dir)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"{output} exists and is not empty; choose a new directory for the merged model")
    base_hash = base_sha256(base_dir)
    adapters, config = read_adapters(adapters_dir, base_hash)
    weights = read_weights(base_dir)
    _check_base_fits(weights, model_params, base_dir)
    scale = config["alpha"] / config["rank"]
    paths = [f"layers.{i}.{TARGETS[t]}" for i in range(model_params.num_layers) for t in config["target_modules"]]
    check_adapter_names(adapters, {f"{path}.{name}" for path in paths for name in ("lora_a", "lora_b")}, adapters_dir / ADAPTERS)
    merged = dict(weights)
    for path in paths:
        lora_a, lora_b, weight = adapters[f"{path}.lora_a"], adapters[f"{path}.lora_b"], weights.get(f"{path}.weight")
        if weight is None or lora_b.shape[0] != weight.shape[0] or lora_a.shape[1] != weight.shape[1]:
            found = None if weight is None else weight.shape
            raise AdapterMismatchError(f"{path}: adapters B {lora_b.shape} A {lora_a.shape} do not fit the base weight {found}")
        merged[f"{path}.weight"] = merged_weight(weight, lora_a, lora_b, scale)
    record = _merged_record(base_dir, base_hash, adapters_dir, config, model_params)

    def write(building: Path) -> None:
        write_safetensors(building / WEIGHTS, merged, "float32", {"producer": "llmflow lora merge"})
        (building / PARAMS).write_text(json.dumps(model_params.model_dump(mode="json"), indent=2) + "\n")
        record["sha256"] = {name: file_sha256(building / name) for name in (WEIGHTS, PARAMS)}
        (building / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    build_directory(output, write, replace=False)
    return output


def _check_base_fits(weights: dict[str, np.ndarray], params: ModelParams, base_dir: Path) -> None:
    embedding = weights.get("embed_tokens.weight")
    expected = (params.vocab_size, params.hidden_size)
    if embedding is None or embedding.shape != expected:
        found = None if embedding is None else embedding.shape
        raise AdapterMismatchError(f"{base_dir}: embed_tokens.weight is {found}, model params say {expected}")


def _merged_record(base_dir: Path, base_hash: str, adapters_dir: Path, config: dict, params: ModelParams) -> dict:
    """conversion.json of a merged checkpoint: the base's real vocabulary and family, plus where it came from."""
    base_record_path = base_dir / RECORD
    base_record = json.loads(base_record_path.read_text()) if base_record_path.is_file() else {}
    key = hashlib.sha256(f"{base_hash}:{config['sha256']}".encode()).hexdigest()
    return {
        "format_version": FORMAT_VERSION,
        "key": key,
        "model_type": base_record.get("model_type", "llama"),
        "source": str(base_dir.resolve()),
        "source_hash": base_hash,
        "adapters": {"path": str(adapters_dir.resolve()), **{k: config[k] for k in ("sha256", "rank", "alpha", "target_modules")}},
        "dtype": "float32",
        "tensor_parallel": base_record.get("tensor_parallel", 1),
        "vocab_size": base_record.get("vocab_size", params.vocab_size),
        "padded_vocab_size": params.vocab_size,
    }
