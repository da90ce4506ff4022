"""What the machine reports about itself: the device kind and the peak memory of this run."""

from __future__ import annotations

import resource

import mindspore as ms


def device_target() -> str:
    return ms.get_context("device_target")


def peak_memory_bytes() -> int:
    """Peak device memory on accelerators; peak host RSS on CPU, where MindSpore reports 0."""
    if device_target() != "CPU":
        allocated = ms.runtime.max_memory_allocated()
        if allocated:
            return int(allocated)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
