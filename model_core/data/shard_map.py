"""The map steps of data prep: one input shard at a time, in bounded memory.

`sample_shard` (only when a tokenizer is trained) reads, cleans and filters a shard and keeps the
`tokenizer.training_sentences` lines of its training documents with the smallest keyed hashes: merged
over all shards, the lines with the smallest keys in the corpus are a deterministic uniform sample of
them (bottom-k sampling, which, unlike a reservoir, needs no order and merges across workers).

`map_shard` reads, cleans and filters the shard, drops the repeats of a text inside it, hashes each
document's text (128-bit BLAKE2b), decides its split from the keyed hash, tokenizes, and computes the
MinHash signatures; it writes the arrays to a directory of its own, which later runs reuse while the
shard's bytes, the params and the tokenizer are the same (incremental prep of a growing corpus).

A document's split comes from its hash alone (`validation_fraction` of the hash range is held out), so
every worker decides it on its own, the same text is always in the same split, and no shuffle of the
whole corpus is needed. Repeats across shards are dropped later, in the exact-dedup reduce.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import sentencepiece as spm

from model_core.data import dedup
from model_core.data.cleaning import clean_texts
from model_core.data.input_shards import InputShard, read_shard
from model_core.data.shards import token_dtype
from model_core.data.sources import FileReport
from model_core.data.tokenizer import encode_documents, encoding_threads, open_tokenizer
from model_core.storage import build_directory
from params.schema import DataParams, TokenizerParams

RESULT_NAME = "result.json"
MAX_REPORTED_RECORDS = 20
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_ENCODE_BATCH_DOCS = 1024  # small enough that minhashing one batch overlaps encoding the next
_LAST_BATCH_DOCS = 128  # the smallest of the last batches, so little MinHash follows encoding (small batches cost)
# Batches handed to the encoder at once: while one turns its ids into arrays under the GIL (~1.5 ms per
# 1024 documents), the next keeps the cores encoding. They queue for one pool of native threads, which
# take a batch's documents one at a time, so the last batch ends on all cores together.
_BATCHES_IN_FLIGHT = 2
_CLEAN_CHUNK_DOCS = 512  # cleaned at a time, so that encoding starts after the first chunk, not the shard
FILTER_STEPS = ("empty", "too_short", "too_long")


def worker_ready(_job: object) -> int:
    """Nothing: a job that starts a worker process ahead of the map step, which then finds this module's
    imports (numpy, pyarrow, sentencepiece) done. Its process id."""
    return os.getpid()


@dataclass(frozen=True)
class ShardJob:
    """One input shard and everything its map step needs; `output` is its result directory."""

    shard: InputShard
    data: DataParams
    tokenizer: TokenizerParams
    vocab_size: int
    threads: int
    output: Path
    docstring_cache: Path
    tokenizer_path: Path | None = None  # map_shard only
    vocab_padding: int = 0  # rows of the model's vocabulary no token uses


def text_hashes(texts: list[str]) -> np.ndarray:
    """(documents, 2) uint64: 128-bit BLAKE2b of each text (collisions at 10^12 documents: ~1e-15)."""
    digests = b"".join(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest() for text in texts)
    return np.frombuffer(digests, dtype="<u8").reshape(len(texts), 2).astype(np.uint64)


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a copy: spreads every input bit over all 64 output bits."""
    values = np.asarray(values, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        values ^= values >> np.uint64(30)
        values *= np.uint64(0xBF58476D1CE4E5B9)
        values ^= values >> np.uint64(27)
        values *= np.uint64(0x94D049BB133111EB)
        values ^= values >> np.uint64(31)
    return values


def keyed(hashes: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """A uint64 key per document, uniformly spread and independent for each (seed, stream)."""
    salt = mix64(np.array([(seed * _GOLDEN + stream) & _MASK64], dtype=np.uint64))
    return mix64(hashes[:, 0] ^ mix64(hashes[:, 1] ^ salt))


SPLIT_STREAM, LINE_STREAM = 1, 2


def is_validation(hashes: np.ndarray, data: DataParams) -> np.ndarray:
    threshold = np.uint64(min(int(data.validation_fraction * 2.0**64), _MASK64))
    return keyed(hashes, data.shuffle_seed, SPLIT_STREAM) < threshold


class _Counts:
    """Documents met and dropped per filter, and the shard's read report, as the result JSON keeps them."""

    def __init__(self, data: DataParams) -> None:
        self.data = data
        self.seen = dict.fromkeys((*FILTER_STEPS, "exact_duplicate"), 0)
        self.dropped = dict.fromkeys((*FILTER_STEPS, "exact_duplicate"), 0)
        self._hashes: set[bytes] = set()
        self.characters: list[int] = []  # of each selected document

    def select(self, texts: list[str]) -> tuple[list[str], np.ndarray]:
        """The texts that pass the length filters and are not repeats of an earlier one in this shard."""
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        keep = np.ones(len(texts), dtype=bool)
        for step, mask in (
            ("empty", lengths == 0),
            ("too_short", lengths < self.data.min_chars),
            ("too_long", lengths > self.data.max_chars),
        ):
            self.seen[step] += int(keep.sum())
            dropped = mask & keep
            self.dropped[step] += int(dropped.sum())
            keep &= ~dropped
        kept = [text for text, flag in zip(texts, keep.tolist()) if flag]
        hashes = text_hashes(kept)
        if self.data.dedup_exact:
            self.seen["exact_duplicate"] += len(kept)
            first = np.ones(len(kept), dtype=bool)
            for index, digest in enumerate(map(bytes, hashes)):
                if digest in self._hashes:
                    first[index] = False
                else:
                    self._hashes.add(digest)
            self.dropped["exact_duplicate"] += int((~first).sum())
            kept = [text for text, flag in zip(kept, first.tolist()) if flag]
            hashes = hashes[first]
        self.characters += map(len, kept)
        return kept, hashes


def _documents(job: ShardJob, report: FileReport, counts: _Counts, hashes: list[np.ndarray]) -> Iterator[list[str]]:
    """The shard's selected documents a chunk at a time; their hashes are appended to `hashes`."""
    for texts in read_shard(job.shard, report, job.docstring_cache):
        for first in range(0, len(texts), _CLEAN_CHUNK_DOCS):
            kept, kept_hashes = counts.select(clean_texts(texts[first : first + _CLEAN_CHUNK_DOCS], job.data.normalize_unicode))
            hashes.append(kept_hashes)
            yield kept


def _report(shard: InputShard, report: FileReport, counts: _Counts, bytes_read: int) -> dict:
    path = report.path
    malformed = [f"{path}:{line}: {reason}" for line, reason in report.malformed]
    undecodable = [f"{path}:{line}: undecodable bytes replaced" for line in report.undecodable_lines]
    return {
        "shard": shard.name,
        "records": report.records,
        "malformed": len(malformed),
        "undecodable": len(undecodable),
        "examples": (malformed + undecodable)[:MAX_REPORTED_RECORDS],
        "first_malformed": malformed[0] if malformed else None,
        "seen": counts.seen,
        "dropped": counts.dropped,
        "bytes": bytes_read,
    }


def shard_size(shard: InputShard) -> int:
    path = shard.input.path
    if not path.is_file():
        return 0
    stop = path.stat().st_size if shard.stop is None or shard.input.kind == "parquet" else shard.stop
    return stop - (0 if shard.input.kind == "parquet" else shard.start)


def sample_shard(job: ShardJob) -> dict:
    """Keep the shard's `training_sentences` training lines with the smallest keys (`LINE_STREAM`)."""
    cached = finished_result(job.output)
    if cached is not None:
        return cached
    report, counts, hashes = FileReport(job.shard.input.path), _Counts(job.data), []
    keys, lines = np.empty(0, dtype=np.uint64), []
    limit = job.tokenizer.training_sentences
    for texts in _documents(job, report, counts, hashes):
        training = ~is_validation(hashes[-1], job.data)
        chunk_lines, line_hashes = [], []
        for text, digest in zip((t for t, keep in zip(texts, training.tolist()) if keep), hashes[-1][training]):
            parts = [line for line in text.split("\n") if line.strip()]
            chunk_lines += parts
            line_hashes.append(np.column_stack([np.full(len(parts), digest[0]), digest[1] ^ np.arange(len(parts), dtype=np.uint64)]))
        if not chunk_lines:
            continue
        keys = np.concatenate([keys, keyed(np.concatenate(line_hashes), job.data.shuffle_seed, LINE_STREAM)])
        lines += chunk_lines
        if len(keys) > 2 * limit:
            keys, lines = smallest_keys(keys, lines, limit)
    keys, lines = smallest_keys(keys, lines, limit)
    order = np.argsort(keys, kind="stable")
    table = pa.table({"key": pa.array(keys[order]), "line": pa.array([lines[i] for i in order.tolist()], pa.large_string())})
    documents = sum(len(chunk) for chunk in hashes)
    result = {**_report(job.shard, report, counts, shard_size(job.shard)), "documents": documents, "lines": len(lines)}

    def write(directory: Path) -> None:
        with pa.OSFile(str(directory / "sample.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        (directory / RESULT_NAME).write_text(json.dumps(result))

    _commit_result(job.output, write)
    return result


def smallest_keys(keys: np.ndarray, lines: list[str], limit: int) -> tuple[np.ndarray, list[str]]:
    """The `limit` lines with the smallest keys (a key met twice is the same line of the same text: once)."""
    keys, first = np.unique(keys, return_index=True)
    keep = first[:limit]
    return keys[:limit], [lines[i] for i in keep.tolist()]


def read_sample(directory: Path) -> tuple[np.ndarray, list[str]]:
    with pa.memory_map(str(directory / "sample.arrow")) as source:
        table = pa.ipc.open_file(source).read_all()
    return table.column("key").to_numpy(), table.column("line").to_pylist()


def map_shard(job: ShardJob) -> dict:
    """Read, clean, filter, dedup inside the shard, split, tokenize and minhash one shard to its directory."""
    cached = finished_result(job.output)
    if cached is not None:
        return cached
    started = time.perf_counter()
    model_bytes = job.tokenizer_path.read_bytes()
    processor = open_tokenizer(model_bytes, job.tokenizer, job.vocab_size, f"tokenizer {job.tokenizer_path}", job.vocab_padding)
    report, counts, hashes = FileReport(job.shard.input.path), _Counts(job.data), []
    token_ids, lengths, signatures = _encode(_documents(job, report, counts, hashes), processor, job.threads, job.data)
    all_hashes = np.concatenate(hashes) if hashes else np.empty((0, 2), dtype=np.uint64)
    result = {
        **_report(job.shard, report, counts, shard_size(job.shard)),
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "seconds": round(time.perf_counter() - started, 3),
    }

    def write(directory: Path) -> None:
        np.save(directory / "hashes.npy", all_hashes)
        np.save(directory / "validation.npy", is_validation(all_hashes, job.data))
        np.save(directory / "lengths.npy", lengths.astype(np.int32))
        np.save(directory / "characters.npy", np.array(counts.characters, dtype=np.int64))
        np.save(directory / "tokens.npy", token_ids.astype(token_dtype(job.vocab_size)))
        if signatures is not None:
            np.save(directory / "signatures.npy", signatures)
        (directory / RESULT_NAME).write_text(json.dumps(result))

    _commit_result(job.output, write)
    return result


def finished_result(directory: Path) -> dict | None:
    """The result of a sample or map job whose directory is there (marked reused), or None."""
    try:
        return {**json.loads((directory / RESULT_NAME).read_text()), "reused": True}
    except (OSError, ValueError):
        return None


def _commit_result(final: Path, write: Callable[[Path], None]) -> None:
    """Build a job's directory and commit it as `final`: a killed or failed map step never leaves a result
    that a later run would take for a finished one. When another worker finished the same shard first,
    its result is kept."""
    try:
        build_directory(final, write, replace=False)
    except FileExistsError:
        if not (final / RESULT_NAME).is_file():
            raise


def _encode(
    chunks: Iterable[list[str]], processor: spm.SentencePieceProcessor, workers: int, data: DataParams
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

    def absorb(encoded: Future) -> None:
        pieces = encoded.result()
        batch_lengths = lengths.extend([np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))])
        batch_ids = token_ids.extend(pieces)
        if signatures is not None:
            signatures.extend(
                [dedup.minhash_signatures(batch_ids, batch_lengths, data.shingle_words, data.minhash_permutations)]
            )

    def submit(documents: list[str]) -> None:
        nonlocal submitted
        waiting.append(encoder.submit(encode_documents, processor, documents, workers, native_threads))
        submitted += len(documents)

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
            while waiting:
                absorb(waiting.popleft())
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
    and meanwhile the cores that would encode wait (benchmarks/README.md, "Data prep"). The interval is
    process-wide, so overlapping uses share one saved value.
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


