"""Exact and near-duplicate detection over cleaned documents.

Exact duplicates share a BLAKE2b digest of their text. Near duplicates are found with MinHash over word
shingles and LSH banding: documents whose signatures agree on a whole band become candidates, and a
candidate is a duplicate when its signature agrees with an earlier kept document's on at least
`threshold` of the positions (the MinHash estimate of the Jaccard similarity of their shingle sets).
Every hash is seeded and platform-independent (never Python's salted `hash()`), and the hashing is
vectorised with numpy; only documents that share a band with another one reach the Python loop.
"""

from __future__ import annotations

import hashlib
import math
from itertools import chain

import numpy as np

_SEED = 0x5EED
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SHINGLES_PER_CHUNK = 1 << 15  # bounds the (shingles x permutations) matrix to a few MB
_CANDIDATE_RECALL = 0.99  # LSH bands are chosen so a pair at the threshold is a candidate this often


def exact_duplicate_mask(texts: list[str]) -> np.ndarray:
    """True for every document whose text already appeared earlier."""
    seen: set[bytes] = set()
    mask = np.zeros(len(texts), dtype=bool)
    for index, text in enumerate(texts):
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        mask[index] = digest in seen
        seen.add(digest)
    return mask


def near_duplicate_mask(texts: list[str], shingle_words: int, permutations: int, threshold: float) -> np.ndarray:
    """True for every document whose estimated Jaccard similarity with an earlier kept one is >= threshold."""
    signatures = minhash_signatures(texts, shingle_words, permutations)
    rows = rows_per_band(permutations, threshold)
    keys = _band_keys(signatures, rows)
    needed_matches = math.ceil(threshold * permutations - 1e-9)

    mask = np.zeros(len(texts), dtype=bool)
    buckets: list[dict[int, list[int]]] = [{} for _ in range(keys.shape[1])]
    for doc in np.flatnonzero(_shares_a_band(keys)):
        doc_keys = keys[doc].tolist()
        candidates = {other for band, key in enumerate(doc_keys) for other in buckets[band].get(key, ())}
        if candidates:
            matches = (signatures[sorted(candidates)] == signatures[doc]).sum(axis=1)
            if matches.max() >= needed_matches:
                mask[doc] = True
                continue
        for band, key in enumerate(doc_keys):
            buckets[band].setdefault(key, []).append(int(doc))
    return mask


def minhash_signatures(texts: list[str], shingle_words: int, permutations: int) -> np.ndarray:
    """(documents, permutations) uint32 MinHash signatures of the word-shingle sets."""
    shingles, per_doc = _shingle_hashes(texts, shingle_words)
    rng = np.random.default_rng(_SEED)
    multipliers = rng.integers(0, 1 << 63, size=permutations, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    offsets = rng.integers(0, 1 << 63, size=permutations, dtype=np.uint64)
    bounds = np.concatenate([[0], np.cumsum(per_doc)])
    signatures = np.empty((len(texts), permutations), dtype=np.uint32)
    first = 0
    while first < len(texts):
        # Whole documents per chunk, at least one, about _SHINGLES_PER_CHUNK shingles.
        last = int(np.searchsorted(bounds, bounds[first] + _SHINGLES_PER_CHUNK, side="right")) - 1
        last = min(max(last, first + 1), len(texts))
        chunk = shingles[bounds[first] : bounds[last], None]
        # Multiply-shift hashing: the high 32 bits of a*x + b (mod 2^64) with odd a is a universal family.
        hashed = ((chunk * multipliers + offsets) >> np.uint64(32)).astype(np.uint32)
        signatures[first:last] = np.minimum.reduceat(hashed, bounds[first:last] - bounds[first], axis=0)
        first = last
    return signatures


def rows_per_band(permutations: int, threshold: float) -> int:
    """The most rows per band (fewest false candidates) that still catches a pair at the threshold."""
    best = 1
    for rows in range(1, permutations + 1):
        bands = permutations // rows
        if 1 - (1 - threshold**rows) ** bands >= _CANDIDATE_RECALL:
            best = rows
    return best


def _shingle_hashes(texts: list[str], shingle_words: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hash of every `shingle_words`-word window of every document, and the windows per document.

    A document shorter than one window is a single shingle of all its words.
    """
    word_hashes, word_counts = _word_hashes(texts)
    ends = np.cumsum(word_counts)
    per_doc = np.maximum(word_counts - shingle_words + 1, 1)
    shingle_doc = np.repeat(np.arange(len(texts)), per_doc)
    first_shingle = np.cumsum(per_doc) - per_doc
    starts = (ends - word_counts)[shingle_doc] + np.arange(len(shingle_doc)) - first_shingle[shingle_doc]
    stops = ends[shingle_doc]
    padded = np.concatenate([word_hashes, np.zeros(shingle_words, dtype=np.uint64)])
    hashes = np.zeros(len(starts), dtype=np.uint64)
    for offset in range(shingle_words):
        position = starts + offset
        hashes = hashes * _GOLDEN + np.where(position < stops, padded[position], np.uint64(0))
    return _mix64(hashes), per_doc


def _word_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """BLAKE2b-derived 64-bit hash of every whitespace-separated word, and the word count of each text."""
    words = [text.split() for text in texts]
    counts = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    vocabulary: dict[str, int] = {}
    word_ids = np.fromiter(
        (vocabulary.setdefault(word, len(vocabulary)) for word in chain.from_iterable(words)),
        dtype=np.int64,
        count=int(counts.sum()),
    )
    table = np.fromiter(
        (int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little") for word in vocabulary),
        dtype=np.uint64,
        count=len(vocabulary),
    )
    return table[word_ids], counts


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads the polynomial shingle hash over all 64 bits."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


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
