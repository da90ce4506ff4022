"""The one durable write (model_core.storage): a reader sees the old version or the new one whole, a failed
write leaves the old version and no temporary, and what was renamed is on disk before the rename is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_core import storage
from model_core.data import shard_map


@pytest.fixture
def disk_events(monkeypatch) -> list[tuple]:
    """Every fsync (of the path it was opened as) and rename storage makes, in order."""
    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(descriptor: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{descriptor}"))))
        fsync(descriptor)

    def recording_replace(source, target) -> None:
        events.append(("rename", Path(source), Path(target)))
        replace(source, target)

    monkeypatch.setattr(storage.os, "fsync", recording_fsync)
    monkeypatch.setattr(storage.os, "replace", recording_replace)
    return events


def test_write_file_fsyncs_the_file_renames_it_then_fsyncs_the_parent(tmp_path, disk_events):
    final = tmp_path / "deep" / "report.md"
    assert storage.write_file(final, "naïve ✓\n") == final
    assert final.read_bytes() == "naïve ✓\n".encode()
    (_, temporary), rename, parent = disk_events
    assert temporary.parent == final.parent and temporary.name.startswith(".report.md.")
    assert rename == ("rename", temporary, final)
    assert parent == ("fsync", final.parent)
    assert sorted(os.listdir(final.parent)) == ["report.md"]


def test_replace_file_renames_into_place_without_an_fsync(tmp_path, disk_events):
    """A heartbeat's write: atomic for a reader, but no fsync of a file rewritten every second."""
    final = tmp_path / "heartbeat-rank0.json"
    final.write_text("old")
    storage.replace_file(final, '{"step": 3}')
    assert final.read_text() == '{"step": 3}'
    [(kind, temporary, target)] = disk_events
    assert kind == "rename" and target == final and temporary.parent == final.parent
    assert os.listdir(tmp_path) == [final.name]


def test_a_failed_file_write_leaves_the_old_file_and_no_temporary(tmp_path):
    final = tmp_path / "record.json"
    final.write_text("old\n")

    def half_then_fail(path: Path) -> None:
        path.write_text("half a rec")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        storage.build_file(final, half_then_fail)
    assert final.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["record.json"]


def test_build_directory_fsyncs_every_file_and_directory_before_the_rename(tmp_path, disk_events):
    final = tmp_path / "checkpoint"

    def write(directory: Path) -> None:
        (directory / "weights").write_bytes(b"w")
        (directory / "shards").mkdir()
        (directory / "shards" / "00000.bin").write_bytes(b"s")

    storage.build_directory(final, write, replace=False)
    assert (final / "shards" / "00000.bin").read_bytes() == b"s"
    *synced, rename, parent = disk_events
    building = rename[1]
    assert rename == ("rename", building, final) and parent == ("fsync", tmp_path)
    assert {path for _, path in synced} == {
        building / "weights", building / "shards" / "00000.bin", building / "shards", building
    }
    assert os.listdir(tmp_path) == ["checkpoint"]


def test_a_failed_directory_write_leaves_the_old_directory_and_no_temporary(tmp_path):
    final = tmp_path / "dataset"
    final.mkdir()
    (final / "manifest.json").write_text("old")

    def fail(directory: Path) -> None:
        (directory / "manifest.json").write_text("new")
        raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="tokenizer failed"):
        storage.build_directory(final, fail, replace=True)
    assert (final / "manifest.json").read_text() == "old"
    assert os.listdir(tmp_path) == ["dataset"]


def test_an_existing_directory_is_replaced_whole_or_refused(tmp_path):
    final = tmp_path / "adapters"
    storage.build_directory(final, lambda d: (d / "old").write_text("old"), replace=False)
    with pytest.raises(FileExistsError, match="adapters exists and is not empty"):
        storage.build_directory(final, lambda d: (d / "new").write_text("new"), replace=False)
    assert os.listdir(final) == ["old"]
    storage.build_directory(final, lambda d: (d / "new").write_text("new"), replace=True)
    assert os.listdir(final) == ["new"]
    assert os.listdir(tmp_path) == ["adapters"]  # the replaced copy is gone too


def test_a_directory_committed_first_by_another_process_is_refused_not_merged(tmp_path, monkeypatch):
    final = tmp_path / "map" / "0123"
    replace = os.replace

    def another_process_commits_first(source, target) -> None:
        Path(target).mkdir(parents=True)
        Path(target, shard_map.RESULT_NAME).write_text("{}")
        replace(source, target)

    monkeypatch.setattr(storage.os, "replace", another_process_commits_first)
    with pytest.raises(FileExistsError):
        storage.build_directory(final, lambda d: (d / "tokens.npy").write_bytes(b"mine"), replace=False)
    assert os.listdir(final) == [shard_map.RESULT_NAME]
    assert os.listdir(final.parent) == ["0123"]


def test_a_map_result_another_worker_committed_first_is_kept(tmp_path):
    final = tmp_path / "0123"
    storage.build_directory(final, lambda d: (d / shard_map.RESULT_NAME).write_text('{"first": true}'), replace=False)
    shard_map._commit_result(final, lambda d: (d / shard_map.RESULT_NAME).write_text('{"first": false}'))
    assert (final / shard_map.RESULT_NAME).read_text() == '{"first": true}'
    unfinished = tmp_path / "4567"
    unfinished.mkdir()
    (unfinished / "tokens.npy").write_bytes(b"")
    with pytest.raises(FileExistsError):  # a directory without a result is not a finished shard
        shard_map._commit_result(unfinished, lambda d: (d / shard_map.RESULT_NAME).write_text("{}"))
