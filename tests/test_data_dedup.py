"""Exact duplicates on text; MinHash/LSH near duplicates on token-id shingles."""

import numpy as np
import pytest

from model_core.data import dedup
from model_core.data.dedup import (
    _band_pairs,
    exact_duplicate_mask,
    minhash_signatures,
    near_duplicate_mask,
    rows_per_band,
)

VOCAB = 5000


def random_doc(seed: int, tokens: int = 300) -> list[int]:
    return np.random.default_rng(seed).integers(4, VOCAB, size=tokens).tolist()


def flat(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Documents as the dedup functions take them: ids concatenated, and the length of each."""
    return np.array([t for doc in docs for t in doc], dtype=np.int32), np.array([len(doc) for doc in docs])


def near_duplicates(docs, shingle_tokens=5, permutations=64, threshold=0.8) -> list[bool]:
    return near_duplicate_mask(minhash_signatures(*flat(docs), shingle_tokens, permutations), threshold).tolist()


def test_exact_duplicates_after_the_first_are_marked():
    texts = ["alpha", "beta", "alpha", "gamma", "beta", "alpha"]
    assert exact_duplicate_mask(texts).tolist() == [False, False, True, False, True, True]


def test_a_long_document_with_one_token_changed_is_a_near_duplicate():
    original = random_doc(1)
    near_copy = original[:150] + [VOCAB + 1] + original[151:]
    assert near_duplicates([original, random_doc(2), near_copy, random_doc(3)]) == [False, False, True, False]


def test_a_pair_at_about_0_9_jaccard_is_caught_at_threshold_0_8():
    original = random_doc(12)
    near_copy = list(original)
    for position in (60, 150, 240):  # each change touches 5 shingles: 281 of 311 distinct shingles shared
        near_copy[position] = VOCAB + position
    assert near_duplicates([original, random_doc(13), near_copy]) == [False, False, True]


def test_distinct_documents_are_all_kept():
    assert not any(near_duplicates([random_doc(seed) for seed in range(200)]))


def test_distinct_short_documents_are_all_kept():
    # Short documents leave most signature positions empty; densification must not make them collide.
    assert not any(near_duplicates([random_doc(seed, tokens=12) for seed in range(500)]))


def test_a_half_rewritten_document_is_kept_at_a_high_threshold():
    original = random_doc(7)
    rewritten = original[:150] + random_doc(8, 150)
    assert near_duplicates([original, rewritten], permutations=128, threshold=0.8) == [False, False]
    # ...but at a low threshold (true Jaccard of the shingle sets is about 1/3) it is dropped.
    assert near_duplicates([original, rewritten], permutations=128, threshold=0.2) == [False, True]


def test_only_the_earlier_document_of_a_near_duplicate_pair_survives():
    original = random_doc(4)
    near_copy = original[:10] + [VOCAB + 1] + original[11:]
    assert near_duplicates([near_copy, original]) == [False, True]


def test_documents_shorter_than_a_shingle_are_one_shingle():
    assert near_duplicates([[7, 8], [7, 8], [9, 8], [7]]) == [False, True, False, False]


def test_signatures_are_deterministic_and_estimate_jaccard():
    docs = [random_doc(seed) for seed in range(3)]
    first = minhash_signatures(*flat(docs), 3, 64)
    np.testing.assert_array_equal(first, minhash_signatures(*flat(docs), 3, 64))
    assert first.shape == (3, 64) and first.dtype == np.uint32
    identical = minhash_signatures(*flat([docs[0], docs[0]]), 3, 64)
    np.testing.assert_array_equal(identical[0], identical[1])
    assert (first[0] == first[1]).mean() < 0.2
    # Half of each document's shingles shared: Jaccard about 1/3, which the share of equal positions estimates.
    shared = docs[0]
    pair = minhash_signatures(*flat([shared + random_doc(10), shared + random_doc(11)]), 3, 256)
    assert abs((pair[0] == pair[1]).mean() - 1 / 3) < 0.1


def test_shingles_do_not_span_document_boundaries():
    # The second and third documents are the same tokens; what precedes them in the stream must not matter.
    doc = random_doc(5, 40)
    signatures = minhash_signatures(*flat([random_doc(6, 40), doc, random_doc(9, 3), doc]), 5, 64)
    np.testing.assert_array_equal(signatures[1], signatures[3])


def test_a_shingle_whose_value_is_the_empty_marker_still_fills_its_slot(monkeypatch):
    # A slot counts as filled by its value being below the marker, or by a shingle of exactly the marker's
    # value: with the marker moved to the largest value a slot of the signature keeps, nothing changes.
    ids, lengths = flat([random_doc(3, 12)])
    expected = minhash_signatures(ids, lengths, 5, 64)
    monkeypatch.setattr(dedup, "_EMPTY", int(expected.max()))
    np.testing.assert_array_equal(minhash_signatures(ids, lengths, 5, 64), expected)


def test_signatures_do_not_depend_on_how_many_windows_are_hashed_at_a_time(monkeypatch):
    # Blocks of 1 and 7 windows cut every document, and the windows across its end, at many places.
    docs = [random_doc(seed, tokens) for seed, tokens in enumerate((40, 3, 1, 17, 300, 5, 4, 90))]
    whole = minhash_signatures(*flat(docs), 5, 64)
    for block in (1, 7):
        monkeypatch.setattr(dedup, "_SHINGLES_AT_A_TIME", block)
        np.testing.assert_array_equal(minhash_signatures(*flat(docs), 5, 64), whole)


@pytest.mark.parametrize(("permutations", "threshold"), [(64, 0.8), (64, 0.5), (128, 0.9), (8, 0.8)])
def test_bands_catch_a_pair_at_the_threshold_with_high_probability(permutations, threshold):
    rows = rows_per_band(permutations, threshold)
    bands = permutations // rows
    assert 1 - (1 - threshold**rows) ** bands >= 0.99


def test_band_pairs_lists_every_pair_sharing_a_band_key_once():
    # Few distinct values, so that keys are shared by groups of every size and across bands.
    rng = np.random.default_rng(3)
    for documents, bands in [(1, 3), (2, 1), (40, 4), (300, 12)]:
        keys = rng.integers(0, 4, size=(documents, bands)).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        expected = [
            (earlier, later)
            for earlier in range(documents)
            for later in range(earlier + 1, documents)
            if (keys[earlier] == keys[later]).any()
        ]
        earlier, later = _band_pairs(keys, limit=bands * documents * documents)
        assert list(zip(earlier.tolist(), later.tolist())) == expected
        if expected:
            assert _band_pairs(keys, limit=len(expected) - 1) is None


@pytest.mark.parametrize("limit", [1, 7, 50, 10**6])
def test_candidate_pairs_come_in_bounded_batches_and_each_once(limit, monkeypatch):
    from model_core.data import global_dedup

    monkeypatch.setattr(global_dedup, "_PAIRS_AT_A_TIME", limit)
    key = np.sort(np.random.default_rng(0).integers(0, 30, 400)).astype(np.uint64)
    number = np.arange(400)
    found = []
    for earlier, later in global_dedup._group_pairs(key, number):
        assert len(earlier) <= max(limit, 399)  # a block of a large group pairs at least one member with the rest
        found += zip(earlier.tolist(), later.tolist())
    expected = [(i, j) for i in range(400) for j in range(i + 1, 400) if key[i] == key[j]]
    assert sorted(found) == expected


def test_near_duplicates_settle_in_corpus_order_as_one_pass_over_the_pairs_would():
    from model_core.data.global_dedup import settle_near_duplicates

    def one_pair_at_a_time(pairs):
        dropped = set()
        for earlier, later in sorted(map(tuple, pairs.tolist()), key=lambda pair: (pair[1], pair[0])):
            if earlier not in dropped:
                dropped.add(later)
        return sorted(dropped)

    rng = np.random.default_rng(0)
    chain = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]])  # 0, 2, 4 kept: every round settles two
    assert settle_near_duplicates(chain).tolist() == [1, 3, 5]
    for _ in range(300):
        documents = int(rng.integers(2, 40))
        pairs = np.sort(rng.integers(0, documents, size=(int(rng.integers(0, 120)), 2)), axis=1)
        pairs = pairs[pairs[:, 0] < pairs[:, 1]] * 1000  # document numbers with gaps, some pairs repeated
        assert settle_near_duplicates(pairs).tolist() == one_pair_at_a_time(pairs)
    with pytest.raises(ValueError, match="earlier, later"):
        settle_near_duplicates(np.array([[3, 2]]))
