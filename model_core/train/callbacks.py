"""Metrics callbacks the trainer can report to: a JSONL log and a fan-out to several sinks; and the reader
that follows another process's JSONL log (rank 0 of a multi-rank job) into a callback while it is written."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MetricsCallback = Callable[[dict[str, float]], None]


def jsonl_writer(path: str | Path) -> MetricsCallback:
    """Append each record as one JSON line, flushed per record so a crash keeps what was logged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(record: dict[str, float]) -> None:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    return write


def fan_out(*callbacks: MetricsCallback | None) -> MetricsCallback:
    """One callback that calls each given one (None entries are skipped)."""
    chosen = [callback for callback in callbacks if callback is not None]

    def call(record: dict[str, float]) -> None:
        for callback in chosen:
            callback(record)

    return call


@contextmanager
def follow_jsonl(path: str | Path, on_record: MetricsCallback, poll_seconds: float = 0.5) -> Iterator[list[dict]]:
    """While the block runs, hand every complete line appended to `path` to `on_record`, in order; the
    yielded list collects the records. Lines written before the block ends are all delivered."""
    path, records, stop = Path(path), [], threading.Event()
    position, partial = 0, b""

    def deliver() -> None:
        nonlocal position, partial
        if not path.is_file():
            return
        with path.open("rb") as handle:
            handle.seek(position)
            chunk = handle.read()
        position += len(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                records.append(json.loads(line))
                on_record(records[-1])

    def follow() -> None:
        while not stop.wait(poll_seconds):
            deliver()

    follower = threading.Thread(target=follow, name="follow-metrics", daemon=True)
    follower.start()
    try:
        yield records
    finally:
        stop.set()
        follower.join()
        deliver()
