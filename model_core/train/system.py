"""What the machine reports about itself: the device kind and the peak memory of this run (and of each rank)."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import mindspore as ms

from model_core.parallel.launch import RANK_MEMORY
from model_core.storage import write_file


def device_target() -> str:
    return ms.get_context("device_target")


def peak_memory_bytes() -> int:
    """Peak device memory on accelerators; peak host RSS on CPU, where MindSpore reports 0."""
    if device_target() != "CPU":
        allocated = ms.runtime.max_memory_allocated()
        if allocated:
            return int(allocated)
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's own peak resident set size.

    Linux keeps `ru_maxrss` across fork and exec, so a process started by a large one (a worker launched
    from a pipeline, a test started by pytest) reports its parent's peak when that is higher (an example:
    benchmarks/README.md, "Rank memory"). VmHWM belongs to the process's own address space.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # elsewhere: KiB on Linux, bytes on macOS


def record_rank_peak_memory(checkpoint_dir: str | Path, rank: int) -> Path:
    """This rank's peak memory as `<checkpoint_dir>/rank-memory/rank-<rank>.json`, written whole (temp, rename)."""
    record = json.dumps({"rank": rank, "peak_memory_bytes": peak_memory_bytes()}) + "\n"
    return write_file(Path(checkpoint_dir) / RANK_MEMORY / f"rank-{rank}.json", record)
