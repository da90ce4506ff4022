"""The peak of MindSpore's memory pool in a benchmark's worker processes: what an accelerator's memory would hold of
a step's tensors (activations, fresh gradients, buffers), without the host memory a CPU process's RSS also holds
(compiled graphs, kernel objects, the free heap glibc keeps).

`record_pool_peaks()` makes every MindSpore process started after it print its pool's statistics at exit
(MS_DEV_RUNTIME_CONF=memory_statistics:True); `pool_peaks(logs, workers)` reads each rank's peak from its log
(`worker_<rank>.log`, as `model_core.parallel.launch` names them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STATISTICS = "memory_statistics:True"
PEAK = re.compile(r"actual peak used mem:(\d+)M")


def record_pool_peaks() -> None:
    conf = os.environ.get("MS_DEV_RUNTIME_CONF", "")
    if STATISTICS not in conf:
        os.environ["MS_DEV_RUNTIME_CONF"] = f"{conf},{STATISTICS}" if conf else STATISTICS


def pool_peak_bytes(log: Path) -> int | None:
    """The pool's peak over the process's run, from the statistics MindSpore printed at exit (in MiB); None where the
    log has none."""
    found = [int(value) for value in PEAK.findall(log.read_text(errors="replace"))] if log.exists() else []
    return max(found) * 2**20 if found else None


def pool_peaks(logs: Path, workers: int) -> list[int | None]:
    """Each rank's pool peak, from the worker logs in `logs`."""
    return [pool_peak_bytes(logs / f"worker_{rank}.log") for rank in range(workers)]
