"""Metrics callbacks the trainer can report to: a JSONL log and a fan-out to several sinks."""

from __future__ import annotations

import json
from collections.abc import Callable
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
