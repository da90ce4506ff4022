"""MLflow bookkeeping that needs no pipeline: metrics reach MLflow in batches, and at least every 30 s."""

from __future__ import annotations

from tasks import tracking
from tasks.tracking import MetricsBatcher


class _Run:
    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def log_metric_records(self, records) -> None:
        self.sent.append([step for step, _ in records])


def test_metrics_go_out_every_50_records_or_after_30_seconds(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(tracking.time, "monotonic", lambda: now[0])
    run = _Run()
    with MetricsBatcher(run) as batcher:
        for step in range(1, 51):
            batcher({"step": step, "loss": 1.0})
        assert run.sent == [list(range(1, 51))]
        batcher({"step": 51, "loss": 1.0})
        now[0] += 29.0
        batcher({"step": 52, "loss": 1.0})
        assert len(run.sent) == 1  # 29 s: still waiting
        now[0] += 1.0
        batcher({"step": 53, "loss": 1.0})
        assert run.sent[-1] == [51, 52, 53]  # 30 s since the last call: sent
        batcher({"step": 54, "loss": 1.0})
    assert run.sent[-1] == [54]  # the rest when the stage ends
