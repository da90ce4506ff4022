"""Exact and near-duplicate detection.

Exact duplicates are documents whose cleaned text already appeared. Near duplicates are found after
tokenization, on shingles of `shingle_tokens` consecutive token ids: a MinHash signature per document,
then LSH banding: documents whose signatures agree on a whole band become candidates, and a candidate
is a duplicate when its signature agrees with an earlier kept document's on at least `threshold` of the
positions (the MinHash estimate of the Jaccard similarity of their shingle sets).

The signature is one-permutation MinHash with optimal densification (Li, Owen and Zhang 2012;
Shrivastava 2017): one 64-bit hash per shingle picks a bin (one of the `permutations` signature
positions) and a 32-bit value, each position keeps the smallest value of its bin, and an empty
position takes the value of the first non-empty one along a fixed random probe order of its own.
Two documents then agree on a position with probability equal to their Jaccard similarity, as with
`permutations` independent hash functions, at the cost of one hash per shingle instead of
`permutations`. (Borrowing from the next non-empty position instead is cheaper, but it makes the
positions of a short document agree or disagree together, which makes more of them LSH candidates and
near duplicates than their Jaccard similarity warrants; benchmarks/README.md, "Data prep".) Every hash is seeded and
platform-independent, and all of it is numpy: candidates are listed as pairs of documents that share a
band and compared at once, and only the close pairs reach a Python loop, which settles them in corpus
order.
"""

from __future__ import annotations

import functools
import math

import numpy as np

_SEED = 0x5EED
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CANDIDATE_RECALL = 0.99  # LSH bands are chosen so a pair at the threshold is a candidate this often
_MAX_PAIRS_PER_DOCUMENT = 16  # more candidate pairs than this: some key is shared very widely
_PAIRS_AT_A_TIME = 1 << 16  # signature pairs compared at once, to bound the memory
_SHINGLES_AT_A_TIME = 1 << 15  # windows hashed at a time: a block's uint64 arrays fit in a core's L2 cache
_EMPTY = np.iinfo(np.uint32).max  # a signature slot no shingle has reached yet


def exact_duplicate_mask(texts: list[str], seen: set[str] | None = None) -> np.ndarray:
    """True for every document whose text already appeared earlier, here or in `seen` (the texts of
    earlier batches, which this one's are added to)."""
    seen = set() if seen is None else seen
    duplicate = []
    for text in texts:
        duplicate.append(text in seen)
        seen.add(text)
    return np.array(duplicate, dtype=bool)


def near_duplicate_mask(signatures: np.ndarray, threshold: float) -> np.ndarray:
    """True for every document whose estimated Jaccard similarity with an earlier kept one is >= threshold,
    given the `minhash_signatures` of all documents in corpus order."""
    permutations = signatures.shape[1]
    keys = _band_keys(signatures, rows_per_band(permutations, threshold))
    needed_matches = math.ceil(threshold * permutations - 1e-9)
    pairs = _band_pairs(keys, _MAX_PAIRS_PER_DOCUMENT * len(keys))
    if pairs is None:
        return _near_duplicates_by_buckets(signatures, keys, needed_matches)
    earlier, later = pairs
    close = np.zeros(len(earlier), dtype=bool)
    for first in range(0, len(earlier), _PAIRS_AT_A_TIME):
        chosen = slice(first, first + _PAIRS_AT_A_TIME)
        close[chosen] = (signatures[earlier[chosen]] == signatures[later[chosen]]).sum(axis=1) >= needed_matches
    mask = np.zeros(len(signatures), dtype=bool)
    # In document order (an earlier one's fate is settled first): a close earlier document that was kept.
    for doc, candidate in sorted(zip(later[close].tolist(), earlier[close].tolist())):
        if not mask[candidate]:
            mask[doc] = True
    return mask


def _band_pairs(keys: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Every pair of documents with some band key in common, once, as (earlier, later) document
    indices; None when the bands hold more than `limit` such pairs."""
    documents = len(keys)
    # Sorting values is faster than argsort, so the low bits of each key carry its document instead: a
    # key's documents come out consecutive and in corpus order, and keys equal only in the remaining
    # high bits are told apart when the pairs are checked against the whole keys. All bands are sorted
    # and grouped in one pass (a loop over the bands cost ~0.2 ms each in numpy calls, on the tail).
    bits = max((documents - 1).bit_length(), 1)
    low = np.uint64((1 << bits) - 1)
    ranked = np.sort((keys.T & ~low) | np.arange(documents, dtype=np.uint64), axis=1).reshape(-1)
    group_start = np.empty(len(ranked), dtype=bool)
    group_start[1:] = (ranked[1:] ^ ranked[:-1]) > low
    group_start[::documents] = True  # every band starts a group of its own
    starts = np.flatnonzero(group_start)
    sizes = np.diff(np.append(starts, len(ranked)))
    if int((sizes * (sizes - 1) // 2).sum()) > limit:
        return None
    shared = sizes > 1
    starts, sizes = starts[shared], sizes[shared]
    # Each position of a shared key pairs with every later position of that key.
    position = np.repeat(starts, sizes) + np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    later_count = np.repeat(starts + sizes - 1, sizes) - position
    first = np.repeat(position, later_count)
    second = first + 1 + np.arange(len(first)) - np.repeat(np.cumsum(later_count) - later_count, later_count)
    document = (ranked & low).astype(np.int64)
    earlier, later, band = document[first], document[second], first // documents
    same = keys[earlier, band] == keys[later, band]
    unique = np.unique(earlier[same] * documents + later[same])
    return unique // documents, unique % documents


def _near_duplicates_by_buckets(signatures: np.ndarray, keys: np.ndarray, needed_matches: int) -> np.ndarray:
    """`near_duplicate_mask` one document at a time against buckets of the kept ones: linear in a key
    shared by very many documents (mostly duplicates of the first), where listing pairs is quadratic."""
    mask = np.zeros(len(signatures), dtype=bool)
    buckets: list[dict[int, list[int]]] = [{} for _ in range(keys.shape[1])]
    sharing = np.flatnonzero(_shares_a_band(keys))
    for doc, doc_keys in zip(sharing.tolist(), keys[sharing].tolist()):
        candidates: set[int] = set()
        for bucket, key in zip(buckets, doc_keys):
            candidates.update(bucket.get(key, ()))
        if candidates and (signatures[list(candidates)] == signatures[doc]).sum(axis=1).max() >= needed_matches:
            mask[doc] = True
            continue
        for bucket, key in zip(buckets, doc_keys):
            bucket.setdefault(key, []).append(doc)
    return mask


def minhash_signatures(
    token_ids: np.ndarray, lengths: np.ndarray, shingle_tokens: int, permutations: int
) -> np.ndarray:
    """(documents, permutations) uint32 one-permutation MinHash signatures of the token-shingle sets."""
    lengths = np.asarray(lengths, dtype=np.int64)
    token_ids = np.asarray(token_ids)
    documents = len(lengths)
    table = _mix64(np.arange(1, int(token_ids.max(initial=0)) + 2, dtype=np.uint64))
    # Row `documents` is a spare that takes the windows across a document boundary and is dropped.
    signatures = np.full((documents + 1) * permutations, _EMPTY, dtype=np.uint32)
    filled = np.zeros(len(signatures), dtype=bool)  # the slots whose shingles all hashed to _EMPTY's value
    windows = _Windows(table, shingle_tokens, min(_SHINGLES_AT_A_TIME, len(token_ids)))
    rows = _WindowRows(lengths, shingle_tokens)
    # A block of windows at a time: each of the ~25 passes over a block then stays in the cache, where
    # passes over the whole batch (a shard's tokens, 8 bytes each) went to memory every time; the result
    # is the same, as the bins' minimum does not depend on the order the shingles come in.
    for first in range(0, rows.windows, _SHINGLES_AT_A_TIME):
        end = min(first + _SHINGLES_AT_A_TIME, rows.windows)
        _add_shingles(signatures, filled, windows.hashes(token_ids, first, end), rows.between(first, end), permutations)
    short = np.flatnonzero(lengths < shingle_tokens)
    if len(short):
        _add_shingles(signatures, filled, _short_shingle_hashes(table, token_ids, lengths, short, shingle_tokens), short, permutations)
    used = documents * permutations
    filled = filled[:used] | (signatures[:used] != _EMPTY)
    return signatures[_densified(filled, permutations)].reshape(documents, permutations)


class _Windows:
    """Hashes of the windows of `shingle_tokens` consecutive token ids, a block at a time, in buffers
    reused from block to block (new arrays are new pages to fault in)."""

    def __init__(self, table: np.ndarray, shingle_tokens: int, block: int) -> None:
        self.table, self.shingle_tokens = table, shingle_tokens
        self.mixed = np.empty(block + shingle_tokens - 1, dtype=np.uint64)
        self.windows = np.empty(block, dtype=np.uint64)

    def hashes(self, token_ids: np.ndarray, first: int, end: int) -> np.ndarray:
        """64-bit hashes of the windows starting at stream positions [first, end)."""
        count = end - first
        mixed = self.mixed[: count + self.shingle_tokens - 1]
        # mode="clip": the table covers every id, and with the default mode `take` copies into `out` through a
        # buffer and checks each index (4x the time of the gather itself).
        self.table.take(token_ids[first : end + self.shingle_tokens - 1], out=mixed, mode="clip")
        windows = self.windows[:count]
        np.copyto(windows, mixed[:count])
        for offset in range(1, self.shingle_tokens):
            windows *= _GOLDEN
            windows += mixed[offset : offset + count]
        # The token hashes are not needed any more: their memory is the scratch of the mix.
        return _mix64(windows, scratch=mixed[:count])


class _WindowRows:
    """The signature row of the window starting at each stream position: first each document's whole
    windows, then those running into the next document, which go to the spare row len(lengths). Listed a
    block at a time: the whole batch's rows (8 bytes a token) went to memory and back."""

    def __init__(self, lengths: np.ndarray, shingle_tokens: int) -> None:
        documents = len(lengths)
        self.windows = max(int(lengths.sum()) - shingle_tokens + 1, 0)
        whole = np.maximum(lengths - shingle_tokens + 1, 0)
        self.labels = np.stack([np.arange(documents), np.full(documents, documents)], axis=1).reshape(-1)
        self.ends = np.cumsum(np.stack([whole, lengths - whole], axis=1).reshape(-1))  # of each run of a label

    def between(self, first: int, end: int) -> np.ndarray:
        """The rows of the windows starting at positions [first, end)."""
        low = int(np.searchsorted(self.ends, first, side="right"))
        high = int(np.searchsorted(self.ends, end, side="left")) + 1
        run_ends = np.minimum(self.ends[low:high], end)
        return np.repeat(self.labels[low:high], np.diff(run_ends, prepend=first))


def _short_shingle_hashes(
    table: np.ndarray, token_ids: np.ndarray, lengths: np.ndarray, short: np.ndarray, shingle_tokens: int
) -> np.ndarray:
    """One zero-padded shingle of all the tokens of each `short` document (shorter than a window)."""
    starts = np.cumsum(lengths) - lengths
    padded = np.zeros(len(short), dtype=np.uint64)
    for offset in range(shingle_tokens):
        present = offset < lengths[short]
        ids = token_ids.take(np.minimum(starts[short] + offset, len(token_ids) - 1))
        padded = padded * _GOLDEN + np.where(present, table.take(ids), 0)
    return _mix64(padded)


def _add_shingles(
    signatures: np.ndarray, filled: np.ndarray, hashes: np.ndarray, rows: np.ndarray, permutations: int
) -> None:
    """Fold shingle hashes into the flat signatures of their rows: the bin from the high 32 bits
    (multiply-shift onto [0, permutations)), the value from the low 32. In place as far as it goes: the
    bins' memory then holds the values. A slot is filled when its value is below _EMPTY, so `filled` is
    marked only for values equal to it (a scatter of every slot cost as much as the `minimum.at`)."""
    bins = hashes >> np.uint64(32)
    bins *= np.uint64(permutations)
    bins >>= np.uint64(32)
    slots = rows * permutations
    slots += bins.view(np.int64)
    values = bins.view(np.uint32)[: len(hashes)]
    np.copyto(values, hashes, casting="unsafe")  # the low 32 bits
    np.minimum.at(signatures, slots, values)
    empty = values == _EMPTY
    if empty.any():
        filled[slots[empty]] = True


def rows_per_band(permutations: int, threshold: float) -> int:
    """The most rows per band (fewest false candidates) that still catches a pair at the threshold."""
    best = 1
    for rows in range(1, permutations + 1):
        bands = permutations // rows
        if 1 - (1 - threshold**rows) ** bands >= _CANDIDATE_RECALL:
            best = rows
    return best


def _densified(filled: np.ndarray, permutations: int) -> np.ndarray:
    """For every slot of the flat (documents x permutations) signature, the slot it takes its value
    from: itself when filled, else the first filled slot of the same document along the position's
    own probe order (a fixed random permutation of the positions, drawn once per position).

    Every document has at least one shingle, so a full probe order always finds a filled slot.
    """
    # int64 throughout: every gather and scatter converts int32 indices to a new int64 array first, and
    # `take` is cheaper than fancy indexing (7 ms -> 5.5 ms per corpus).
    source = np.arange(len(filled))
    pending = np.flatnonzero(~filled)
    for offsets in _probe_offsets(permutations):
        if not len(pending):
            break
        candidate = pending + offsets.take(pending % permutations)
        source[pending] = candidate  # final for those found; the others are overwritten at a later step
        pending = pending[~filled.take(candidate)]
    return source


@functools.cache
def _probe_offsets(permutations: int) -> np.ndarray:
    """(steps, positions): at step t, position j tries position j + offsets[t, j] (each position's own
    fixed random probe order)."""
    probes = np.random.default_rng(_SEED).random((permutations, permutations)).argsort(axis=1).T
    return probes - np.arange(permutations)


def _mix64(values: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """splitmix64 finaliser, in place: spreads its input over all 64 bits. `scratch`, as long as `values`,
    holds the shifted copies (one new array otherwise)."""
    scratch = np.empty_like(values) if scratch is None else scratch
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(values, np.uint64(shift), out=scratch)
        values ^= scratch
        values *= np.uint64(multiplier)
    np.right_shift(values, np.uint64(31), out=scratch)
    values ^= scratch
    return values


def _band_keys(signatures: np.ndarray, rows: int) -> np.ndarray:
    """(documents, bands) uint64 hash of each band of `rows` signature positions."""
    bands = signatures.shape[1] // rows
    keys = np.zeros((signatures.shape[0], bands), dtype=np.uint64)
    for row in range(rows):
        keys = (keys ^ signatures[:, row : bands * rows : rows].astype(np.uint64)) * _GOLDEN
    return keys


def _shares_a_band(keys: np.ndarray) -> np.ndarray:
    """True for documents that have some band key in common with another document."""
    shared = np.zeros(keys.shape[0], dtype=bool)
    for band in keys.T:
        _, inverse, counts = np.unique(band, return_inverse=True, return_counts=True)
        shared |= counts[inverse] > 1
    return shared
