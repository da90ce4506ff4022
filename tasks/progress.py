"""Progress for model_core callbacks: one tqdm bar per named phase (shown only on a terminal), and model_core's
log lines forwarded to the Prefect run logger."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from tqdm.auto import tqdm


class PhaseProgress:
    """Callable `progress(phase, done, total)` that model_core reports to; closes bars as phases change."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.phase: str | None = None
        self.bar: tqdm | None = None

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if phase != self.phase:
            self.close()
            self.phase = phase
            self.bar = tqdm(total=total, desc=f"{self.description}: {phase}", disable=None, leave=False)
        if self.bar is not None:
            if total is not None and self.bar.total != total:
                self.bar.total = total
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None
        self.phase = None


class TrainingProgress:
    """Metrics callback drawing one bar over optimizer steps: loss, tokens/s and tqdm's ETA."""

    def __init__(self, total_steps: int, description: str = "train", initial: int = 0) -> None:
        """`total_steps`: the run's final step; `initial`: the step it starts at (resumed or continued)."""
        self.bar = tqdm(total=total_steps, initial=initial, desc=description, unit="step", disable=None)

    def __call__(self, record: dict[str, float]) -> None:
        self.bar.update(int(record["step"]) - self.bar.n)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tokens_per_s=f"{record['tokens_per_second']:,.0f}")

    def close(self) -> None:
        self.bar.close()


@contextmanager
def forwarded_logs(logger_name: str, level: int = logging.INFO) -> Iterator[None]:
    """Records of a model_core logger go to the Prefect run logger while the block runs, so they show on the
    console and in the Prefect UI (model_core logs with the standard library and knows nothing of Prefect)."""
    source = logging.getLogger(logger_name)
    handler = _ToRunLogger(get_run_logger())
    handler.setLevel(level)
    saved_level, saved_propagate = source.level, source.propagate
    source.addHandler(handler)
    source.setLevel(min(level, saved_level or level))
    source.propagate = False  # shown once, by the run logger
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.setLevel(saved_level)
        source.propagate = saved_propagate


class _ToRunLogger(logging.Handler):
    def __init__(self, run_logger: logging.LoggerAdapter) -> None:
        super().__init__()
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        self.run_logger.log(record.levelno, record.getMessage())
