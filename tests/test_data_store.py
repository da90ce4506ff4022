"""Token storage the trainer reads without loading it: the keyed permutation, flat shards read a row at a time,
and the loader on top of them."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from model_core.data import DatasetDamagedError, PackedRows, open_split, read_shards, write_manifest, write_shard, write_shards
from model_core.data.packing import pack_documents, pack_examples
from model_core.data.permutation import KeyedPermutation
from model_core.storage import file_sha256
from model_core.train.loader import ShuffledBatches, sequential_batches

PAD, BOS, EOS = 3, 1, 2

# ---------------------------------------------------------------------------------- KeyedPermutation


@pytest.mark.parametrize("size", [*range(0, 70), 255, 256, 257, 1000, 4095, 4096, 4097, 65_537, 300_007])
def test_the_permutation_is_a_bijection_and_inverse_undoes_it(size):
    permutation = KeyedPermutation(size, (1234, 0))
    positions = np.arange(size)
    rows = permutation.forward(positions)
    assert rows.dtype == np.uint64 and rows.shape == positions.shape
    np.testing.assert_array_equal(np.sort(rows), positions)
    np.testing.assert_array_equal(permutation.inverse(rows), positions)
    np.testing.assert_array_equal(permutation.forward(permutation.inverse(positions)), positions)


def test_keys_choose_different_orders_and_the_same_key_the_same_one():
    positions = np.arange(1000)
    orders = {key: KeyedPermutation(1000, key).forward(positions) for key in [(1, 0), (1, 1), (2, 0), (-1, 0), (0,)]}
    assert len({order.tobytes() for order in orders.values()}) == len(orders)
    np.testing.assert_array_equal(KeyedPermutation(1000, (1, 0)).forward(positions), orders[(1, 0)])
    # Fixed values: the order must not change between releases or platforms (saved positions point into it).
    assert KeyedPermutation(10, (7, 3)).forward(np.arange(10)).tolist() == [1, 6, 8, 3, 2, 5, 0, 7, 9, 4]
    assert KeyedPermutation(1 << 40, (7, 3)).forward(np.array([5])).tolist() == [685112508748]


def test_the_order_is_shuffled_not_merely_rotated():
    size = 100_000
    rows = KeyedPermutation(size, (5, 2)).forward(np.arange(size)).astype(np.float64)
    assert abs(np.corrcoef(np.arange(size), rows)[0, 1]) < 0.02
    assert np.count_nonzero(rows == np.arange(size)) < 10  # about one fixed point is expected
    neighbours = np.abs(np.diff(rows))
    assert np.median(neighbours) > size / 10  # consecutive positions land far apart


def test_a_permutation_of_two_to_the_forty_rows_costs_memory_of_the_batch_only():
    size = 1 << 40
    permutation = KeyedPermutation(size, (9, 1))
    positions = np.array([0, 1, 2, size - 1, 123_456_789_012], dtype=np.int64)
    tracemalloc.start()
    rows = permutation.forward(positions)
    back = permutation.inverse(rows)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 1024
    assert len(set(rows.tolist())) == len(positions) and int(rows.max()) < size
    np.testing.assert_array_equal(back, positions)


def test_positions_outside_the_permutation_are_refused():
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        KeyedPermutation(10, (1,)).forward(np.array([10]))
    with pytest.raises(ValueError, match=r"outside \[0, 0\)"):
        KeyedPermutation(0, (1,)).inverse(np.array([0]))
    assert KeyedPermutation(0, (1,)).forward(np.array([], dtype=np.int64)).size == 0


# ---------------------------------------------------------------------------------- shards


def _documents(seed: int, high: int, count: int = 400) -> PackedRows:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, count)
    return pack_documents(rng.integers(5, high, lengths.sum()).astype(np.int32), lengths, 17, BOS, EOS, PAD, "pad")


def _manifest(directory, shards: list[dict], seq_len: int = 16, split: str = "train") -> None:
    write_manifest(directory, {"seq_len": seq_len, "splits": {split: {"shards": shards}}})


def _assert_same_rows(got: PackedRows, want: PackedRows) -> None:
    assert got.tokens.dtype == np.int32
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.doc_start_offsets, want.doc_start_offsets)
    np.testing.assert_array_equal(got.doc_start_values, want.doc_start_values)
    if want.loss_mask is None:
        assert got.loss_mask is None
    else:
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)


@pytest.mark.parametrize(
    ("vocab_size", "dtype", "itemsize"), [(65_536, "uint16", 2), (70_000, "int32", 4), (None, "int32", 4)]
)
def test_rows_taken_in_any_order_across_shards_equal_the_rows_written(tmp_path, vocab_size, dtype, itemsize):
    rows = _documents(0, vocab_size or 100_000)
    shards = write_shards(rows, tmp_path, "train", rows_per_shard=37, pad_id=PAD, vocab_size=vocab_size)
    assert [shard["file"] for shard in shards[:2]] == ["train-00000.tokens", "train-00001.tokens"]
    assert sum(shard["rows"] for shard in shards) == len(rows) and len(shards) == -(-len(rows) // 37)
    for shard in shards:
        assert shard["token_dtype"] == dtype and shard["sha256"] == file_sha256(tmp_path / shard["file"])
    assert sum(shard["tokens"] for shard in shards) == np.count_nonzero(rows.tokens != PAD)
    first = tmp_path / shards[0]["file"]
    assert first.stat().st_size < 64 + 37 * 17 * itemsize + 38 * 8 + shards[0]["doc_starts"] * 4 + 3 * 64
    _manifest(tmp_path, shards)
    split = open_split(tmp_path, "train")
    assert len(split) == len(rows) and not split.has_loss_mask
    order = np.random.default_rng(1).permutation(len(rows))
    for indices in (order, order[:50], np.r_[order[:7], order[:3]], np.arange(40, 80), np.array([], np.int64)):
        _assert_same_rows(split.take(indices), rows.take(indices))
    per_shard = list(read_shards(tmp_path, "train"))
    assert len(per_shard) == len(shards)
    for index, part in enumerate(per_shard):
        _assert_same_rows(part, rows.take(np.arange(index * 37, min((index + 1) * 37, len(rows)))))


def test_instruction_shards_keep_their_loss_mask(tmp_path):
    rng = np.random.default_rng(2)
    lengths = rng.integers(3, 17, 60)
    ids = rng.integers(5, 500, lengths.sum()).astype(np.int32)
    mask = rng.integers(0, 2, lengths.sum()).astype(np.int8)
    rows = pack_examples(ids, lengths, mask, 17, PAD)
    shards = write_shards(rows, tmp_path, "validation", rows_per_shard=8, pad_id=PAD, vocab_size=512)
    assert all(shard["loss_mask"] for shard in shards)
    assert sum(shard["response_tokens"] for shard in shards) == int(mask.sum())
    _manifest(tmp_path, shards, split="validation")
    split = open_split(tmp_path, "validation")
    assert split.has_loss_mask
    order = rng.permutation(len(rows))
    _assert_same_rows(split.take(order), rows.take(order))


def test_sections_are_aligned_for_memory_maps(tmp_path):
    rows = _documents(3, 500, count=50)
    entry = write_shard(tmp_path / "x.tokens", rows, PAD, vocab_size=512)
    data = (tmp_path / "x.tokens").read_bytes()
    assert data[:8] == b"LLMFROWS" and entry["rows"] == len(rows)
    tokens_at, offsets_at = 64, -(-(64 + rows.tokens.size * 2) // 64) * 64
    mapped = np.memmap(tmp_path / "x.tokens", dtype="<u2", mode="r", offset=tokens_at, shape=rows.tokens.shape)
    np.testing.assert_array_equal(mapped, rows.tokens)
    offsets = np.frombuffer(data, dtype="<i8", count=len(rows) + 1, offset=offsets_at)
    np.testing.assert_array_equal(offsets, rows.doc_start_offsets)


def test_ids_that_do_not_fit_the_vocabulary_are_refused(tmp_path):
    rows = _documents(4, 500, count=20)
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        write_shard(tmp_path / "x.tokens", rows, PAD, vocab_size=100)


def test_a_shard_that_is_not_what_the_manifest_says_is_named(tmp_path):
    rows = _documents(5, 500, count=100)
    shards = write_shards(rows, tmp_path, "train", rows_per_shard=1000, pad_id=PAD, vocab_size=512)
    path = tmp_path / shards[0]["file"]
    whole = path.stat().st_size
    # One row fewer ends the file at the same 64-byte boundary, and the file matches its sha256: the header tells.
    _manifest(tmp_path, [{**shards[0], "rows": shards[0]["rows"] - 1}])
    with pytest.raises(ValueError, match="train-00000.tokens is not the shard its manifest entry describes"):
        open_split(tmp_path, "train").take(np.array([0]))
    _manifest(tmp_path, shards)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(DatasetDamagedError, match=rf"holds {whole - 200} bytes but its manifest entry makes it {whole}"):
        open_split(tmp_path, "train")
    _manifest(tmp_path, [{"file": "train-00000.parquet", "rows": 3, "sha256": "0"}])
    with pytest.raises(ValueError, match="older format than this reader's; prepare the dataset again"):
        open_split(tmp_path, "train")


def test_a_shard_is_hashed_once_when_first_read_and_a_changed_byte_stops_the_read(tmp_path, monkeypatch):
    from model_core.data import shards as shards_module

    rows = _documents(6, 500, count=200)
    shards = write_shards(rows, tmp_path, "train", rows_per_shard=50, pad_id=PAD, vocab_size=512)
    _manifest(tmp_path, shards)
    hashed = []
    digest = shards_module.hashlib.file_digest
    monkeypatch.setattr(shards_module.hashlib, "file_digest", lambda file, name: hashed.append(file.name) or digest(file, name))
    split = open_split(tmp_path, "train")
    assert hashed == []  # opening a split stats its shards; it reads none
    split.take(np.array([0, 1, 120]))
    split.take(np.array([2, 121, 60]))
    assert len(hashed) == 3  # shards 0, 2 and 1, once each
    path = tmp_path / shards[3]["file"]
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # the same size: only the sha256 tells
    path.write_bytes(bytes(damaged))
    actual = file_sha256(path)
    with pytest.raises(DatasetDamagedError) as caught:
        open_split(tmp_path, "train").take(np.array([160]))
    assert str(caught.value) == (
        f"{path} has sha256 {actual} but manifest.json gives {shards[3]['sha256']}: the dataset changed after it "
        f"was prepared; delete {tmp_path} to have the dataset prepared again"
    )


def test_taking_rows_reads_those_rows_only(tmp_path, monkeypatch):
    from model_core.data import shards as shards_module

    rows = _documents(7, 500, count=3000)
    _manifest(tmp_path, write_shards(rows, tmp_path, "train", rows_per_shard=500, pad_id=PAD, vocab_size=512))
    split = open_split(tmp_path, "train")
    read_bytes = []
    original = shards_module._Shard._read

    def counting(self, file, section, into, first_item):
        read_bytes.append(into.nbytes)
        return original(self, file, section, into, first_item)

    monkeypatch.setattr(shards_module._Shard, "_read", counting)
    indices = np.random.default_rng(0).choice(len(rows), 8, replace=False)
    _assert_same_rows(split.take(indices), rows.take(indices))
    starts = int(np.diff(rows.doc_start_offsets)[indices].sum())
    # Each row's tokens (uint16), its two offsets and its document starts, and the header of each shard opened.
    assert sum(read_bytes) <= 8 * (17 * 2 + 2 * 8) + 4 * starts + 64 * 6


def test_a_split_of_many_shards_keeps_few_files_open_and_closes_them(tmp_path, monkeypatch):
    import gc
    import os

    from model_core.data import shards as shards_module

    monkeypatch.setattr(shards_module, "_OPEN_FILES", 3)
    rows = _documents(8, 500, count=300)
    _manifest(tmp_path, write_shards(rows, tmp_path, "train", rows_per_shard=5, pad_id=PAD, vocab_size=512))

    def open_here() -> int:
        # Only descriptors of this dataset's files: threads other tests left behind (Prefect's API client,
        # log shippers) open and close sockets of their own at any time.
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
            except OSError:  # closed between the listing and the read
                pass
        return count

    split = open_split(tmp_path, "train")
    for indices in np.random.default_rng(3).integers(0, len(rows), (20, 16)):
        _assert_same_rows(split.take(indices), rows.take(indices))
        assert 1 <= open_here() <= 3
    del split
    gc.collect()
    assert open_here() == 0


# ---------------------------------------------------------------------------------- loader on shards


@pytest.fixture
def stored(tmp_path):
    rows = _documents(6, 500, count=700)
    _manifest(tmp_path, write_shards(rows, tmp_path, "train", rows_per_shard=29, pad_id=PAD, vocab_size=512))
    return rows, open_split(tmp_path, "train")


def test_the_loader_on_shards_hands_out_the_rows_of_its_order(stored):
    rows, split = stored
    loader = ShuffledBatches(split, global_batch_rows=8, seed=11)
    # One source: sample k is row forward(k % rows) of epoch k // rows, batches running on across epochs.
    orders = [KeyedPermutation(len(rows), (11, 0, epoch)).forward(np.arange(len(rows))) for epoch in range(2)]
    order = np.concatenate(orders).astype(np.int64)
    batches = len(order) // 8
    for batch in range(batches):
        _assert_same_rows(loader.next_rows(), rows.take(order[batch * 8 : (batch + 1) * 8]))
    assert loader.state_dict()["samples"] == batches * 8


def test_the_loader_resumes_exactly_and_its_ranks_make_up_the_global_batch(stored):
    rows, split = stored
    straight = ShuffledBatches(split, global_batch_rows=12, seed=4)
    expected = [straight.next_rows().tokens for _ in range(70)]  # into the second epoch
    first = ShuffledBatches(split, global_batch_rows=12, seed=4)
    for _ in range(50):
        first.next_rows()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ShuffledBatches(split, global_batch_rows=12, seed=4)
    resumed.load_state_dict(state)
    halves = [ShuffledBatches(split, global_batch_rows=12, seed=4, rank=rank, world=2) for rank in (0, 1)]
    for half in halves:
        half.load_state_dict(state)
    for want in expected[50:]:
        np.testing.assert_array_equal(resumed.next_rows().tokens, want)
        np.testing.assert_array_equal(np.concatenate([half.next_rows().tokens for half in halves]), want)


def test_a_state_saved_under_another_order_is_refused(stored):
    _, split = stored
    state = {**ShuffledBatches(split, 8, seed=1).state_dict()}
    del state["order"]  # what the loader saved before keyed permutations
    with pytest.raises(ValueError, match="saved with order=None but this run has order=mixture-sainte-lague-keyed-feistel-1"):
        ShuffledBatches(split, 8, seed=1).load_state_dict(state)


def test_validation_batches_read_from_shards_equal_the_stored_rows(stored):
    rows, split = stored
    batches = list(sequential_batches(split, 5, 3, PAD, reset_at_documents=True))
    expected = list(sequential_batches(rows, 5, 3, PAD, reset_at_documents=True))
    assert len(batches) == 3
    for got, want in zip(batches, expected):
        for name in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
