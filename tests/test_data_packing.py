"""Packing documents into fixed rows with recorded document starts."""

import numpy as np
import pytest

from model_core.data.packing import pack_documents

BOS, EOS, PAD = 1, 2, 3


def documents(seed: int = 0, count: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 100, size=rng.integers(1, 30)).tolist() for _ in range(count)]


def unpacked(stream: np.ndarray) -> list[list[int]]:
    """Documents of a BOS ... EOS stream."""
    docs, current = [], None
    for token in stream.tolist():
        if token == BOS:
            assert current is None
            current = []
        elif token == EOS:
            docs.append(current)
            current = None
        else:
            current.append(token)
    return docs


@pytest.mark.parametrize("last_row", ["drop", "pad"])
def test_every_token_appears_once_in_order_in_rows_of_row_len(last_row):
    docs = documents()
    rows = pack_documents(docs, 17, BOS, EOS, PAD, last_row)
    assert rows.tokens.shape[1] == 17 and rows.tokens.dtype == np.int32
    stream = rows.tokens.reshape(-1).tolist()
    expected = [token for doc in docs for token in [BOS, *doc, EOS]]
    if last_row == "pad":
        assert len(rows) == -(-len(expected) // 17)
        assert stream == expected + [PAD] * (len(stream) - len(expected))
        assert unpacked(np.array(expected)) == docs
    else:
        assert len(rows) == len(expected) // 17
        assert stream == expected[: len(stream)]


def test_doc_starts_are_row_offsets_of_each_bos_plus_zero():
    rows = pack_documents(documents(1), 13, BOS, EOS, PAD, "pad")
    for row in range(len(rows)):
        starts = rows.doc_starts(row).tolist()
        expected = sorted({0} | set(np.flatnonzero(rows.tokens[row] == BOS).tolist()))
        assert starts == expected


def test_without_bos_documents_are_eos_separated_and_starts_follow_each_eos():
    docs = documents(2)
    rows = pack_documents(docs, 11, None, EOS, PAD, "pad")
    stream = rows.tokens.reshape(-1)
    total = sum(len(doc) + 1 for doc in docs)
    pieces = np.split(stream[:total], np.flatnonzero(stream[:total] == EOS) + 1)[:-1]
    assert [piece[:-1].tolist() for piece in pieces] == docs
    doc_starts_in_stream = np.cumsum([0] + [len(doc) + 1 for doc in docs[:-1]])
    for row in range(len(rows)):
        in_row = doc_starts_in_stream[(doc_starts_in_stream >= row * 11) & (doc_starts_in_stream < (row + 1) * 11)]
        assert rows.doc_starts(row).tolist() == sorted({0} | set((in_row - row * 11).tolist()))


def test_a_corpus_shorter_than_a_row_gives_no_row_when_dropping_and_one_when_padding():
    assert len(pack_documents([[5, 6]], 10, BOS, EOS, PAD, "drop")) == 0
    padded = pack_documents([[5, 6]], 10, BOS, EOS, PAD, "pad")
    assert padded.tokens.tolist() == [[BOS, 5, 6, EOS] + [PAD] * 6]
    assert padded.doc_starts(0).tolist() == [0]


def test_take_reorders_tokens_and_doc_starts_together():
    rows = pack_documents(documents(3), 9, BOS, EOS, PAD, "drop")
    order = np.random.default_rng(0).permutation(len(rows))
    shuffled = rows.take(order)
    for new, old in enumerate(order):
        assert shuffled.tokens[new].tolist() == rows.tokens[old].tolist()
        assert shuffled.doc_starts(new).tolist() == rows.doc_starts(old).tolist()
