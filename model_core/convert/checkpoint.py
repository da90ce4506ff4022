"""Converted checkpoints on disk: read a Hugging Face model directory, write ours (cached by content),
and export ours back to a directory that `transformers` loads.

A converted checkpoint is a directory holding `model.safetensors` (weights by our parameter names, the
file format of training checkpoints), `params.json` (the derived ModelParams) and `conversion.json`
(source files and their sha256, dtype, real vocab size, the conversion key, and the sha256 of the other
two files). It is built in a temporary sibling and renamed into place; everything is read and checked
before anything is written, so a failed conversion leaves nothing behind. A directory whose
conversion.json names the same key and whose files match their sha256 is reused, not rebuilt.

Sources: `config.json` plus `model.safetensors`, a sharded `model.safetensors.index.json`,
`pytorch_model.bin` or a sharded `pytorch_model.bin.index.json` (read by a restricted unpickler that runs
no code from the file, see torch_pickle.py). All tensors are held in memory as fp32 while converting.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from model_core.convert.errors import ConversionError
from model_core.convert.registry import family_for
from model_core.convert.tokenizer_check import check_vocab
from model_core.convert.torch_pickle import load_torch_state_dict
from model_core.storage import (
    DTYPES,
    WEIGHTS,
    StorageError,
    build_directory,
    file_sha256,
    read_safetensors,
    read_weights,
    write_safetensors,
)
from model_core.train import checkpoint as training_checkpoint
from params.schema import ConvertParams, ModelParams

PARAMS, RECORD = "params.json", "conversion.json"
HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
FORMAT_VERSION = 1  # bump when the same source would convert to different bytes


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face model directory: its config and the files that define its content."""

    directory: Path
    config: dict
    weight_file: Path  # one of HF_WEIGHT_FILES
    files: tuple[Path, ...]  # config.json, the index if sharded, every weight file


@dataclass(frozen=True)
class _Plan:
    """One conversion to do: the source, its file hashes, the options, and the key they hash to."""

    source: HFSource
    file_hashes: dict[str, str]
    source_hash: str
    key: str
    dtype: str
    tensor_parallel: int
    seq_len: int | None


@dataclass(frozen=True)
class ConvertedCheckpoint:
    path: Path
    params: ModelParams  # vocab_size padded to a multiple of tensor_parallel
    vocab_size: int  # the real vocabulary, before padding
    source_hash: str  # sha256 over the source files' names and contents
    reused: bool

    @property
    def params_path(self) -> Path:
        return self.path / PARAMS

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS

    @property
    def record_path(self) -> Path:
        return self.path / RECORD


@dataclass(frozen=True)
class ExportedModel:
    path: Path
    config: dict
    vocab_size: int


# ------------------------------------------------------------------------------------ Hugging Face in


def locate_hf(src: str | Path) -> HFSource:
    """Find config.json and the weight files of a Hugging Face model directory (reads no tensors)."""
    directory = Path(src)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{directory} has no config.json; expected a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        raise ConversionError(f"{config_path} is not valid JSON ({error})") from error
    weight_file = next((directory / name for name in HF_WEIGHT_FILES if (directory / name).is_file()), None)
    if weight_file is None:
        raise ConversionError(f"{directory} has none of {', '.join(HF_WEIGHT_FILES)}")
    shards = (
        sorted({directory / name for name in _weight_map(weight_file).values()})
        if weight_file.suffix == ".json"
        else []
    )
    for shard in shards:
        if not shard.is_file():
            raise ConversionError(f"{weight_file.name} lists shard {shard.name}, which is missing from {directory}")
    return HFSource(directory, config, weight_file, (config_path, weight_file, *shards))


def read_hf_state(source: HFSource) -> dict[str, np.ndarray]:
    """Every tensor of the source as an fp32 array, by its Hugging Face name."""
    if source.weight_file.suffix != ".json":
        return _read_weight_file(source.weight_file)
    weight_map = _weight_map(source.weight_file)
    state: dict[str, np.ndarray] = {}
    for shard_name in sorted(set(weight_map.values())):
        for name, array in sorted(_read_weight_file(source.directory / shard_name).items()):
            if weight_map.get(name) != shard_name:
                raise ConversionError(
                    f"tensor {name} {tuple(array.shape)} is in shard {shard_name}, but {source.weight_file.name} "
                    f"places it in {weight_map.get(name, 'no shard')}"
                )
            state[name] = array
    missing = sorted(set(weight_map) - set(state))
    if missing:
        name = missing[0]
        raise ConversionError(
            f"tensor {name} is listed in {source.weight_file.name} but missing from {weight_map[name]}"
        )
    return state


def _read_weight_file(path: Path) -> dict[str, np.ndarray]:
    if path.suffix != ".safetensors":
        return load_torch_state_dict(path)
    try:
        return read_safetensors(path)
    except StorageError as error:
        raise ConversionError(str(error)) from error


def _weight_map(index_path: Path) -> dict[str, str]:
    try:
        return dict(json.loads(index_path.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"{index_path} is not a shard index with a weight_map ({error})") from error


def source_hash(file_hashes: dict[str, str]) -> str:
    """sha256 over the source files' names and sha256s: what identifies a Hugging Face checkpoint."""
    listing = "".join(f"{name}\0{digest}\n" for name, digest in file_hashes.items())
    return hashlib.sha256(listing.encode()).hexdigest()


def check_model_agrees(model: ModelParams, config: dict, tensor_parallel: int = 1, origin: str = "config.json") -> None:
    """The model section of params must describe the Hugging Face model (seq_len may be shorter, init_std is unused)."""
    derived = family_for(config.get("model_type")).params_from_config(config)
    padded_vocab = -(-derived.vocab_size // tensor_parallel) * tensor_parallel
    padding = {"vocab_size": padded_vocab, "vocab_padding": padded_vocab - derived.vocab_size}
    for field, theirs in {**derived.model_dump(), **padding}.items():
        ours = getattr(model, field)
        if field == "moe":  # its architecture; the routing-loss coefficients are the run's choice
            ours, theirs = _experts(model), _experts(derived)
        if field == "seq_len" and ours > theirs:
            raise ConversionError(f"model.seq_len={ours} is longer than the {origin} context of {theirs} positions")
        if field not in ("seq_len", "init_std") and ours != theirs:
            why = f" (vocab_size={derived.vocab_size} padded for tensor_parallel={tensor_parallel})" if field in padding else ""
            raise ConversionError(f"model.{field}={ours} but {origin} gives {field}={theirs}{why}")


def _experts(model: ModelParams) -> dict | None:
    moe = model.moe
    if moe is None:
        return None
    return {
        "num_experts": moe.num_experts, "experts_per_token": moe.experts_per_token, "layers": list(model.moe_layers),
        "expert_ffn_hidden_size": model.expert_ffn_hidden_size, "normalize_top_k": moe.normalize_top_k,
    }


# --------------------------------------------------------------------------------------------- ours


def hf_to_ms(
    src: str | Path, dst: str | Path, dtype: str = "float32", tensor_parallel: int = 1, seq_len: int | None = None
) -> ConvertedCheckpoint:
    """Convert the Hugging Face directory `src` into `dst` (new or empty; an identical conversion is reused)."""
    dst = Path(dst)
    plan = _plan(src, dtype, tensor_parallel, seq_len)
    if _is_valid(dst, plan.key):
        return _result(dst, reused=True)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConversionError(
            f"{dst} exists and is not this conversion of {src}; remove it or choose another destination"
        )
    return _convert_into(dst, plan)


def hf_to_ms_cached(
    src: str | Path, cache_dir: str | Path, dtype: str = "float32", tensor_parallel: int = 1, seq_len: int | None = None
) -> ConvertedCheckpoint:
    """Convert into `<cache_dir>/<key>`, the key hashing the source files and these options; reuse it when valid."""
    plan = _plan(src, dtype, tensor_parallel, seq_len)
    dst = Path(cache_dir) / plan.key[:16]
    if _is_valid(dst, plan.key):
        return _result(dst, reused=True)
    return _convert_into(dst, plan)


def convert_for_run(convert: ConvertParams, model: ModelParams, tensor_parallel: int) -> ConvertedCheckpoint:
    """The conversion a run's params ask for: check the model section against config.json, then convert
    into (or reuse from) `convert.cache_dir`. Shared by the convert stage and `llmflow train`."""
    if convert.hf_source is None:
        raise ConversionError("convert.hf_source is not set; there is no Hugging Face checkpoint to convert")
    config = locate_hf(convert.hf_source).config
    check_model_agrees(model, config, tensor_parallel, origin=f"{convert.hf_source}/config.json")
    return hf_to_ms_cached(
        convert.hf_source, convert.cache_dir, dtype=convert.dtype, tensor_parallel=tensor_parallel, seq_len=model.seq_len
    )


def read_converted(path: str | Path) -> tuple[dict[str, np.ndarray], ModelParams, int]:
    """(fp32 weights by our names, ModelParams, real vocab size) of a converted checkpoint."""
    path = Path(path)
    record = _verified_record(path)
    return read_weights(path), ModelParams(**json.loads((path / PARAMS).read_text())), record["vocab_size"]


def _plan(src: str | Path, dtype: str, tensor_parallel: int, seq_len: int | None) -> _Plan:
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {DTYPES}")
    if tensor_parallel < 1:
        raise ConversionError(f"tensor_parallel={tensor_parallel} must be at least 1")
    source = locate_hf(src)
    family_for(source.config.get("model_type")).params_from_config(source.config, seq_len)  # fail before hashing
    file_hashes = {path.name: file_sha256(path) for path in source.files}
    digest = source_hash(file_hashes)
    options = {
        "source": digest,
        "dtype": dtype,
        "tensor_parallel": tensor_parallel,
        "seq_len": seq_len,
        "format": FORMAT_VERSION,
    }
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()
    return _Plan(source, file_hashes, digest, key, dtype, tensor_parallel, seq_len)


def _convert_into(final: Path, plan: _Plan) -> ConvertedCheckpoint:
    config = plan.source.config
    family = family_for(config.get("model_type"))
    real_vocab = family.params_from_config(config, plan.seq_len).vocab_size
    weights, params = family.from_hf(
        read_hf_state(plan.source), config, dtype=plan.dtype, tensor_parallel=plan.tensor_parallel, seq_len=plan.seq_len
    )
    record = {
        "format_version": FORMAT_VERSION,
        "key": plan.key,
        "model_type": family.model_type,
        "source": str(plan.source.directory.resolve()),
        "source_files": plan.file_hashes,
        "source_hash": plan.source_hash,
        "dtype": plan.dtype,
        "tensor_parallel": plan.tensor_parallel,
        "vocab_size": real_vocab,
        "padded_vocab_size": params.vocab_size,
    }

    def write(building: Path) -> None:
        metadata = {"producer": "llmflow convert", "source_hash": plan.source_hash}
        write_safetensors(building / WEIGHTS, weights, plan.dtype, metadata)
        (building / PARAMS).write_text(json.dumps(params.model_dump(mode="json"), indent=2) + "\n")
        record["sha256"] = {name: file_sha256(building / name) for name in (WEIGHTS, PARAMS)}
        (building / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    try:
        build_directory(final, write, replace=True)
    except OSError:
        if _is_valid(final, plan.key):  # a concurrent run of the same conversion renamed its copy first
            return _result(final, reused=True)
        raise
    return _result(final, reused=False)


def _is_valid(path: Path, key: str) -> bool:
    try:
        return _verified_record(path)["key"] == key
    except ConversionError:
        return False


def _verified_record(path: Path) -> dict:
    try:
        record = json.loads((path / RECORD).read_text())
        expected = record["sha256"]
    except (OSError, ValueError, KeyError) as error:
        raise ConversionError(f"{path} is not a converted checkpoint: unreadable {RECORD} ({error})") from error
    for name in (WEIGHTS, PARAMS):
        if not (path / name).is_file() or file_sha256(path / name) != expected.get(name):
            raise ConversionError(f"{path}: {name} is missing or does not match its sha256 in {RECORD}")
    return record


def _result(path: Path, reused: bool) -> ConvertedCheckpoint:
    record = _verified_record(path)
    params = ModelParams(**json.loads((path / PARAMS).read_text()))
    return ConvertedCheckpoint(path, params, record["vocab_size"], record["source_hash"], reused)


# ---------------------------------------------------------------------------------- Hugging Face out


def ms_to_hf(
    src: str | Path, dst: str | Path, tokenizer: str | Path | None = None, dtype: str = "float32"
) -> ExportedModel:
    """Export a converted or training checkpoint `src` to a new Hugging Face directory `dst`.

    With `tokenizer` (a SentencePiece .model), it is copied as tokenizer.model with a minimal
    tokenizer_config.json, and the config's special-token ids come from it.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {DTYPES}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConversionError(f"{dst} exists and is not empty; choose a new directory for the export")
    weights, params, vocab_size, model_type = _read_ours(src)
    hf_state, config = family_for(model_type).to_hf(weights, params, vocab_size)
    config["torch_dtype"] = dtype
    tokenizer_files = (
        _tokenizer_files(Path(tokenizer), vocab_size, params, config, src) if tokenizer is not None else {}
    )

    def write(building: Path) -> None:
        write_safetensors(building / "model.safetensors", hf_state, dtype, metadata={"format": "pt"})
        (building / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in tokenizer_files.items():
            (building / name).write_bytes(content)

    build_directory(dst, write, replace=False)
    return ExportedModel(dst, config, vocab_size)


def _read_ours(src: Path) -> tuple[dict[str, np.ndarray], ModelParams, int, str]:
    """(weights, params, real vocab size, model_type) of a converted checkpoint or a training checkpoint."""
    if (src / RECORD).is_file():
        weights, params, vocab_size = read_converted(src)
        return weights, params, vocab_size, json.loads((src / RECORD).read_text())["model_type"]
    if (src / training_checkpoint.STATE).is_file():
        problem = training_checkpoint.verify(training_checkpoint.Checkpoint(src, -1))
        if problem is not None:
            raise ConversionError(f"training checkpoint {src} is not usable: {problem}")
        params = ModelParams(**json.loads((src / training_checkpoint.STATE).read_text())["model"])
        return read_weights(src), params, params.unpadded_vocab_size, "mixtral" if params.moe is not None else "llama"
    raise ConversionError(
        f"{src} is neither a converted checkpoint ({RECORD}) nor a training checkpoint ({training_checkpoint.STATE})"
    )


def _tokenizer_files(path: Path, vocab_size: int, params: ModelParams, config: dict, src: Path) -> dict[str, bytes]:
    try:
        model = path.read_bytes()
        processor = spm.SentencePieceProcessor(model_proto=model)
    except (OSError, RuntimeError) as error:
        raise ConversionError(f"tokenizer {path} is not a readable SentencePiece model ({error})") from error
    check_vocab(vocab_size, processor.get_piece_size(), f"exporting {src} with tokenizer {path}")
    special = {name: getattr(processor, f"{name}_id")() for name in ("unk", "bos", "eos", "pad")}
    config.update(
        {
            f"{name}_token_id": (token_id if token_id >= 0 else None)
            for name, token_id in special.items()
            if name != "unk"
        }
    )
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer",
        **{f"{name}_token": processor.id_to_piece(token_id) for name, token_id in special.items() if token_id >= 0},
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": params.seq_len,
    }
    return {"tokenizer.model": model, "tokenizer_config.json": (json.dumps(tokenizer_config, indent=2) + "\n").encode()}
