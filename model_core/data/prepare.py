"""`prepare_dataset`: corpus inputs -> cleaned, deduplicated, filtered documents -> tokenizer -> packed,
shuffled train/validation shards plus a manifest, in a directory named by the hash of the inputs and
params, so an unchanged request reuses what is already there.

The steps run in this order: read and clean (batched; in "spawn" worker processes only for several
large files); drop empty, too short and too long documents, then exact duplicates; shuffle and split
documents; train or load the tokenizer on the training documents; encode every document (native,
multi-threaded, straight into numpy); drop near duplicates, found on token shingles, from both splits;
pack; shuffle rows; write shards. Length filters run before deduplication so a document that is dropped
anyway never hides a near-copy of itself. Near-deduplication follows the split, so `validation_fraction`
is the held-out share before it; it needs the token ids, and encoding has to happen anyway.
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
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from model_core.data import dedup
from model_core.data.cleaning import clean_texts
from model_core.data.errors import DataPrepError
from model_core.data.packing import pack_documents, select_documents
from model_core.data.shards import MANIFEST_NAME, file_sha256, write_shards
from model_core.data.sources import FileReport, InputFile, fingerprint, list_inputs, read_input
from model_core.data.tokenizer import encode_documents, load_tokenizer, open_tokenizer, train_tokenizer
from params.schema import DataParams, ModelParams, TokenizerParams

FORMAT_VERSION = 2  # 2: near duplicates are found on token shingles
TOKENIZER_NAME = "tokenizer.model"
CACHE_DIR = ".cache"  # under data.output_dir: the extracted standard-library docstrings
MAX_REPORTED_RECORDS = 20
_ENCODE_BATCH_DOCS = 1024  # small enough that minhashing one batch overlaps encoding the next
# Reading in worker processes pays for their start (about a second) only on several large files.
_PARALLEL_READ_BYTES = 64 << 20
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

    cache_dir = Path(data.output_dir) / CACHE_DIR
    texts, reports = _read_and_clean(inputs, data.normalize_unicode, workers, cache_dir, progress)
    read_counts = _check_bad_records(reports, data.max_bad_record_fraction)
    bad_records = read_counts.pop("examples")
    lap("read_and_clean")
    texts, dropped, steps = _select_documents(texts, data, progress)
    lap("filter_and_exact_dedup")
    train_order, validation_order = _split_documents(len(texts), data.validation_fraction, data.shuffle_seed)

    train_texts = [texts[i] for i in train_order]
    tokenizer_info = _write_tokenizer(build_dir, train_texts, tokenizer, model, data.shuffle_seed, workers)
    processor = open_tokenizer(
        (build_dir / TOKENIZER_NAME).read_bytes(), tokenizer, model.vocab_size, tokenizer_info["origin"]
    )
    lap("tokenizer")

    token_ids, lengths, signatures = _encode(texts, processor, workers, data, progress)
    lap("encode_and_minhash")
    near_copies = np.zeros(len(texts), dtype=bool)
    if signatures is not None:
        progress("near dedup", 0, 1)
        near_copies = dedup.near_duplicate_mask(signatures, data.near_dup_threshold)
        progress("near dedup", 1, 1)
        dropped["near_duplicate"] = int(near_copies.sum())
        steps.append({"step": "near_duplicate", "in": len(texts), "out": len(texts) - dropped["near_duplicate"]})
    lap("near_dedup")

    splits = {}
    for split, order in (("train", train_order), ("validation", validation_order)):
        split_ids, split_lengths = select_documents(token_ids, lengths, order[~near_copies[order]])
        splits[split] = _pack_and_write(build_dir, split, split_ids, split_lengths, data, tokenizer, model, progress)
    lap("pack_and_write")
    if splits["train"]["rows"] == 0:
        raise DataPrepError(
            f"the {splits['train']['documents']} training documents make {splits['train']['tokens']} tokens, "
            f"less than one row of model.seq_len + 1 = {model.seq_len + 1}"
        )
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "counts": {**read_counts, "dropped": dropped, "kept_documents": len(texts) - int(near_copies.sum())},
        "steps": steps,
        "near_dedup": {
            "shingle": f"{data.shingle_words} consecutive token ids (data.shingle_words counts tokens)",
            "signature": f"one-permutation MinHash, {data.minhash_permutations} positions, optimal densification",
        },
        "bad_records": bad_records,
        "tokenizer": tokenizer_info,
        "vocab_size": model.vocab_size,
        "seq_len": model.seq_len,
        "splits": splits,
        "timings_s": timings,
    }


def _read_and_clean(
    inputs: list[InputFile], normalize_unicode: bool, workers: int, cache_dir: Path, progress: Progress
) -> tuple[list[str], list[FileReport]]:
    """Read and clean every input, in "spawn" worker processes when there are several large files.

    Never "fork": this runs inside Prefect flows, whose process has threads, and a child forked while
    another thread holds a lock (logging's, say) can hang on it forever.
    """
    file_bytes = sum(item.path.stat().st_size for item in inputs if item.path.is_file())
    parallel = workers > 1 and len(inputs) > 1 and file_bytes > _PARALLEL_READ_BYTES
    jobs = [(item, normalize_unicode, cache_dir) for item in inputs]
    progress("read", 0, len(jobs))
    if parallel:
        pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"))
        with pool:
            results = list(_with_progress(pool.map(_read_and_clean_input, jobs), len(jobs), progress))
    else:
        results = list(_with_progress(map(_read_and_clean_input, jobs), len(jobs), progress))
    texts = list(chain.from_iterable(file_texts for file_texts, _ in results))
    return texts, [report for _, report in results]


def _with_progress(results, total: int, progress: Progress):
    for done, result in enumerate(results, 1):
        yield result
        progress("read", done, total)


def _read_and_clean_input(job: tuple[InputFile, bool, Path]) -> tuple[list[str], FileReport]:
    item, normalize_unicode, cache_dir = job
    texts, report = read_input(item, cache_dir)
    return clean_texts(texts, normalize_unicode), report


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
    """Drop empty, too short, too long and exactly duplicated documents.

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


def _split_documents(documents: int, validation_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled document indices of the training and validation documents (at least one held out when
    the share is > 0)."""
    order = _rng(seed, "documents").permutation(documents)
    held_out = max(1, round(documents * validation_fraction)) if validation_fraction > 0 else 0
    if held_out >= documents:
        raise DataPrepError(
            f"{documents} documents cannot be split with data.validation_fraction={validation_fraction}: "
            "no training document would be left"
        )
    return order[held_out:], order[:held_out]


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


def _encode(
    texts: list[str], processor, workers: int, data: DataParams, progress: Progress
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The token ids of all documents concatenated (int32), the number of tokens of each, and (when
    near-dedup is on) their MinHash signatures.

    Batches are encoded on a background thread (SentencePiece drops the GIL and runs `workers` native
    threads) while this thread computes the signatures of the batch before, so that work fills the
    encoder's idle moments instead of following it.
    """
    batches = [texts[first : first + _ENCODE_BATCH_DOCS] for first in range(0, len(texts), _ENCODE_BATCH_DOCS)]
    token_ids, lengths, signatures = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int64)], []
    progress("tokenize", 0, len(texts))
    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:
        for encoded in [encoder.submit(encode_documents, processor, batch, workers) for batch in batches]:
            pieces = encoded.result()
            lengths.append(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)))
            token_ids.append(np.concatenate([np.zeros(0, dtype=np.int32), *pieces]))
            if data.near_dup_threshold is not None:
                signatures.append(
                    dedup.minhash_signatures(token_ids[-1], lengths[-1], data.shingle_words, data.minhash_permutations)
                )
            progress("tokenize", sum(map(len, lengths)), len(texts))
    return np.concatenate(token_ids), np.concatenate(lengths), np.concatenate(signatures) if signatures else None


def _pack_and_write(
    build_dir: Path,
    split: str,
    token_ids: np.ndarray,
    lengths: np.ndarray,
    data: DataParams,
    tokenizer: TokenizerParams,
    model: ModelParams,
    progress: Progress,
) -> dict:
    progress(f"write {split}", 0, 1)
    rows = pack_documents(
        token_ids,
        lengths,
        model.seq_len + 1,
        tokenizer.bos_id if data.add_bos else None,
        tokenizer.eos_id,
        tokenizer.pad_id,
        data.last_row,
    )
    rows = rows.take(_rng(data.shuffle_seed, split).permutation(len(rows)))
    shards = write_shards(rows, build_dir, split, data.rows_per_shard, tokenizer.pad_id)
    progress(f"write {split}", 1, 1)
    return {
        "documents": len(lengths),
        "tokens": int(lengths.sum()) + len(lengths) * (1 + data.add_bos),
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
