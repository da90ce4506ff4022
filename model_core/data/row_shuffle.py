"""The last map steps of data prep: pack each shard's kept documents into rows of its source's token
stream, then shuffle the rows without ever holding the split.

The stream of a source in a split is every kept document of the source's input shards as [BOS] + ids + [EOS]
in corpus order, so it does not depend on how the corpus was cut into shards (the rows are shuffled
afterwards). Every source packs on its own, so a row holds the documents of one source, which is what lets
training mix the sources by weight: row r of a source is its stream positions [r * row_len, (r + 1) * row_len),
as if the stream were packed in one piece, and `pack_shard` writes the rows that start inside its shard's part
of the stream, reading the first documents of the source's next shards for its last row. Each source's final
partial row is dropped or padded (data.last_row). The split's rows are the sources' rows one source after the
other (`SplitStream`).

The rows are then shuffled by a keyed permutation. Training rows stay in their source's range and are
shuffled within it, `KeyedPermutation(rows of the source, (seed, split, source))`, so the manifest can give
each source's rows as one range; validation rows, read in file order, are shuffled over the whole split,
`KeyedPermutation(rows, (seed, split))`, so any prefix samples every source. `pack_shard` sorts its rows by
position and records where each write bucket's positions begin among them, so `write_bucket`, which owns the
positions of a run of output shards, reads its rows from every pack file with a few positioned reads and
writes them in order: each step holds one input shard's rows or one output shard, never the split.

A job packs a run of input shards, or writes a run of buckets, one after another (`job_runs`): packing a
shard or writing a bucket takes tens of milliseconds, less than a task run of an orchestrator costs.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data.global_dedup import Plan
from model_core.data.packing import PackedRows
from model_core.data.permutation import KeyedPermutation
from model_core.data.shards import shard_name, token_dtype, write_shard

SPLITS = ("train", "validation")
_SPLIT_KEYS = {"train": 1, "validation": 2}
# Tokens of one write bucket: the run of output shards that one write step holds (2 bytes a token while the
# vocabulary fits in uint16) and writes.
BUCKET_TOKENS = 16 << 20


@dataclass(frozen=True)
class Packing:
    """What packing and writing a split needs besides the plan."""

    split: str
    row_len: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    pad_last_row: bool
    seed: int
    rows_per_shard: int
    vocab_size: int
    shards_per_bucket: int  # output shards of one write bucket (`shards_per_bucket`)
    within_sources: bool  # each source's rows shuffled in its own range (training), or over the whole split


@dataclass(frozen=True)
class SplitStream:
    """How a split's stream is laid out over the input shards and the sources: `offsets[i]` is where shard i's
    part starts in the concatenated stream (one more entry: the end), `sources[i]` the source shard i belongs
    to (shards of a source are consecutive, sources in order), `rows[s]` the rows source s packs into."""

    offsets: list[int]
    sources: list[int]
    rows: list[int]

    @classmethod
    def of(cls, tokens: list[int], sources: list[int], source_count: int, packing: Packing) -> SplitStream:
        """From each shard's stream tokens and source."""
        per_source = [0] * source_count
        for count, source in zip(tokens, sources):
            per_source[source] += count
        offsets = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)]).tolist()
        return cls(offsets, list(sources), [rows_of(count, packing) for count in per_source])

    def first_row(self, source: int) -> int:
        """The split-wide number of the source's first row (the sources' rows one after the other)."""
        return sum(self.rows[:source])

    def token_start(self, source: int) -> int:
        return self.offsets[bisect.bisect_left(self.sources, source)]

    def end_shard(self, source: int) -> int:
        """One past the source's last shard."""
        return bisect.bisect_right(self.sources, source)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"offsets": self.offsets, "sources": self.sources, "rows": self.rows}))

    @classmethod
    def load(cls, path: Path) -> SplitStream:
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class PackJob:
    plan_path: Path
    scratch: Path
    packing: Packing
    first_shard: int  # the input shards [first_shard, end_shard)
    end_shard: int


@dataclass(frozen=True)
class WriteJob:
    plan_path: Path
    scratch: Path
    build_dir: Path
    packing: Packing
    rows: int  # the split's
    first_bucket: int  # the write buckets [first_bucket, end_bucket) of `buckets(rows, packing)`
    end_bucket: int


def job_runs(count: int, jobs: int) -> list[tuple[int, int]]:
    """[first, end) of `jobs` consecutive runs of about equal length over `count` items (fewer when short)."""
    jobs = max(1, min(jobs, count))
    bounds = [count * index // jobs for index in range(jobs + 1)]
    return [(first, end) for first, end in zip(bounds, bounds[1:]) if end > first]


def pack_directory(scratch: Path, split: str, shard: int) -> Path:
    """A pack's directory of headerless arrays (`_PackFiles`), which write steps read a range of at a time."""
    return scratch / f"pack-{split}-{shard:06d}"


def stream_lengths(plan: Plan, scratch: Path, split: str, bos: bool) -> tuple[list[int], list[int]]:
    """Per shard: its kept documents of the split and the stream tokens they make."""
    documents, tokens = [], []
    for shard, directory in enumerate(plan.directories):
        chosen = _chosen(plan, scratch, shard, split)
        lengths = np.load(directory / "lengths.npy", mmap_mode="r")
        documents.append(int(chosen.sum()))
        tokens.append(int(lengths[chosen].sum(dtype=np.int64)) + int(chosen.sum()) * (1 + bos))
    return documents, tokens


def _chosen(plan: Plan, scratch: Path, shard: int, split: str) -> np.ndarray:
    validation = np.load(plan.directories[shard] / "validation.npy")
    keep = np.load(plan.keep_path(scratch, shard))
    return keep & (validation if split == "validation" else ~validation)


def rows_of(total_tokens: int, packing: Packing) -> int:
    rows, remainder = divmod(total_tokens, packing.row_len)
    return rows + (1 if remainder and packing.pad_last_row else 0)


def stream_path(scratch: Path, split: str) -> Path:
    return scratch / f"stream-{split}.json"


def pack_shards(job: PackJob) -> dict:
    """`pack_shard` of each input shard of the job."""
    plan = Plan.load(job.plan_path)
    stream = SplitStream.load(stream_path(job.scratch, job.packing.split))
    rows = sum(pack_shard(plan, job.scratch, shard, job.packing, stream) for shard in range(job.first_shard, job.end_shard))
    return {"rows": rows}


def pack_shard(plan: Plan, scratch: Path, shard: int, packing: Packing, stream: SplitStream) -> int:
    """Write the rows that start in this shard's part of its source's stream, sorted by shuffled position;
    their number."""
    source = stream.sources[shard]
    rows, base = stream.rows[source], stream.token_start(source)
    start, end = stream.offsets[shard] - base, stream.offsets[shard + 1] - base
    length = packing.row_len
    output = pack_directory(scratch, packing.split, shard)
    first_row, end_row = -(-start // length), min(-(-end // length), rows)
    split_rows = sum(stream.rows)
    if first_row >= end_row:
        empty = PackedRows(np.empty((0, length), np.int32), np.empty(0, np.int32), np.zeros(1, np.int64))
        _save_pack(output, empty, np.empty(0, np.int64), packing, split_rows)
        return 0
    need = end_row * length - start  # stream tokens from this shard's start to the end of its last row
    tokens, doc_starts = _stream(plan, scratch, shard, packing, need, stream.end_shard(source))
    skip = first_row * length - start
    tokens, doc_starts = tokens[skip:], doc_starts[doc_starts >= skip] - skip
    count = end_row - first_row
    # In the stored type from here on: the rows' shuffle then moves half the bytes, and saving them converts nothing.
    body = np.full(count * length, packing.pad_id, dtype=token_dtype(packing.vocab_size))
    body[: min(len(tokens), len(body))] = tokens[: len(body)]
    rows_tokens = body.reshape(count, length)
    values, row_offsets = _row_doc_starts(doc_starts[doc_starts < min(len(tokens), len(body))], count, length)
    positions = _positions(packing, stream, source, np.arange(first_row, end_row, dtype=np.uint64))
    order = np.argsort(positions)
    _save_pack(output, PackedRows(rows_tokens, values, row_offsets).take(order), positions[order], packing, split_rows)
    return count


def _positions(packing: Packing, stream: SplitStream, source: int, rows: np.ndarray) -> np.ndarray:
    """Where the source's rows (numbered in its stream) go in the split's files."""
    first, split = stream.first_row(source), _SPLIT_KEYS[packing.split]
    if packing.within_sources:
        order = KeyedPermutation(stream.rows[source], (packing.seed, split, source))
        return first + order.inverse(rows).astype(np.int64)
    return KeyedPermutation(sum(stream.rows), (packing.seed, split)).inverse(rows + np.uint64(first)).astype(np.int64)


def _save_pack(directory: Path, rows: PackedRows, positions: np.ndarray, packing: Packing, split_rows: int) -> None:
    """The pack's arrays, and where each write bucket's rows begin: at every bucket's first position, the
    pack's first row at or after it and that row's first document start (one more entry for the end)."""
    directory.mkdir()
    files = _PackFiles(directory, packing)
    bounds = [first * packing.rows_per_shard for first, _ in buckets(split_rows, packing)] + [np.iinfo(np.int64).max]
    first_rows = np.searchsorted(positions, bounds)
    files.write("bounds", np.stack([first_rows, rows.doc_start_offsets[first_rows]], axis=1))
    files.write("tokens", rows.tokens)
    files.write("positions", positions)
    files.write("starts", rows.doc_start_values)
    files.write("start_offsets", rows.doc_start_offsets)


def packed_rows(scratch: Path, packing: Packing, shard: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows that `pack_shard` wrote for an input shard: their positions in the shuffled split and the rows,
    (rows, row_len) in their stored type, memory-mapped."""
    directory = pack_directory(scratch, packing.split, shard)
    positions = np.fromfile(directory / "positions", dtype=np.int64)
    if not len(positions):  # a shard where no row starts: an empty file cannot be mapped
        return positions, np.empty((0, packing.row_len), token_dtype(packing.vocab_size))
    rows = np.memmap(directory / "tokens", dtype=token_dtype(packing.vocab_size), mode="r")
    return positions, rows.reshape(-1, packing.row_len)


class _PackFiles:
    """A pack step's arrays as headerless files whose types the packing decides. A write step reads one
    bucket's range of each with positioned reads: with .npy files, opening every pack's arrays for every
    bucket (parsing headers, mapping them) took longer than reading the rows, and it grows with packs x
    buckets; and no write step keeps the pages of every pack file mapped."""

    def __init__(self, directory: Path, packing: Packing) -> None:
        self.directory = directory
        self.types = {
            "bounds": np.dtype(np.int64),
            "tokens": np.dtype(token_dtype(packing.vocab_size)),
            "positions": np.dtype(np.int64),
            "starts": np.dtype(np.int32),
            "start_offsets": np.dtype(np.int64),
        }
        self.row_len = packing.row_len

    def write(self, name: str, values: np.ndarray) -> None:
        np.ascontiguousarray(values, dtype=self.types[name]).tofile(self.directory / name)

    def read(self, name: str, first: int, count: int) -> np.ndarray:
        """Elements [first, first + count) of the flat array `name`."""
        dtype = self.types[name]
        return np.fromfile(self.directory / name, dtype=dtype, count=count, offset=first * dtype.itemsize)

    def bucket(self, bucket: int) -> tuple[np.ndarray, PackedRows]:
        """Positions and rows (tokens in their stored type) of the write bucket's positions."""
        (lo, first), (hi, last) = self.read("bounds", 2 * bucket, 4).reshape(2, 2).tolist()
        tokens = self.read("tokens", lo * self.row_len, (hi - lo) * self.row_len).reshape(hi - lo, self.row_len)
        offsets = self.read("start_offsets", lo, hi - lo + 1) - first
        return self.read("positions", lo, hi - lo), PackedRows(tokens, self.read("starts", first, last - first), offsets)


def _stream(
    plan: Plan, scratch: Path, shard: int, packing: Packing, need: int, end_shard: int
) -> tuple[np.ndarray, np.ndarray]:
    """At least `need` tokens of the source's stream from the start of `shard`'s part (fewer at the end of the
    source, whose shards end before `end_shard`), and the stream positions where documents start."""
    parts, starts, have = [], [], 0
    while have < need and shard < end_shard:
        tokens, doc_starts = _shard_stream(plan, scratch, shard, packing, need - have)
        parts.append(tokens)
        starts.append(doc_starts + have)
        have += len(tokens)
        shard += 1
    if not parts:
        return np.empty(0, np.int32), np.empty(0, np.int64)
    return np.concatenate(parts), np.concatenate(starts)


def _shard_stream(plan: Plan, scratch: Path, shard: int, packing: Packing, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The shard's part of the stream, its first documents until `limit` tokens are covered. Built with
    masks (a byte per token) rather than index arrays (eight bytes per token), so packing a shard takes a
    few times its token bytes."""
    directory = plan.directories[shard]
    chosen = _chosen(plan, scratch, shard, packing.split)
    lengths = np.load(directory / "lengths.npy")
    has_bos = packing.bos_id is not None
    doc_lengths = lengths[chosen].astype(np.int64) + 1 + has_bos
    doc_starts = np.cumsum(doc_lengths) - doc_lengths
    taken = int(np.searchsorted(doc_starts, limit, side="left"))  # documents starting before the limit
    chosen[np.flatnonzero(chosen)[taken:]] = False
    doc_lengths, doc_starts = doc_lengths[:taken], doc_starts[:taken]
    stream = np.empty(int(doc_lengths.sum()), dtype=np.int32)
    body = np.ones(len(stream), dtype=bool)
    body[doc_starts + doc_lengths - 1] = False
    if has_bos:
        body[doc_starts] = False
    token_ids = np.load(directory / "tokens.npy", mmap_mode="r")
    if chosen.all():
        stream[body] = token_ids
    else:
        stream[body] = token_ids[np.repeat(chosen, lengths)]
    stream[doc_starts + doc_lengths - 1] = packing.eos_id
    if has_bos:
        stream[doc_starts] = packing.bos_id
    return stream, doc_starts


def _row_doc_starts(doc_starts: np.ndarray, rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of each row's document-start offsets, always including 0 (a row starts a sequence)."""
    row_starts = np.arange(rows, dtype=np.int64) * length
    starts = np.union1d(row_starts, doc_starts)
    offsets = np.searchsorted(starts, np.append(row_starts, rows * length)).astype(np.int64)
    return (starts % length).astype(np.int32), offsets


def output_shards(rows: int, rows_per_shard: int) -> int:
    return -(-rows // rows_per_shard)


def shards_per_bucket(rows_per_shard: int, row_len: int) -> int:
    """Output shards of about BUCKET_TOKENS tokens in all: one write step's."""
    return max(1, BUCKET_TOKENS // (rows_per_shard * row_len))


def buckets(rows: int, packing: Packing) -> list[tuple[int, int]]:
    """Runs of output shards, [first, end), of `packing.shards_per_bucket` each (the last may be shorter)."""
    shards, per_bucket = output_shards(rows, packing.rows_per_shard), packing.shards_per_bucket
    return [(first, min(first + per_bucket, shards)) for first in range(0, shards, per_bucket)]


def write_buckets(job: WriteJob) -> list[dict]:
    """`write_bucket` of each write bucket of the job; the manifest entries of their output shards."""
    plan = Plan.load(job.plan_path)
    runs = buckets(job.rows, job.packing)
    return [
        entry
        for bucket in range(job.first_bucket, job.end_bucket)
        for entry in write_bucket(plan, job, bucket, *runs[bucket])
    ]


def write_bucket(plan: Plan, job: WriteJob, bucket: int, first_shard: int, end_shard: int) -> list[dict]:
    """Write output shards [first_shard, end_shard): their rows are read from every pack file at once (one
    read per pack: the bucket's positions are a contiguous run of each), then written a shard at a time."""
    packing = job.packing
    low = first_shard * packing.rows_per_shard
    pieces = [
        _PackFiles(pack_directory(job.scratch, packing.split, shard), packing).bucket(bucket)
        for shard in range(len(plan.directories))
    ]
    positions = np.concatenate([positions for positions, _ in pieces])
    order = np.argsort(positions)
    rows = PackedRows(
        np.concatenate([rows.tokens for _, rows in pieces]),
        np.concatenate([rows.doc_start_values for _, rows in pieces]),
        _joined_offsets([rows.doc_start_offsets for _, rows in pieces]),
    )
    del pieces
    entries = []
    for index in range(first_shard, end_shard):
        first = index * packing.rows_per_shard - low
        shard = rows.take(order[first : first + packing.rows_per_shard])
        entries.append(write_shard(job.build_dir / shard_name(packing.split, index), shard, packing.pad_id, packing.vocab_size))
    return entries


def _joined_offsets(parts: list[np.ndarray]) -> np.ndarray:
    joined, base = [np.zeros(1, np.int64)], 0
    for offsets in parts:
        joined.append(offsets[1:] + base)
        base += int(offsets[-1])
    return np.concatenate(joined)
