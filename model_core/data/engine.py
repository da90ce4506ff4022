"""How data prep's map steps run: a `Mapper` applies one step function to a list of jobs and hands the
results back in job order.

Every step of `prepare_dataset` is written as a module-level function of one small picklable job (paths,
numbers, params) that reads and writes files under data.output_dir and returns a small dict, so the
same steps run in this process, in local worker processes (`local_mapper`, the default) or on a cluster
through an orchestrator's mapper (Prefect tasks on a Ray cluster, in tasks/). The results may come
back lazily; prep reports progress as each one arrives.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from model_core.host_memory import release_free_heap

Mapper = Callable[[str, Callable[[Any], Any], list[Any]], Iterable[Any]]


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


class LocalMapper:
    """Jobs in up to `workers` "spawn" worker processes, or in this process when there is one worker or one
    job. The processes start with the first step that needs them and serve every later step, until
    `close` (a worker costs about a second to start: interpreter, numpy, sentencepiece).

    Never "fork": prep runs inside Prefect flows, whose process has threads, and a child forked while
    another thread holds a lock (logging's, say) can hang on it forever.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, step: str, function: Callable[[Any], Any], jobs: list[Any]) -> Iterable[Any]:
        if self.workers <= 1 or len(jobs) <= 1:
            return map(function, jobs)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool.map(functools.partial(_run_and_trim, function), jobs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> LocalMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_jobs(function: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    """`function(job)` of each job in turn, the heap trimmed after each (a batch of jobs in one task)."""
    return [_run_and_trim(function, job) for job in jobs]


def _run_and_trim(function: Callable[[Any], Any], job: Any) -> Any:
    """Run one job, then hand the heap's free pages back to the system: a worker serves many jobs, and
    without this glibc keeps each job's freed strings and arrays mapped, so its RSS creeps up job by job."""
    try:
        return function(job)
    finally:
        release_free_heap()
