"""Packing documents into fixed rows with recorded document starts."""

import numpy as np
import pytest

from model_core.data.packing import pack_documents, select_documents

BOS, EOS, PAD = 1, 2, 3


def documents(seed: int = 0, count: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 100, size=rng.integers(1, 30)).tolist() for _ in range(count)]


def pack(docs: list[list[int]], row_len: int, bos_id: int | None, last_row: str):
    ids = np.array([token for doc in docs for token in doc], dtype=np.int32)
    return pack_documents(ids, np.array([len(doc) for doc in docs]), row_len, bos_id, EOS, PAD, last_row)


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
    rows = pack(docs, 17, BOS, last_row)
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
    rows = pack(documents(1), 13, BOS, "pad")
    for row in range(len(rows)):
        starts = rows.doc_starts(row).tolist()
        expected = sorted({0} | set(np.flatnonzero(rows.tokens[row] == BOS).tolist()))
        assert starts == expected


def test_without_bos_documents_are_eos_separated_and_starts_follow_each_eos():
    docs = documents(2)
    rows = pack(docs, 11, None, "pad")
    stream = rows.tokens.reshape(-1)
    total = sum(len(doc) + 1 for doc in docs)
    pieces = np.split(stream[:total], np.flatnonzero(stream[:total] == EOS) + 1)[:-1]
    assert [piece[:-1].tolist() for piece in pieces] == docs
    doc_starts_in_stream = np.cumsum([0] + [len(doc) + 1 for doc in docs[:-1]])
    for row in range(len(rows)):
        in_row = doc_starts_in_stream[(doc_starts_in_stream >= row * 11) & (doc_starts_in_stream < (row + 1) * 11)]
        assert rows.doc_starts(row).tolist() == sorted({0} | set((in_row - row * 11).tolist()))


def test_a_corpus_shorter_than_a_row_gives_no_row_when_dropping_and_one_when_padding():
    assert len(pack([[5, 6]], 10, BOS, "drop")) == 0
    padded = pack([[5, 6]], 10, BOS, "pad")
    assert padded.tokens.tolist() == [[BOS, 5, 6, EOS] + [PAD] * 6]
    assert padded.doc_starts(0).tolist() == [0]


def test_take_reorders_tokens_and_doc_starts_together():
    rows = pack(documents(3), 9, BOS, "drop")
    order = np.random.default_rng(0).permutation(len(rows))
    shuffled = rows.take(order)
    for new, old in enumerate(order):
        assert shuffled.tokens[new].tolist() == rows.tokens[old].tolist()
        assert shuffled.doc_starts(new).tolist() == rows.doc_starts(old).tolist()


def test_select_documents_gathers_ids_and_lengths_in_the_given_order():
    docs = documents(4, count=6)
    ids = np.array([token for doc in docs for token in doc], dtype=np.int32)
    chosen_ids, lengths = select_documents(ids, np.array([len(doc) for doc in docs]), np.array([4, 0, 2]))
    assert chosen_ids.tolist() == docs[4] + docs[0] + docs[2]
    assert lengths.tolist() == [len(docs[4]), len(docs[0]), len(docs[2])]


def test_packing_in_a_given_order_with_a_shuffle_equals_selecting_packing_and_shuffling():
    """Prep packs the training split straight from the token ids in the shuffled document order and shuffles
    rows a block at a time; that must be the rows of packing the selected documents, then shuffling them."""
    docs = documents(5)
    ids = np.array([t for d in docs for t in d], dtype=np.int32)
    lengths = np.array([len(d) for d in docs])
    order = np.random.default_rng(1).permutation(len(docs))[:25]
    chosen, chosen_lengths = select_documents(ids, lengths, order)
    expected = pack_documents(chosen, chosen_lengths, 11, BOS, EOS, PAD, "pad")
    expected = expected.take(np.random.default_rng(2).permutation(len(expected)))
    got = pack_documents(ids, lengths, 11, BOS, EOS, PAD, "pad", order, np.random.default_rng(2))
    for field in ("tokens", "doc_start_values", "doc_start_offsets"):
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field))
