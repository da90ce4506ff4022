"""Exact and MinHash/LSH near-duplicate detection."""

import random

import numpy as np
import pytest

from model_core.data.dedup import exact_duplicate_mask, minhash_signatures, near_duplicate_mask, rows_per_band

WORDS = [f"word{i}" for i in range(5000)]


def random_doc(seed: int, words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_exact_duplicates_after_the_first_are_marked():
    texts = ["alpha", "beta", "alpha", "gamma", "beta", "alpha"]
    assert exact_duplicate_mask(texts).tolist() == [False, False, True, False, True, True]


def test_a_long_document_with_one_word_changed_is_a_near_duplicate():
    original = random_doc(1)
    words = original.split()
    words[150] = "CHANGED"
    near_copy = " ".join(words)
    texts = [original, random_doc(2), near_copy, random_doc(3)]
    assert near_duplicate_mask(texts, shingle_words=5, permutations=64, threshold=0.8).tolist() == [
        False,
        False,
        True,
        False,
    ]


def test_distinct_documents_are_all_kept():
    texts = [random_doc(seed) for seed in range(200)]
    assert not near_duplicate_mask(texts, shingle_words=5, permutations=64, threshold=0.8).any()


def test_a_half_rewritten_document_is_kept_at_a_high_threshold():
    original = random_doc(7)
    words = original.split()
    rewritten = " ".join(words[:150] + random_doc(8, 150).split())
    mask = near_duplicate_mask([original, rewritten], shingle_words=5, permutations=128, threshold=0.8)
    assert mask.tolist() == [False, False]
    # ...but at a low threshold (true Jaccard of the shingle sets is about 1/3) it is dropped.
    mask = near_duplicate_mask([original, rewritten], shingle_words=5, permutations=128, threshold=0.2)
    assert mask.tolist() == [False, True]


def test_only_the_earlier_document_of_a_near_duplicate_pair_survives():
    original = random_doc(4)
    near_copy = original.replace(original.split()[10], "CHANGED", 1)
    assert near_duplicate_mask([near_copy, original], 5, 64, 0.8).tolist() == [False, True]


def test_short_documents_are_one_shingle():
    mask = near_duplicate_mask(["two words", "two words", "other words"], 5, 64, 0.8)
    assert mask.tolist() == [False, True, False]


def test_signatures_are_deterministic_and_estimate_jaccard():
    texts = [random_doc(seed) for seed in range(3)]
    first = minhash_signatures(texts, 3, 64)
    np.testing.assert_array_equal(first, minhash_signatures(texts, 3, 64))
    assert first.shape == (3, 64) and first.dtype == np.uint32
    identical = minhash_signatures([texts[0], texts[0]], 3, 64)
    np.testing.assert_array_equal(identical[0], identical[1])
    assert (first[0] == first[1]).mean() < 0.2


@pytest.mark.parametrize(("permutations", "threshold"), [(64, 0.8), (64, 0.5), (128, 0.9), (8, 0.8)])
def test_bands_catch_a_pair_at_the_threshold_with_high_probability(permutations, threshold):
    rows = rows_per_band(permutations, threshold)
    bands = permutations // rows
    assert 1 - (1 - threshold**rows) ** bands >= 0.99
