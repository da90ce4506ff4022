"""The reduce steps of data prep: exact and near duplicates across every shard of the corpus, each
found in partitions small enough for one worker's memory.

Documents are numbered in corpus order (shard by shard, the order of the inputs). Both reduces read
the map steps' arrays through memory maps and keep only the entries of their own partition:

- exact: the 128-bit text hashes, partitioned by hash; within a partition, every document whose hash
  an earlier document has is a duplicate. The first occurrence in the corpus is kept, as when the
  corpus is read in one pass.
- near: the LSH band keys of the MinHash signatures of the documents that survived exact dedup (the
  banding of dedup.py), one entry per (document, band), partitioned by key. Documents sharing a band
  key are candidate pairs; a pair is close when the signatures agree on at least `threshold` of their
  positions. The close pairs of all partitions are then settled in corpus order, as dedup.py does: a
  document is dropped when it is close to an earlier document that was kept.

Each partition writes its result to a file (duplicate document numbers, or close pairs); only their
union is held at once, and it grows with the duplicates, not the corpus.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data import dedup
from model_core.data.shard_map import mix64

_PAIRS_AT_A_TIME = 1 << 15  # candidate pairs compared at once: two (pairs, permutations) uint32 arrays of 8 MiB
# Bytes of partition entries a reduce worker may hold: partitions are counted from the corpus.
PARTITION_BYTES = 256 << 20
# Documents from which a reduce runs a partition per worker. Below them a partition takes well under a
# second, less than a worker's task run costs: near dedup ~35 us a document (95K took 3.5 s), exact ~1 us.
NEAR_PARALLEL_DOCUMENTS = 1 << 16
EXACT_PARALLEL_DOCUMENTS = 1 << 21
EXACT_ENTRY_BYTES = 24  # two hash words and a document number
NEAR_ENTRY_BYTES = 16  # a band key and a document number, per band
_OPEN, _KEPT, _DROPPED = 0, 1, 2  # a document's state while near duplicates are settled


@dataclass(frozen=True)
class Plan:
    """The map steps' result directories in corpus order, and the number of the first document of each."""

    directories: list[Path]
    first_documents: list[int]  # one more entry than directories: the total at the end

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"directories": [str(d) for d in self.directories], "first": self.first_documents}))

    @classmethod
    def load(cls, path: Path) -> Plan:
        raw = json.loads(path.read_text())
        return cls([Path(d) for d in raw["directories"]], raw["first"])

    @property
    def documents(self) -> int:
        return self.first_documents[-1]

    def keep_path(self, scratch: Path, shard: int) -> Path:
        return scratch / f"keep-{shard:06d}.npy"


@dataclass(frozen=True)
class ReduceJob:
    plan_path: Path
    scratch: Path  # keep masks (near reduce) and partition outputs
    partition: int
    partitions: int
    threshold: float | None = None  # near reduce only

    @property
    def output(self) -> Path:
        kind = "near" if self.threshold is not None else "exact"
        return self.scratch / f"{kind}-{self.partition:05d}.npy"


def partitions_for(documents: int, bytes_per_document: int, workers: int, parallel_from: int) -> int:
    """Enough partitions that each holds about PARTITION_BYTES, and one per worker once the corpus has
    `parallel_from` documents (the result is the same for any number of partitions: a key always lands in
    exactly one)."""
    least = workers if documents >= parallel_from else 1
    return max(least, math.ceil(documents * bytes_per_document / PARTITION_BYTES))


def exact_partition(job: ReduceJob) -> dict:
    """Write the sorted numbers of the documents in this hash partition that repeat an earlier text."""
    plan = Plan.load(job.plan_path)
    words, numbers = [], []
    for shard, directory in enumerate(plan.directories):
        hashes = np.load(directory / "hashes.npy", mmap_mode="r")
        mine = np.flatnonzero(hashes[:, 0] % np.uint64(job.partitions) == job.partition)
        words.append(np.asarray(hashes[mine]))
        numbers.append(mine + plan.first_documents[shard])
    hashes = np.concatenate(words) if words else np.empty((0, 2), dtype=np.uint64)
    number = np.concatenate(numbers) if numbers else np.empty(0, dtype=np.int64)
    order = np.lexsort((number, hashes[:, 1], hashes[:, 0]))
    hashes, number = hashes[order], number[order]
    repeat = (hashes[1:] == hashes[:-1]).all(axis=1)
    duplicates = np.sort(number[1:][repeat])
    np.save(job.output, duplicates)
    return {"duplicates": len(duplicates)}


def near_partition(job: ReduceJob) -> dict:
    """Write the close pairs (earlier, later document number) among the candidates of this key partition.

    Two passes over the shards: the partition's band keys first, then the signatures of the documents
    that share a key with another one, held while their pairs are compared (gathering two rows per pair
    through the shards' memory maps cost many times more; holding every document's signature grew with the
    corpus)."""
    plan = Plan.load(job.plan_path)
    keys, numbers = [], []
    for shard, kept, signatures in _kept_signatures(plan, job.scratch):
        band_keys = _tagged_band_keys(np.asarray(signatures[kept]), job.threshold)
        mine = band_keys % np.uint64(job.partitions) == job.partition
        keys.append(band_keys[mine])
        numbers.append(np.broadcast_to((kept + plan.first_documents[shard])[:, None], band_keys.shape)[mine])
    key = np.concatenate(keys) if keys else np.empty(0, dtype=np.uint64)
    number = np.concatenate(numbers).astype(np.int64) if numbers else np.empty(0, dtype=np.int64)
    order = np.lexsort((number, key))
    key, number = key[order], number[order]
    shared = np.zeros(len(key), dtype=bool)
    shared[1:] = key[1:] == key[:-1]
    shared[:-1] |= shared[1:]
    key, number = key[shared], number[shared]
    member = np.unique(number)  # ascending: corpus order
    signatures = _signatures_of(plan, member)
    needed = math.ceil(job.threshold * signatures.shape[1] - 1e-9) if len(member) else 0
    # Pairs are listed as rows of `member` (ascending like the numbers), and a close pair is kept as one
    # int64 code, earlier * members + later, whose sort order is the pairs' order: a pair sharing several
    # bands comes up several times, and dropping repeats of a code is a 1-D sort (np.unique over rows
    # cost 10x more). The members are held in memory, so members**2 is far below 2**63.
    rank = np.searchsorted(member, number)
    members = np.int64(len(member))
    close, candidates = [], 0
    for earlier, later in _group_pairs(key, rank):
        candidates += len(earlier)
        agree = _agreements(signatures[earlier], signatures[later]) >= needed
        close.append(earlier[agree] * members + later[agree])
    codes = np.unique(np.concatenate(close)) if close else np.empty(0, dtype=np.int64)
    pairs = np.stack([member[codes // members], member[codes % members]], axis=1).astype(np.int64)
    np.save(job.output, pairs)
    return {"candidates": candidates, "close": len(pairs)}


def _agreements(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The number of positions where each pair of signature rows agrees, summed in the smallest type that
    holds the row length (bytes for up to 255 positions: a narrower sum moves less memory than int64)."""
    return np.add.reduce((first == second).view(np.uint8), axis=1, dtype=np.min_scalar_type(first.shape[1]))


def _kept_signatures(plan: Plan, scratch: Path):
    """Per shard: its number, the indices of its documents kept after exact dedup, its signatures (mapped)."""
    for shard, directory in enumerate(plan.directories):
        kept = np.flatnonzero(np.load(plan.keep_path(scratch, shard)))
        yield shard, kept, np.load(directory / "signatures.npy", mmap_mode="r")


def _signatures_of(plan: Plan, numbers: np.ndarray) -> np.ndarray:
    """The signature rows of the given ascending document numbers."""
    parts = []
    for shard, directory in enumerate(plan.directories):
        first, end = plan.first_documents[shard], plan.first_documents[shard + 1]
        lo, hi = np.searchsorted(numbers, (first, end))
        if hi > lo:
            parts.append(np.load(directory / "signatures.npy", mmap_mode="r")[numbers[lo:hi] - first])
    return np.concatenate(parts) if parts else np.empty((0, 0), dtype=np.uint32)


def _tagged_band_keys(signatures: np.ndarray, threshold: float) -> np.ndarray:
    """(documents, bands) band keys of dedup.py, each mixed with its band's number, so that one key
    space holds every band and equal keys mean the same band and the same band key."""
    keys = dedup._band_keys(signatures, dedup.rows_per_band(signatures.shape[1], threshold))
    return mix64(keys ^ (np.arange(keys.shape[1], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)))


def _group_pairs(key: np.ndarray, number: np.ndarray):
    """Batches of (earlier, later) pairs of numbers with an equal key (sorted by key, then number),
    each pair once per key, at most about _PAIRS_AT_A_TIME a batch: small groups together, a group with
    more pairs than that (boilerplate shared by thousands of files) a run of its rows at a time."""
    if not len(key):
        return
    starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    sizes = np.diff(np.append(starts, len(key)))
    pair_counts = sizes * (sizes - 1) // 2
    for start, size in zip(starts[pair_counts > _PAIRS_AT_A_TIME].tolist(), sizes[pair_counts > _PAIRS_AT_A_TIME].tolist()):
        yield from _large_group_pairs(number[start : start + size])
    small = (sizes > 1) & (pair_counts <= _PAIRS_AT_A_TIME)
    starts, sizes = starts[small], sizes[small]
    pairs_so_far = np.cumsum(sizes * (sizes - 1) // 2)
    first = 0
    while first < len(starts):
        before = int(pairs_so_far[first - 1]) if first else 0
        last = max(first + 1, int(np.searchsorted(pairs_so_far, before + _PAIRS_AT_A_TIME, side="right")))
        yield _pairs_within(number, starts[first:last], sizes[first:last])
        first = last


def _large_group_pairs(members: np.ndarray):
    """The pairs of one large group, a block of earlier members at a time (each with all later ones)."""
    size = len(members)
    block = max(1, _PAIRS_AT_A_TIME // size)
    for first in range(0, size - 1, block):
        earlier = np.arange(first, min(first + block, size - 1))
        later_count = size - 1 - earlier
        left = np.repeat(earlier, later_count)
        right = left + 1 + np.arange(len(left)) - np.repeat(np.cumsum(later_count) - later_count, later_count)
        yield members[left], members[right]


def _pairs_within(number: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of positions inside each group [start, start + size), as document numbers."""
    position = np.repeat(starts, sizes) + np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    later_count = np.repeat(starts + sizes - 1, sizes) - position
    first = np.repeat(position, later_count)
    second = first + 1 + np.arange(len(first)) - np.repeat(np.cumsum(later_count) - later_count, later_count)
    return number[first], number[second]


def settle_near_duplicates(pairs: np.ndarray) -> np.ndarray:
    """The sorted numbers of the documents dropped as near duplicates, given every close pair (earlier,
    later): in corpus order, a document goes when it is close to an earlier document that was kept.

    Settled in rounds over all the pairs at once, not in a pass over them a pair at a time in Python, which
    ran on one core while the workers waited: a document none of whose open pairs has an earlier document
    left is kept, and then the later documents of its pairs are dropped; pairs whose earlier document was
    dropped, or whose later one is settled, close. The earliest unsettled document always settles, so the
    rounds end; there are as many as the longest chain of alternately kept and dropped versions.
    """
    if len(pairs) and (pairs[:, 0] >= pairs[:, 1]).any():
        raise ValueError("every close pair must be (earlier, later) document numbers")
    documents, index = np.unique(pairs, return_inverse=True)
    earlier, later = index.reshape(pairs.shape).T
    state = np.full(len(documents), _OPEN, dtype=np.int8)
    while len(earlier):
        waits = np.zeros(len(documents), dtype=bool)
        waits[later] = True
        state[(state == _OPEN) & ~waits] = _KEPT
        state[later[state[earlier] == _KEPT]] = _DROPPED
        still_open = (state[earlier] != _DROPPED) & (state[later] == _OPEN)
        earlier, later = earlier[still_open], later[still_open]
    return documents[state == _DROPPED].astype(np.int64)


def drop_from_keep_masks(plan: Plan, scratch: Path, dropped_files: list[Path] | None, dropped: np.ndarray | None) -> int:
    """Clear the dropped documents (sorted number arrays: in files, or given) in the shards' keep masks;
    returns how many were cleared."""
    sources = [np.load(path, mmap_mode="r") for path in dropped_files or []]
    if dropped is not None:
        sources.append(dropped)
    cleared = 0
    for shard in range(len(plan.directories)):
        first, end = plan.first_documents[shard], plan.first_documents[shard + 1]
        path = plan.keep_path(scratch, shard)
        keep = np.load(path)
        for numbers in sources:
            lo, hi = np.searchsorted(numbers, (first, end))
            keep[np.asarray(numbers[lo:hi]) - first] = False
            cleared += int(hi - lo)
        np.save(path, keep)
    return cleared
