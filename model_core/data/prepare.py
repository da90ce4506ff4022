"""`prepare_dataset`: corpus inputs -> cleaned, deduplicated, filtered documents -> tokenizer -> packed,
shuffled train/validation shards plus a manifest, in a directory named by the hash of the inputs and
params, so an unchanged request reuses what is already there.

The steps run in this order: read (parallel over files) and clean; drop empty, too short and too long
documents; drop exact then near duplicates; shuffle and split documents; train or load the tokenizer
on the training documents; encode (native, multi-threaded); pack; shuffle rows; write shards. Length
filters run before deduplication so a document that is dropped anyway never hides a near-copy of itself.
The dataset is built in a temporary sibling directory and renamed into place, so a failure never
leaves a final directory behind.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data import dedup
from model_core.data.cleaning import clean_text
from model_core.data.errors import DataPrepError
from model_core.data.packing import pack_documents
from model_core.data.shards import MANIFEST_NAME, file_sha256, write_shards
from model_core.data.sources import FileReport, InputFile, fingerprint, list_inputs, read_input
from model_core.data.tokenizer import load_tokenizer, open_tokenizer, train_tokenizer
from params.schema import DataParams, ModelParams, TokenizerParams

FORMAT_VERSION = 1
TOKENIZER_NAME = "tokenizer.model"
MAX_REPORTED_RECORDS = 20
_ENCODE_BATCH_DOCS = 16384
# Params that change where or how fast the data is made, not what it is.
_NON_DATA_PARAMS = {"output_dir", "num_workers"}

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, "int | None"], None]


@dataclass(frozen=True)
class PrepResult:
    output_dir: Path
    manifest: dict
    manifest_path: Path
    tokenizer_path: Path
    reused: bool


def prepare_dataset(
    data: DataParams, tokenizer: TokenizerParams, model: ModelParams, progress: Progress | None = None
) -> PrepResult:
    progress = progress or (lambda stage, done, total: None)
    inputs = list_inputs(data.sources)
    params = data_params(data, tokenizer, model)
    input_fingerprint = fingerprint(inputs)
    key = _hash({"params": params, "inputs": input_fingerprint})[:16]
    final_dir = Path(data.output_dir) / key

    if final_dir.exists():
        problem = verify_dataset(final_dir)
        if problem is None:
            return _result(final_dir, reused=True)
        logger.warning("prepared dataset %s is damaged (%s); rebuilding it", final_dir, problem)

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=final_dir.parent))
    try:
        manifest = _build(build_dir, inputs, data, tokenizer, model, progress)
        manifest.update(key=key, params=params, params_hash=_hash(params), input_fingerprint=input_fingerprint)
        (build_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        _move_into_place(build_dir, final_dir)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return _result(final_dir, reused=False)


def data_params(data: DataParams, tokenizer: TokenizerParams, model: ModelParams) -> dict:
    """Everything that decides the content of the dataset (a loaded tokenizer counts by its bytes)."""
    tokenizer_params = tokenizer.model_dump(exclude={"model_path"})
    if tokenizer.model_path is not None:
        given = Path(tokenizer.model_path)
        tokenizer_params["model_sha256"] = file_sha256(given) if given.is_file() else None
    return {
        "format_version": FORMAT_VERSION,
        "data": data.model_dump(exclude=_NON_DATA_PARAMS),
        "tokenizer": tokenizer_params,
        "model": {"vocab_size": model.vocab_size, "seq_len": model.seq_len},
    }


def verify_dataset(directory: Path) -> str | None:
    """None when the manifest and every file it lists are intact, else what is wrong."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as error:
        return f"unreadable {MANIFEST_NAME}: {error}"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format_version {manifest.get('format_version')} is not {FORMAT_VERSION}"
    files = [(TOKENIZER_NAME, manifest["tokenizer"]["sha256"])]
    files += [(shard["file"], shard["sha256"]) for split in manifest["splits"].values() for shard in split["shards"]]
    for name, expected in files:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != expected:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _build(
    build_dir: Path,
    inputs: list[InputFile],
    data: DataParams,
    tokenizer: TokenizerParams,
    model: ModelParams,
    progress: Progress,
) -> dict:
    workers = data.num_workers or len(os.sched_getaffinity(0))
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = round(now - clock, 4)
        clock = now

    texts, reports = _read_and_clean(inputs, data.normalize_unicode, workers, progress)
    read_counts = _check_bad_records(reports, data.max_bad_record_fraction)
    bad_records = read_counts.pop("examples")
    lap("read_and_clean")
    texts, dropped, steps = _select_documents(texts, data, progress)
    lap("filter_and_dedup")
    train_docs, validation_docs = _split_documents(texts, data.validation_fraction, data.shuffle_seed)

    tokenizer_info = _write_tokenizer(build_dir, train_docs, tokenizer, model, data.shuffle_seed, workers)
    processor = open_tokenizer(
        (build_dir / TOKENIZER_NAME).read_bytes(), tokenizer, model.vocab_size, tokenizer_info["origin"]
    )
    lap("tokenizer")

    splits = {}
    for split, docs in (("train", train_docs), ("validation", validation_docs)):
        splits[split] = _encode_pack_write(build_dir, split, docs, processor, data, tokenizer, model, workers, progress)
    lap("encode_pack_write")
    if splits["train"]["rows"] == 0:
        raise DataPrepError(
            f"the {len(train_docs)} training documents make {splits['train']['tokens']} tokens, "
            f"less than one row of model.seq_len + 1 = {model.seq_len + 1}"
        )
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "counts": {**read_counts, "dropped": dropped, "kept_documents": len(texts)},
        "steps": steps,
        "bad_records": bad_records,
        "tokenizer": tokenizer_info,
        "vocab_size": model.vocab_size,
        "seq_len": model.seq_len,
        "splits": splits,
        "timings_s": timings,
    }


def _read_and_clean(
    inputs: list[InputFile], normalize_unicode: bool, workers: int, progress: Progress
) -> tuple[list[str], list[FileReport]]:
    """Read and clean every input file, in parallel processes when there are several files."""
    texts: list[str] = []
    reports: list[FileReport] = []
    jobs = [(item, normalize_unicode) for item in inputs]
    progress("read", 0, len(jobs))
    if workers > 1 and len(jobs) > 1:
        # fork: workers inherit the imported modules, so they start in milliseconds.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            results = pool.map(_read_and_clean_file, jobs, chunksize=max(1, len(jobs) // (8 * workers)))
            for done, (file_texts, report) in enumerate(results, 1):
                texts += file_texts
                reports.append(report)
                progress("read", done, len(jobs))
    else:
        for done, job in enumerate(jobs, 1):
            file_texts, report = _read_and_clean_file(job)
            texts += file_texts
            reports.append(report)
            progress("read", done, len(jobs))
    return texts, reports


def _read_and_clean_file(job: tuple[InputFile, bool]) -> tuple[list[str], FileReport]:
    item, normalize_unicode = job
    texts, report = read_input(item)
    return [clean_text(text, normalize_unicode) for text in texts], report


def _check_bad_records(reports: list[FileReport], max_fraction: float) -> dict:
    """Log bad records, fail when malformed ones exceed the allowed share, return the read counts."""
    records = sum(report.records for report in reports)
    malformed = [f"{r.path}:{line}: {reason}" for r in reports for line, reason in r.malformed]
    undecodable = [f"{r.path}:{line}: undecodable bytes replaced" for r in reports for line in r.undecodable_lines]
    examples = (malformed + undecodable)[:MAX_REPORTED_RECORDS]
    for example in examples:
        logger.warning("bad record %s", example)
    if malformed or undecodable:
        logger.warning(
            "%d malformed records skipped and %d lines with undecodable bytes kept, of %d records",
            len(malformed), len(undecodable), records,
        )
    if records and len(malformed) / records > max_fraction:
        raise DataPrepError(
            f"{len(malformed)} of {records} records ({len(malformed) / records:.2%}) are malformed, more than "
            f"data.max_bad_record_fraction={max_fraction}; first: {malformed[0]}"
        )
    return {
        "records": records,
        "malformed": len(malformed),
        "undecodable": len(undecodable),
        "examples": examples,
    }


def _select_documents(texts: list[str], data: DataParams, progress: Progress) -> tuple[list[str], dict, list]:
    """Drop empty, too short, too long and duplicate documents.

    Returns the kept documents, the count dropped per reason and each step's documents in and out.
    """
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    masks = {
        "empty": lengths == 0,
        "too_short": (lengths > 0) & (lengths < data.min_chars),
        "too_long": lengths > data.max_chars,
    }
    if data.dedup_exact:
        masks["exact_duplicate"] = dedup.exact_duplicate_mask
    if data.near_dup_threshold is not None:
        masks["near_duplicate"] = lambda kept: dedup.near_duplicate_mask(
            kept, data.shingle_words, data.minhash_permutations, data.near_dup_threshold
        )
    dropped = dict.fromkeys(["empty", "too_short", "too_long", "exact_duplicate", "near_duplicate"], 0)
    steps = []
    keep = np.ones(len(texts), dtype=bool)
    for done, (reason, rule) in enumerate(masks.items()):
        progress("filter and dedup", done, len(masks))
        kept = np.flatnonzero(keep)
        if callable(rule):  # deduplication looks only at documents that are still kept, in corpus order
            mask = np.zeros(len(texts), dtype=bool)
            mask[kept] = rule([texts[i] for i in kept])
        else:
            mask = rule
        newly = mask & keep
        dropped[reason] = int(newly.sum())
        keep &= ~newly
        steps.append({"step": reason, "in": len(kept), "out": len(kept) - dropped[reason]})
    progress("filter and dedup", len(masks), len(masks))
    if not keep.any():
        counts = ", ".join(f"{reason}={count}" for reason, count in dropped.items())
        raise DataPrepError(f"no document is left after cleaning, filtering and deduplication ({counts})")
    return [texts[i] for i in np.flatnonzero(keep)], dropped, steps


def _split_documents(texts: list[str], validation_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Shuffle the documents and hold out a share for validation (at least one when the share is > 0)."""
    order = _rng(seed, "documents").permutation(len(texts))
    held_out = max(1, round(len(texts) * validation_fraction)) if validation_fraction > 0 else 0
    if held_out >= len(texts):
        raise DataPrepError(
            f"{len(texts)} documents cannot be split with data.validation_fraction={validation_fraction}: "
            "no training document would be left"
        )
    return [texts[i] for i in order[held_out:]], [texts[i] for i in order[:held_out]]


def _write_tokenizer(
    build_dir: Path, train_docs: list[str], tokenizer: TokenizerParams, model: ModelParams, seed: int, workers: int
) -> dict:
    started = time.perf_counter()
    if tokenizer.model_path is not None:
        model_bytes, origin = load_tokenizer(Path(tokenizer.model_path)), f"tokenizer {tokenizer.model_path}"
    else:
        model_bytes = train_tokenizer(train_docs, tokenizer, model.vocab_size, seed, workers)
        origin = "the trained tokenizer"
    (build_dir / TOKENIZER_NAME).write_bytes(model_bytes)
    return {
        "file": TOKENIZER_NAME,
        "sha256": hashlib.sha256(model_bytes).hexdigest(),
        "trained": tokenizer.model_path is None,
        "origin": origin,
        "seconds": round(time.perf_counter() - started, 4),
        "vocab_size": model.vocab_size,
        **{name: getattr(tokenizer, name) for name in ("unk_id", "bos_id", "eos_id", "pad_id")},
    }


def _encode_pack_write(
    build_dir: Path,
    split: str,
    docs: list[str],
    processor,
    data: DataParams,
    tokenizer: TokenizerParams,
    model: ModelParams,
    workers: int,
    progress: Progress,
) -> dict:
    token_ids: list[list[int]] = []
    progress(f"tokenize {split}", 0, len(docs))
    for first in range(0, len(docs), _ENCODE_BATCH_DOCS):
        token_ids += processor.encode(docs[first : first + _ENCODE_BATCH_DOCS], num_threads=workers)
        progress(f"tokenize {split}", len(token_ids), len(docs))
    rows = pack_documents(
        token_ids,
        model.seq_len + 1,
        tokenizer.bos_id if data.add_bos else None,
        tokenizer.eos_id,
        tokenizer.pad_id,
        data.last_row,
    )
    rows = rows.take(_rng(data.shuffle_seed, split).permutation(len(rows)))
    shards = write_shards(rows, build_dir, split, data.rows_per_shard, tokenizer.pad_id)
    document_tokens = sum(map(len, token_ids)) + len(token_ids) * (1 + data.add_bos)
    return {
        "documents": len(docs),
        "tokens": document_tokens,
        "rows": len(rows),
        "packed_tokens": sum(shard["tokens"] for shard in shards),
        "shards": shards,
    }


def _move_into_place(build_dir: Path, final_dir: Path) -> None:
    """Rename the finished build over the final name; a damaged old copy is moved aside first."""
    if final_dir.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.damaged-", dir=final_dir.parent))
        os.replace(final_dir, stale / final_dir.name)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(build_dir, final_dir)


def _result(directory: Path, reused: bool) -> PrepResult:
    manifest_path = directory / MANIFEST_NAME
    return PrepResult(
        output_dir=directory,
        manifest=json.loads(manifest_path.read_text()),
        manifest_path=manifest_path,
        tokenizer_path=directory / TOKENIZER_NAME,
        reused=reused,
    )


def _rng(seed: int, stream: str) -> np.random.Generator:
    """An independent, reproducible random stream per purpose (document order, each split's rows)."""
    return np.random.default_rng([seed % 2**64, int.from_bytes(stream.encode(), "little")])


def _hash(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
