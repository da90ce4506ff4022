"""The process's own host memory: hand the heap's free pages back to the system.

glibc keeps what a process frees on its heap for later allocations, so a one-off burst (compiling a graph,
building a checkpoint's arrays, a data-prep job's strings) stays in the resident set for the rest of the run and
the next peak lands on top of it. Trimming after such a burst returns those pages; it costs a walk of the heap,
so it belongs after rare events, never inside a step.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def release_free_heap() -> None:
    """`malloc_trim(0)`: every free page of every glibc arena back to the system. Nothing where libc is not glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
