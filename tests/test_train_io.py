"""Trainer I/O without a model: the resumable batch loader, checkpoints on disk, and loss scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_core.data import PackedRows
from model_core.train import checkpoint as ckpt
from model_core.train.loader import ShuffledBatches, make_batch, sequential_batches
from model_core.train.precision import LossScale, PrecisionError, check_precision
from params.schema import PrecisionParams


def _rows(count: int, row_len: int = 9, pad_id: int = 3) -> PackedRows:
    tokens = (np.arange(count * row_len, dtype=np.int32) % 97 + 10).reshape(count, row_len)
    tokens[-1, -2:] = pad_id  # the padded last row of `last_row: pad`
    starts = [np.array([0, 4]) if i % 2 else np.array([0]) for i in range(count)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in starts])])
    return PackedRows(tokens, np.concatenate(starts).astype(np.int32), offsets)


def test_batch_shifts_labels_and_masks_padding():
    rows = _rows(4)
    batch = make_batch(rows.take(np.array([3])), pad_id=3, reset_at_documents=False)
    assert batch.tokens.shape == batch.labels.shape == (1, 8)
    np.testing.assert_array_equal(batch.labels[0], rows.tokens[3, 1:])
    np.testing.assert_array_equal(batch.loss_mask[0], [1, 1, 1, 1, 1, 1, 0, 0])
    assert batch.counted_tokens == 6


def test_document_reset_positions_follow_doc_starts():
    batch = make_batch(_rows(2).take(np.array([1])), pad_id=3, reset_at_documents=True)
    np.testing.assert_array_equal(batch.position_ids[0], [0, 1, 2, 3, 0, 1, 2, 3])
    np.testing.assert_array_equal(batch.segment_ids[0], [0, 0, 0, 0, 1, 1, 1, 1])


def test_epoch_visits_every_row_once_in_a_seeded_order():
    rows = _rows(12)
    loader = ShuffledBatches(rows, global_batch_rows=4, seed=7)
    seen = np.concatenate([loader.next_rows().tokens[:, 0] for _ in range(3)])
    assert sorted(seen.tolist()) == sorted(rows.tokens[:, 0].tolist())
    again = ShuffledBatches(rows, global_batch_rows=4, seed=7)
    np.testing.assert_array_equal(np.concatenate([again.next_rows().tokens[:, 0] for _ in range(3)]), seen)
    other = ShuffledBatches(rows, global_batch_rows=4, seed=8)
    assert not np.array_equal(np.concatenate([other.next_rows().tokens[:, 0] for _ in range(3)]), seen)
    next_epoch = np.concatenate([loader.next_rows().tokens[:, 0] for _ in range(3)])
    assert not np.array_equal(next_epoch, seen) and sorted(next_epoch.tolist()) == sorted(seen.tolist())


def test_resumed_loader_continues_exactly():
    rows = _rows(10)
    straight = ShuffledBatches(rows, global_batch_rows=3, seed=1)
    expected = [straight.next_rows().tokens for _ in range(8)]
    first = ShuffledBatches(rows, global_batch_rows=3, seed=1)
    for _ in range(5):
        first.next_rows()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ShuffledBatches(rows, global_batch_rows=3, seed=1)
    resumed.load_state_dict(state)
    for want in expected[5:]:
        np.testing.assert_array_equal(resumed.next_rows().tokens, want)


def test_ranks_split_each_global_batch():
    rows = _rows(8)
    whole = ShuffledBatches(rows, global_batch_rows=4, seed=0).next_rows().tokens
    halves = [ShuffledBatches(rows, 4, 0, rank=r, world=2).next_rows().tokens for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)


def test_loader_refuses_mismatched_state_and_tiny_splits():
    loader = ShuffledBatches(_rows(10), global_batch_rows=2, seed=1)
    with pytest.raises(ValueError, match="saved with seed=1 but this run has seed=2"):
        ShuffledBatches(_rows(10), global_batch_rows=4, seed=2).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="has 3 rows, fewer than one global batch of 4 rows"):
        ShuffledBatches(_rows(3), global_batch_rows=4, seed=1)


def test_validation_batches_are_fixed_and_bounded():
    rows = _rows(10)
    first = [b.tokens for b in sequential_batches(rows, 3, 2, 3, False)]
    assert len(first) == 2
    np.testing.assert_array_equal(first[1], rows.tokens[3:6, :-1])
    assert len(list(sequential_batches(rows, 3, 99, 3, False))) == 3


def _tensors(seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32)}, {"adam_m.w": rng.normal(size=(3, 4)).astype(np.float32)}


def test_checkpoint_round_trip_is_exact_and_prunes(tmp_path):
    for step in (1, 2, 3):
        weights, moments = _tensors(step)
        ckpt.save_checkpoint(tmp_path, step, weights, moments, {"step": step}, keep=2)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    weights, moments, state = ckpt.latest_valid(tmp_path).load()
    expected_weights, expected_moments = _tensors(3)
    np.testing.assert_array_equal(weights["w"], expected_weights["w"])
    np.testing.assert_array_equal(moments["adam_m.w"], expected_moments["adam_m.w"])
    assert state == {"step": 3}


def test_corrupted_newest_checkpoint_is_skipped(tmp_path, caplog):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, *_tensors(step), {"step": step}, keep=3)
    newest = tmp_path / "step-00000002" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-8] + b"garbage!")
    assert ckpt.latest_valid(tmp_path).step == 1
    assert "skipping corrupted checkpoint" in caplog.text and "model.safetensors" in caplog.text


def test_no_checkpoint_means_none(tmp_path):
    assert ckpt.latest_valid(tmp_path / "absent") is None


def test_bf16_on_cpu_is_refused_at_start_up():
    with pytest.raises(PrecisionError, match="compute_dtype=bfloat16 cannot train on CPU"):
        check_precision(PrecisionParams(compute_dtype="bfloat16"), "CPU")
    check_precision(PrecisionParams(compute_dtype="float16"), "CPU")
    check_precision(PrecisionParams(compute_dtype="bfloat16"), "Ascend")


def test_dynamic_loss_scale_backs_off_and_grows():
    scale = LossScale.from_params(PrecisionParams(compute_dtype="float16", initial_loss_scale=1024, loss_scale_window=2))
    scale.update(finite=False)
    assert scale.scale == 512
    scale.update(True)
    scale.update(True)
    assert scale.scale == 1024
    fixed = LossScale.from_params(PrecisionParams(compute_dtype="float32"))
    fixed.update(False)
    assert fixed.scale == 1.0


def test_follow_jsonl_hands_over_every_line_in_order_while_it_is_written(tmp_path):
    import json
    import threading

    from model_core.train.callbacks import follow_jsonl, jsonl_writer

    path, seen, first_delivered = tmp_path / "m.jsonl", [], threading.Event()
    write = jsonl_writer(path)

    def on_record(record):
        seen.append(record)
        first_delivered.set()

    def writer():
        write({"step": 1})
        live.append(first_delivered.wait(timeout=30))  # the follower reads while the file is still growing
        for step in range(2, 21):
            write({"step": step})

    live = []
    with follow_jsonl(path, on_record, poll_seconds=0.02) as records:
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
    assert live == [True]
    assert [r["step"] for r in seen] == [r["step"] for r in records] == list(range(1, 21))
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 20}
