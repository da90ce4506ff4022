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

A given tokenizer (tokenizer.model_path) is loaded first, and then the corpus streams: each chunk is
read, cleaned and filtered on this thread while the chunks before it encode and their MinHash
signatures are computed, and the bad-record and empty-corpus checks come after the last chunk. The
outcome is the same as in the order above, which a trained tokenizer needs (it sees every training
document before anything is encoded). The two splits pack and write side by side.
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
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, compress
from pathlib import Path

import numpy as np
import sentencepiece as spm

from model_core.data import dedup
from model_core.data.cleaning import clean_texts
from model_core.data.errors import DataPrepError
from model_core.data.packing import pack_documents
from model_core.data.shards import MANIFEST_NAME, file_sha256, write_shards
from model_core.data.sources import FileReport, InputFile, fingerprint, list_inputs, read_input, read_input_chunks
from model_core.data.tokenizer import (
    encode_documents,
    encoding_threads,
    load_tokenizer,
    open_tokenizer,
    train_tokenizer,
)
from params.schema import DataParams, ModelParams, TokenizerParams

FORMAT_VERSION = 2  # 2: near duplicates are found on token shingles
TOKENIZER_NAME = "tokenizer.model"
CACHE_DIR = ".cache"  # under data.output_dir: the extracted standard-library docstrings
MAX_REPORTED_RECORDS = 20
_ENCODE_BATCH_DOCS = 1024  # small enough that minhashing one batch overlaps encoding the next
_LAST_BATCH_DOCS = 128  # the smallest of the last batches, so little MinHash follows encoding (small batches cost)
# Batches handed to the encoder at once: while one turns its ids into arrays under the GIL (~1.5 ms per
# 1024 documents), the next keeps the cores encoding. They queue for one pool of `workers` native threads
# (twice as many threads as cores cost 4-14 ms more CPU per 460K tokens), which take a batch's documents
# one at a time, so the last batch ends on all cores together.
_BATCHES_IN_FLIGHT = 2
_CLEAN_CHUNK_DOCS = 512  # cleaned at a time, so that encoding starts after the first chunk, not the corpus
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
    watch = _Stopwatch()
    given = tokenizer.model_path is not None
    if given:
        tokenizer_info, processor = _tokenizer(build_dir, None, tokenizer, model, data.shuffle_seed, workers)
        watch.lap("tokenizer")

    selection = _Selection(data)
    reports: list[FileReport] = []
    # With a given tokenizer every chunk is encoded as soon as it is selected, while the next one is read
    # and cleaned; a trained one needs the whole corpus first. Either way the chunks come in corpus order.
    reading = _quiet if given else progress
    chunks = _read_and_clean(
        inputs, data.normalize_unicode, workers, Path(data.output_dir) / CACHE_DIR, reports, reading
    )
    documents = _selected(chunks, selection, watch, reading)
    if given:
        token_ids, lengths, signatures = _encode(documents, processor, workers, data, progress, "read and tokenize")
        watch.lap("encode_and_minhash")
    else:
        texts = list(chain.from_iterable(documents))
    read_counts = _check_bad_records(reports, data.max_bad_record_fraction)
    bad_records = read_counts.pop("examples")
    dropped, steps = selection.outcome()
    train_order, validation_order = _split_documents(selection.kept, data.validation_fraction, data.shuffle_seed)
    if not given:
        train_texts = [texts[i] for i in train_order]
        tokenizer_info, processor = _tokenizer(build_dir, train_texts, tokenizer, model, data.shuffle_seed, workers)
        watch.lap("tokenizer")
        token_ids, lengths, signatures = _encode([texts], processor, workers, data, progress, "tokenize")
        watch.lap("encode_and_minhash")

    near_copies = np.zeros(selection.kept, dtype=bool)
    if signatures is not None:
        progress("near dedup", 0, 1)
        near_copies = dedup.near_duplicate_mask(signatures, data.near_dup_threshold)
        progress("near dedup", 1, 1)
        dropped["near_duplicate"] = int(near_copies.sum())
        steps.append({"step": "near_duplicate", "in": selection.kept, "out": int((~near_copies).sum())})
    watch.lap("near_dedup")

    orders = {
        "train": train_order[~near_copies[train_order]],
        "validation": validation_order[~near_copies[validation_order]],
    }
    for split in orders:
        progress(f"write {split}", 0, 1)
    # The validation split packs and writes beside the training one (numpy, zstd and the writes drop the GIL).
    # The larger training split stays on this thread, whose allocator has freed memory to reuse: in the
    # writer thread more of its arrays were new pages (page faults cost ~4.5 us each on these machines).
    with ThreadPoolExecutor(1, thread_name_prefix="write") as writer:
        validation = writer.submit(
            _pack_and_write, build_dir, "validation", token_ids, lengths, orders["validation"], data, tokenizer, model
        )
        train = _pack_and_write(build_dir, "train", token_ids, lengths, orders["train"], data, tokenizer, model)
        splits = {"train": train, "validation": validation.result()}
    for split in splits:
        progress(f"write {split}", 1, 1)
    watch.lap("pack_and_write")
    if splits["train"]["rows"] == 0:
        raise DataPrepError(
            f"the {splits['train']['documents']} training documents make {splits['train']['tokens']} tokens, "
            f"less than one row of model.seq_len + 1 = {model.seq_len + 1}"
        )
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "counts": {**read_counts, "dropped": dropped, "kept_documents": selection.kept - int(near_copies.sum())},
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
        "timings_s": {stage: round(seconds, 4) for stage, seconds in watch.seconds.items()},
    }


class _Stopwatch:
    """Wall seconds per stage; a stage met several times (reading interleaved with encoding) adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now


def _quiet(stage: str, done: int, total: int | None) -> None:
    """Progress that is not shown: reading runs inside the "read and tokenize" phase."""


def _read_and_clean(
    inputs: list[InputFile],
    normalize_unicode: bool,
    workers: int,
    cache_dir: Path,
    reports: list[FileReport],
    progress: Progress,
) -> Iterator[list[str]]:
    """The cleaned documents of every input in order, a chunk at a time; each input's FileReport is
    appended to `reports` once it is read. In "spawn" worker processes when there are several large files.

    Never "fork": this runs inside Prefect flows, whose process has threads, and a child forked while
    another thread holds a lock (logging's, say) can hang on it forever.
    """
    file_bytes = sum(item.path.stat().st_size for item in inputs if item.path.is_file())
    progress("read", 0, len(inputs))
    if workers > 1 and len(inputs) > 1 and file_bytes > _PARALLEL_READ_BYTES:
        jobs = [(item, normalize_unicode, cache_dir) for item in inputs]
        pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"))
        with pool:
            for done, (texts, report) in enumerate(pool.map(_read_and_clean_input, jobs), 1):
                reports.append(report)
                progress("read", done, len(inputs))
                yield texts
        return
    for done, item in enumerate(inputs, 1):
        reports.append(FileReport(item.path))
        for texts in read_input_chunks(item, reports[-1], cache_dir):
            for first in range(0, len(texts), _CLEAN_CHUNK_DOCS):
                yield clean_texts(texts[first : first + _CLEAN_CHUNK_DOCS], normalize_unicode)
        progress("read", done, len(inputs))


def _read_and_clean_input(job: tuple[InputFile, bool, Path]) -> tuple[list[str], FileReport]:
    item, normalize_unicode, cache_dir = job
    texts, report = read_input(item, cache_dir)
    return clean_texts(texts, normalize_unicode), report


def _selected(
    chunks: Iterator[list[str]], selection: _Selection, watch: _Stopwatch, progress: Progress
) -> Iterator[list[str]]:
    """The kept documents of each chunk; the time between chunks is the consumer's (encoding)."""
    for chunk in chunks:
        watch.lap("read_and_clean")
        kept = selection.keep(chunk)
        watch.lap("filter_and_exact_dedup")
        yield kept
        watch.lap("encode_and_minhash")
    progress("filter and dedup", selection.checked, selection.checked)


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
            len(malformed),
            len(undecodable),
            records,
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


class _Selection:
    """Drops empty, too short, too long and exactly duplicated documents, a chunk at a time in corpus
    order, and counts each reason. The outcome is that of the whole corpus at once: length filters
    look at one document, and a duplicate is judged against every earlier kept one.
    """

    def __init__(self, data: DataParams) -> None:
        self.data = data
        self.steps = ["empty", "too_short", "too_long"] + (["exact_duplicate"] if data.dedup_exact else [])
        self.seen = dict.fromkeys(self.steps, 0)  # documents that reached each step
        self.dropped = dict.fromkeys(self.steps, 0)
        self.kept = 0
        self._texts: set[str] = set()

    @property
    def checked(self) -> int:
        return self.seen["empty"]

    def keep(self, texts: list[str]) -> list[str]:
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        keep = np.ones(len(texts), dtype=bool)
        for step, mask in (
            ("empty", lengths == 0),
            ("too_short", lengths < self.data.min_chars),
            ("too_long", lengths > self.data.max_chars),
        ):
            keep &= ~self._count(step, keep, mask)
        kept = list(compress(texts, keep.tolist()))
        if self.data.dedup_exact:
            duplicate = self._count(
                "exact_duplicate", np.ones(len(kept), dtype=bool), dedup.exact_duplicate_mask(kept, self._texts)
            )
            kept = list(compress(kept, (~duplicate).tolist()))
        self.kept += len(kept)
        return kept

    def outcome(self) -> tuple[dict, list]:
        """The count dropped per reason and each step's documents in and out."""
        dropped = {"empty": 0, "too_short": 0, "too_long": 0, "exact_duplicate": 0, **self.dropped, "near_duplicate": 0}
        if not self.kept:
            counts = ", ".join(f"{reason}={count}" for reason, count in dropped.items())
            raise DataPrepError(f"no document is left after cleaning, filtering and deduplication ({counts})")
        steps = [
            {"step": step, "in": self.seen[step], "out": self.seen[step] - self.dropped[step]} for step in self.steps
        ]
        return dropped, steps

    def _count(self, step: str, keep: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The still kept documents that `mask` drops, counted against `step`."""
        newly = mask & keep
        self.seen[step] += int(keep.sum())
        self.dropped[step] += int(newly.sum())
        return newly


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


def _tokenizer(
    build_dir: Path,
    train_docs: list[str] | None,
    tokenizer: TokenizerParams,
    model: ModelParams,
    seed: int,
    workers: int,
) -> tuple[dict, spm.SentencePieceProcessor]:
    """The tokenizer's manifest entry and processor, after writing it into the build: loaded from
    tokenizer.model_path, or trained on `train_docs` (None when the tokenizer is given)."""
    started = time.perf_counter()
    if tokenizer.model_path is not None:
        model_bytes, origin = load_tokenizer(Path(tokenizer.model_path)), f"tokenizer {tokenizer.model_path}"
    else:
        model_bytes = train_tokenizer(train_docs, tokenizer, model.vocab_size, seed, workers)
        origin = "the trained tokenizer"
    processor = open_tokenizer(model_bytes, tokenizer, model.vocab_size, origin)
    (build_dir / TOKENIZER_NAME).write_bytes(model_bytes)
    info = {
        "file": TOKENIZER_NAME,
        "sha256": hashlib.sha256(model_bytes).hexdigest(),
        "trained": tokenizer.model_path is None,
        "origin": origin,
        "seconds": round(time.perf_counter() - started, 4),
        "vocab_size": model.vocab_size,
        **{name: getattr(tokenizer, name) for name in ("unk_id", "bos_id", "eos_id", "pad_id")},
    }
    return info, processor


def _encode(
    chunks: Iterable[list[str]],
    processor: spm.SentencePieceProcessor,
    workers: int,
    data: DataParams,
    progress: Progress,
    phase: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The token ids of all documents of all chunks concatenated (int32), the number of tokens of each,
    and (when near-dedup is on) their MinHash signatures.

    Batches are encoded from background threads (SentencePiece drops the GIL and runs each batch on the
    `workers` native threads, which the batches queue for) while this thread pulls the next chunk (which
    reads and cleans it, when the chunks come lazily from the inputs) and computes the signatures of
    finished batches, so that work shares the cores with encoding instead of following it.
    """
    token_ids, lengths = _Appended(np.int32), _Appended(np.int64)
    signatures = _Appended(np.uint32, data.minhash_permutations) if data.near_dup_threshold is not None else None
    total: int | None = None  # known once every chunk is in

    def absorb(encoded: Future) -> None:
        pieces = encoded.result()
        batch_lengths = lengths.extend([np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))])
        batch_ids = token_ids.extend(pieces)
        if signatures is not None:
            signatures.extend(
                [dedup.minhash_signatures(batch_ids, batch_lengths, data.shingle_words, data.minhash_permutations)]
            )
        progress(phase, len(lengths), total)

    def submit(documents: list[str]) -> None:
        nonlocal submitted
        waiting.append(encoder.submit(encode_documents, processor, documents, workers, native_threads))
        submitted += len(documents)

    progress(phase, 0, None)
    native_threads = encoding_threads(workers)
    encoder = ThreadPoolExecutor(_BATCHES_IN_FLIGHT, thread_name_prefix="encode")
    waiting: deque[Future] = deque()
    batch: list[str] = []
    submitted = 0
    try:
        with _PROMPT_SWITCHES.lowered():
            for chunk in chunks:
                batch += chunk
                # Whatever there is, up to a full batch, whenever an encoder is free: none waits in a queue,
                # so none starts late and ends after the last ones.
                while batch and sum(not f.done() for f in waiting) < _BATCHES_IN_FLIGHT:
                    submit(batch[:_ENCODE_BATCH_DOCS])
                    batch = batch[_ENCODE_BATCH_DOCS:]
                while waiting and waiting[0].done():
                    absorb(waiting.popleft())
            for size in _last_batches(len(batch)):
                submit(batch[:size])
                batch = batch[size:]
            total = submitted
            while waiting:
                absorb(waiting.popleft())
            progress(phase, submitted, total)  # also when every batch was taken in while chunks still came
    finally:
        encoder.shutdown(cancel_futures=True)  # after a failure, the batches not started yet are dropped
    return token_ids.values(), lengths.values(), None if signatures is None else signatures.values()


class _Appended:
    """An array that batches are appended to, in a buffer that doubles when full. Concatenating the batches
    at the end instead copied every token id and signature once more, into new pages, on the
    single-threaded stretch after encoding; the doublings come while encoding (page faults per prep run
    of 460K tokens: 1,812 -> 883)."""

    def __init__(self, dtype: type, row_width: int | None = None) -> None:
        self._rows = () if row_width is None else (row_width,)
        self._buffer = np.empty((1024, *self._rows), dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def extend(self, parts: list[np.ndarray]) -> np.ndarray:
        """Append the parts, one after another; returns the appended rows (a view)."""
        end = self._size + sum(map(len, parts))
        if end > len(self._buffer):
            grown = np.empty((max(2 * len(self._buffer), end), *self._rows), dtype=self._buffer.dtype)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        added = self._buffer[self._size : end]
        if parts:
            np.concatenate(parts, out=added)
        self._size = end
        return added

    def values(self) -> np.ndarray:
        return self._buffer[: self._size]


def _last_batches(documents: int) -> list[int]:
    """The sizes of the batches that the documents left after reading encode in: halving from a full batch
    down to _LAST_BATCH_DOCS, so that the last ones are small (the last batch's MinHash follows encoding)."""
    sizes = []
    while documents:
        sizes.append(min(_ENCODE_BATCH_DOCS, max(documents // 2, _LAST_BATCH_DOCS), documents))
        documents -= sizes[-1]
    return sizes


class _SwitchInterval:
    """Lowers the interpreter's thread switch interval while Python work here runs beside encoding.

    The encoder thread needs the GIL for a moment before and after every batch. While this thread runs
    Python code (reading, cleaning) it gets it only once the switch interval (5 ms by default) is up,
    and meanwhile the cores that would encode wait (measured: requests took 6 ms at p90, 1.2 ms at
    0.5 ms). The interval is process-wide, so overlapping uses share one saved value.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    @contextmanager
    def lowered(self) -> Iterator[None]:
        with self._lock:
            if not self._users:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.seconds))
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    sys.setswitchinterval(self._saved)


_PROMPT_SWITCHES = _SwitchInterval(0.0005)


def _pack_and_write(
    build_dir: Path,
    split: str,
    token_ids: np.ndarray,
    lengths: np.ndarray,
    order: np.ndarray,
    data: DataParams,
    tokenizer: TokenizerParams,
    model: ModelParams,
) -> dict:
    """Pack the documents at `order` (indices into `lengths`), shuffle the rows and write the split."""
    rows = pack_documents(
        token_ids,
        lengths,
        model.seq_len + 1,
        tokenizer.bos_id if data.add_bos else None,
        tokenizer.eos_id,
        tokenizer.pad_id,
        data.last_row,
        order,
        shuffle=_rng(data.shuffle_seed, split),
    )
    shards = write_shards(rows, build_dir, split, data.rows_per_shard, tokenizer.pad_id)
    return {
        "documents": len(order),
        "tokens": int(lengths[order].sum()) + len(order) * (1 + data.add_bos),
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
