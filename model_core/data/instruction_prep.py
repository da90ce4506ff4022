"""`prepare_instructions`: instruction records -> template token ids with a response-only loss mask ->
packed train/validation shards plus a manifest, in a directory named by the hash of the records, params
and tokenizer, so an unchanged request reuses what is already there.

The steps: read the records (`lora.data_paths`, or the bundled set of instruction_set.py when it is
empty), report malformed ones and fail when their share exceeds data.max_bad_record_fraction; drop exact
repeats; tokenize under the template (instructions.py) with the given tokenizer, normally pretraining's;
drop examples longer than a row (seq_len + 1 tokens), counted as `too_long`: they are never cut, since a
cut example loses its EOS or its response; shuffle with data.shuffle_seed; hold out the first
data.validation_fraction of the examples, and at least enough to fill `min_validation_rows` rows; pack each
split by first fit (packing.py) and write shards with a `loss_mask` section (shards.py). The dataset is built
in a temporary sibling directory and renamed into place, so a failure never leaves a final directory.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data.errors import DataPrepError
from model_core.data.instruction_set import bundled_fingerprint, bundled_jsonl
from model_core.data.instructions import Record, TemplateEncoder, parse_records, separators
from model_core.data.packing import first_fit_rows, pack_examples, select_documents
from model_core.data.prepare import TOKENIZER_NAME, PrepResult, _check_bad_records, _hash, _rng, prepared, vocab_padding
from model_core.data.shards import MANIFEST_NAME, DatasetDamagedError, build_or_reuse, read_manifest, write_shards
from model_core.data.sources import FileReport
from model_core.data.tokenizer import load_tokenizer, open_tokenizer
from model_core.storage import file_sha256
from params.schema import DataParams, LoraParams, ModelParams, TokenizerParams

FORMAT_VERSION = 2  # 2: flat token shards (shards.py) instead of Parquet
KIND = "instructions"
BUNDLED = Path("<bundled python-docstring instructions>")  # the bundled set's name in reports


@dataclass(frozen=True)
class _Request:
    """What, besides the records, decides the dataset."""

    lora: LoraParams
    data: DataParams
    model: ModelParams
    tokenizer: TokenizerParams
    tokenizer_path: Path
    tokenizer_bytes: bytes
    min_validation_rows: int

    @property
    def tokenizer_sha256(self) -> str:
        return hashlib.sha256(self.tokenizer_bytes).hexdigest()

    def params(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "template": separators(self.lora),
            "data": self.data.model_dump(
                include={"add_bos", "validation_fraction", "shuffle_seed", "rows_per_shard", "max_bad_record_fraction"}
            ),
            "tokenizer": {
                "sha256": self.tokenizer_sha256,
                **self.tokenizer.model_dump(include={"bos_id", "eos_id", "pad_id"}),
            },
            "model": {"vocab_size": self.model.vocab_size, "seq_len": self.model.seq_len, **vocab_padding(self.model)},
            "min_validation_rows": self.min_validation_rows,
        }


def prepare_instructions(
    lora: LoraParams,
    data: DataParams,
    tokenizer_path: Path,
    model: ModelParams,
    tokenizer: TokenizerParams,
    min_validation_rows: int = 1,
) -> PrepResult:
    """Prepare (or reuse) the instruction dataset; `min_validation_rows` is the fewest validation rows to
    hold out when data.validation_fraction > 0 (pass train.micro_batch_size for one evaluation batch)."""
    tokenizer_path = Path(tokenizer_path)
    request = _Request(lora, data, model, tokenizer, tokenizer_path, load_tokenizer(tokenizer_path), min_validation_rows)
    files = _instruction_files(lora.data_paths)
    params = request.params()
    input_fingerprint = _fingerprint(files)
    key = _hash({"params": params, "inputs": input_fingerprint})[:16]

    def build(build_dir: Path) -> dict:
        manifest = _build(build_dir, files, request)
        return {**manifest, "key": key, "params": params, "params_hash": _hash(params), "input_fingerprint": input_fingerprint}

    final_dir = Path(data.output_dir) / key
    return prepared(final_dir, reused=build_or_reuse(final_dir, verify_instructions, build))


def verify_instructions(directory: Path) -> str | None:
    """None when the manifest is an instruction dataset's and every file it lists is intact, else what is wrong."""
    try:
        manifest = read_manifest(directory)
    except DatasetDamagedError as error:
        return error.problem
    except (OSError, ValueError) as error:
        return f"unreadable {MANIFEST_NAME}: {error}"
    if (manifest.get("kind"), manifest.get("format_version")) != (KIND, FORMAT_VERSION):
        return f"kind {manifest.get('kind')} format_version {manifest.get('format_version')} is not {KIND} {FORMAT_VERSION}"
    files = [(TOKENIZER_NAME, manifest["tokenizer"]["sha256"])]
    files += [(shard["file"], shard["sha256"]) for split in manifest["splits"].values() for shard in split["shards"]]
    for name, expected in files:
        if not (directory / name).is_file() or file_sha256(directory / name) != expected:
            return f"{name} is missing or does not match its sha256 in the manifest"
    return None


def _instruction_files(paths: list[str]) -> list[Path]:
    """The given instruction files, resolved (an empty list means the bundled set); all missing ones are an error."""
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        raise DataPrepError(f"lora.data_paths: {', '.join(map(repr, missing))} does not exist or is not a file")
    return [Path(path).resolve() for path in paths]


def _fingerprint(files: list[Path]) -> list[str]:
    if not files:
        return [f"{BUNDLED}\t{bundled_fingerprint()}"]
    return [f"{path}\t{file_sha256(path)}" for path in files]


def _build(build_dir: Path, files: list[Path], request: _Request) -> dict:
    started = time.perf_counter()
    lora, data, model, tokenizer = request.lora, request.data, request.model, request.tokenizer
    open_tokenizer(request.tokenizer_bytes, tokenizer, model.vocab_size, f"tokenizer {request.tokenizer_path}", model.vocab_padding)
    (build_dir / TOKENIZER_NAME).write_bytes(request.tokenizer_bytes)
    records, reports = _read_records(files)
    read_counts = _check_bad_records(reports, data.max_bad_record_fraction)
    bad_records = read_counts.pop("examples")
    first_of = {}  # exact repeats go, the first of them stays
    for record in records:
        first_of.setdefault(record.turns, record)
    duplicates, records = len(records) - len(first_of), list(first_of.values())
    if not records:
        raise DataPrepError(f"no instruction record to prepare in {', '.join(str(r.path) for r in reports)}")
    workers = data.num_workers or len(os.sched_getaffinity(0))
    encoder = TemplateEncoder(
        request.tokenizer_bytes, lora, tokenizer.bos_id if data.add_bos else None, tokenizer.eos_id, workers
    )
    token_ids, lengths, loss_mask = encoder.encode(records)
    row_len = model.seq_len + 1
    fitting = np.flatnonzero(lengths <= row_len)
    dropped = {"duplicate": duplicates, "too_long": len(lengths) - len(fitting)}
    if not len(fitting):
        raise DataPrepError(
            f"none of the {len(lengths)} instruction examples fits a row of model.seq_len + 1 = {row_len} tokens "
            f"(the shortest has {lengths.min()})"
        )
    order = _rng(data.shuffle_seed, "examples").permutation(fitting)
    held_out = _validation_size(lengths[order], data.validation_fraction, row_len, request.min_validation_rows)
    splits = {
        split: _pack_and_write(
            build_dir, split, token_ids, lengths, loss_mask, chosen, data, tokenizer.pad_id, row_len, model.vocab_size
        )
        for split, chosen in (("train", order[held_out:]), ("validation", order[:held_out]))
    }
    return {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "template": separators(lora),
        "counts": {**read_counts, "dropped": dropped, "examples": len(fitting)},
        "bad_records": bad_records,
        "tokenizer": {
            "file": TOKENIZER_NAME,
            "sha256": request.tokenizer_sha256,
            "source": str(request.tokenizer_path),
            "vocab_size": model.vocab_size,
            **{name: getattr(tokenizer, name) for name in ("unk_id", "bos_id", "eos_id", "pad_id")},
        },
        "vocab_size": model.vocab_size,
        **vocab_padding(model),
        "seq_len": model.seq_len,
        "splits": splits,
        "seconds": round(time.perf_counter() - started, 4),
    }


def _read_records(files: list[Path]) -> tuple[list[Record], list[FileReport]]:
    sources = [(path, path.read_bytes()) for path in files] or [(BUNDLED, bundled_jsonl())]
    records, reports = [], []
    for path, data in sources:
        file_records, report = parse_records(path, data)
        records += file_records
        reports.append(report)
    return records, reports


def _validation_size(lengths: np.ndarray, fraction: float, row_len: int, min_rows: int) -> int:
    """How many examples, from the front of the shuffled order, are held out for validation: the share,
    and at least as many as fill `min_rows` rows (first fit places a prefix as it does in the whole)."""
    if fraction == 0:
        return 0
    rows, _ = first_fit_rows(lengths, row_len)
    reaching = np.flatnonzero(rows == min_rows - 1)
    held_out = max(round(len(lengths) * fraction), int(reaching[0]) + 1 if len(reaching) else len(lengths))
    if held_out >= len(lengths):
        raise DataPrepError(
            f"{len(lengths)} instruction examples ({int(rows.max()) + 1} rows) cannot hold out "
            f"data.validation_fraction={fraction} and at least {min_rows} validation rows and leave any to train on"
        )
    return held_out


def _pack_and_write(
    build_dir: Path,
    split: str,
    token_ids: np.ndarray,
    lengths: np.ndarray,
    loss_mask: np.ndarray,
    chosen: np.ndarray,
    data: DataParams,
    pad_id: int,
    row_len: int,
    vocab_size: int,
) -> dict:
    split_ids, split_lengths = select_documents(token_ids, lengths, chosen)
    split_mask, _ = select_documents(loss_mask, lengths, chosen)
    rows = pack_examples(split_ids, split_lengths, split_mask, row_len, pad_id)
    shards = write_shards(rows, build_dir, split, data.rows_per_shard, pad_id, vocab_size)
    tokens = int(split_lengths.sum())
    return {
        "examples": len(chosen),
        "tokens": tokens,
        "response_tokens": int(split_mask.sum()),
        "rows": len(rows),
        "fill": round(tokens / (len(rows) * row_len), 4) if len(rows) else 0.0,
        "shards": shards,
    }
