"""Progress for model_core callbacks: one tqdm bar per named phase (shown only on a terminal), a log line per
metrics record and model_core's log lines through the Prefect run logger, and a stage's summary figures."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from pydantic import BaseModel
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
    """Metrics callback drawing one bar over optimizer steps: loss, learning rate, tokens/s, MFU (when the device's
    peak is known) and tqdm's ETA."""

    def __init__(self, total_steps: int, description: str = "train", initial: int = 0) -> None:
        """`total_steps`: the run's final step; `initial`: the step it starts at (resumed or continued)."""
        self.bar = tqdm(total=total_steps, initial=initial, desc=description, unit="step", disable=None)

    def __call__(self, record: dict[str, float]) -> None:
        self.bar.update(int(record["step"]) - self.bar.n)
        shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}"}
        shown["tokens_per_s"] = f"{record['tokens_per_second']:,.0f}"
        if "mfu" in record:
            shown["mfu"] = f"{record['mfu']:.1%}"
        self.bar.set_postfix(shown)

    def close(self) -> None:
        self.bar.close()


class IntervalLog:
    """Metrics callback writing one line per logged record (every `train.log_interval` steps) to the Prefect run
    logger, so a run under `llmflow run` or a worker shows its progress on the console and in the Prefect UI:

        pretrain step 120/400: loss 5.8123, lr 2.87e-04, 1,930 tokens/s, MFU 11.2% of measured 0.312 TFLOP/s, ETA 4m31s

    The ETA extrapolates the step rate measured since the first record, which leaves out compiling."""

    def __init__(self, stage: str, final_step: int, logger: logging.LoggerAdapter | None = None) -> None:
        self.stage, self.final_step = stage, final_step
        self.logger = logger if logger is not None else get_run_logger()
        self.first: tuple[float, int] | None = None  # (clock, step) at the first record

    def __call__(self, record: dict[str, float]) -> None:
        now, step = time.monotonic(), int(record["step"])
        parts = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_second']:,.0f} tokens/s"]
        if "mfu" in record:
            parts.append(f"MFU {record['mfu']:.1%}{peak_words(record)}")
        if "validation_loss" in record:
            parts.append(f"validation loss {record['validation_loss']:.4f}")
        if self.first is None:
            self.first = (now, step)
        elif step > self.first[1]:
            seconds_per_step = (now - self.first[0]) / (step - self.first[1])
            parts.append(f"ETA {duration(seconds_per_step * (self.final_step - step))}")
        self.logger.info(f"{self.stage} step {step}/{self.final_step}: {', '.join(parts)}")


def peak_words(record: dict[str, float]) -> str:
    """' of measured 0.312 TFLOP/s' (or 'datasheet'): the peak a record's MFU divides by, where the record has it."""
    if "mfu_peak_flops" not in record:
        return ""
    source = "measured" if record.get("mfu_peak_measured") else "datasheet"
    return f" of {source} {record['mfu_peak_flops'] / 1e12:.3g} TFLOP/s"


class StageFigures(BaseModel):
    """What a training stage's summary line shows beside its losses: whether it was reused, its wall time, its
    median tokens/s and its last validation loss (None where the run logged none)."""

    reused: bool = False
    wall_seconds: float = 0.0
    tokens_per_second: float | None = None
    validation_loss: float | None = None

    @classmethod
    def of(cls, history: list[dict[str, float]], wall_seconds: float, reused: bool) -> StageFigures:
        """From the stage's metrics records; the median leaves out the first interval's compiling."""
        speeds = [record["tokens_per_second"] for record in history if "tokens_per_second" in record]
        validation = [record["validation_loss"] for record in history if "validation_loss" in record]
        return cls(
            reused=reused,
            wall_seconds=wall_seconds,
            tokens_per_second=statistics.median(speeds) if speeds else None,
            validation_loss=validation[-1] if validation else None,
        )


def duration(seconds: float) -> str:
    """`42s`, `4m31s`, `2h05m`: a length of time as people read it."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


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
