"""Where data prep's map steps run: a Prefect task runner chosen by params, and the `Mapper` that
model_core's `prepare_dataset` hands each map step to.

Each step becomes one mapped Prefect task named after the step, a task run per job, on the task runner
of the enclosing flow run: `ThreadPoolTaskRunner(1)` for one local worker (this process, nothing to
start), `ProcessPoolTaskRunner` ("spawn" processes) for several, or prefect-ray's `RayTaskRunner` on a
Ray cluster. Jobs and results are small and picklable; the work itself reads and writes files under
data.output_dir, which every worker must see.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from prefect import task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture, as_completed
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from model_core.data.engine import run_jobs
from model_core.data.errors import DataPrepError
from model_core.data.input_shards import plan_shards
from model_core.data.sources import list_inputs
from params.schema import DataParams
from tasks.retry import retry_on_transient_io


def map_task_runner(data: DataParams) -> TaskRunner:
    """The task runner for data prep's flow run, from data.runner, data.num_workers and data.ray_address."""
    if data.runner == "ray":
        from prefect_ray import RayTaskRunner  # imports Ray, which only runner=ray needs

        if data.ray_address == "auto":
            # prefect-ray turns "auto" into a bare ray.init(), which starts a new local Ray when it finds no
            # cluster; handed to ray.init itself, "auto" without a running cluster is an error.
            return RayTaskRunner(init_kwargs={"address": "auto"})
        # null: a new Ray instance on this machine, never one that `ray start` left running here.
        return RayTaskRunner(address=data.ray_address or "local")
    workers = data.num_workers or len(os.sched_getaffinity(0))
    if workers == 1 or _input_shards(data) == 1:
        # One shard makes every step one job: worker processes would only add their start (seconds each).
        return ThreadPoolTaskRunner(max_workers=1)
    return ProcessPoolTaskRunner(max_workers=workers)


def _input_shards(data: DataParams) -> int:
    """How many input shards the corpus is cut into (a listing, a few small reads; no file is hashed). An
    input that cannot be listed counts as several: prep itself then reports the problem."""
    try:
        return len(plan_shards(list_inputs(data.sources), data.shard_bytes, {}))
    except (DataPrepError, OSError):
        return 2


def prefect_mapper(
    step: str, function: Callable[[Any], Any], jobs: list[Any], parallelism: int | None = None
) -> Iterator[Any]:
    """`function(job)` for each job, as task runs of the task `step` on the flow run's task runner: a run
    per job, or, given the task runs that run at once (`parallelism`), the jobs cut into consecutive
    batches that shrink towards the end (`factored_batches`). The results come back in job order, each
    batch's as soon as it and those before it are done. A step of one job runs in this thread: a task run
    would only add its start, and the first one a worker process's (on 1 GB, hashing the one input file
    in a task run held the map step's second worker back by 7 s, which it never made up).

    Batches, because a task run costs Prefect about 0.2 s of state changes through its API: with a run per
    8 MiB shard, that was a quarter of a 1 GB prep's time on 2 cores. Shrinking ones, because with equal
    batches a worker that finished its last one could wait up to a whole batch for the others. The first
    failure is raised as soon as it comes back, as the exception the job raised (a DataPrepError keeps its
    message, whichever worker read the file); jobs still queued are cancelled when the flow run's task
    runner shuts down.
    """
    if len(jobs) == 1:
        return iter(run_jobs(function, jobs))
    step_task = task(
        run_jobs,
        name=step,
        cache_policy=NO_CACHE,  # model_core caches map results by content hash under data.output_dir
        retries=2,
        retry_delay_seconds=5,
        retry_condition_fn=retry_on_transient_io,
    )
    sizes = [1] * len(jobs) if parallelism is None else factored_batches(len(jobs), parallelism)
    bounds = [0, *itertools.accumulate(sizes)]
    batches = [jobs[start:end] for start, end in zip(bounds, bounds[1:])]
    # Task runs in worker processes find the API in the settings they are sent. Without PREFECT_API_URL
    # (Prefect's temporary server for this run) each worker process would start a server of its own.
    with temporary_settings(updates={PREFECT_API_URL: api_url()}):
        futures = step_task.map(unmapped(function), batches)
    return (result for results in _in_job_order(futures) for result in results)


def factored_batches(jobs: int, parallelism: int) -> list[int]:
    """Batch sizes for `jobs` jobs on `parallelism` workers that take the next batch as they finish one
    ("factoring", Hummel, Schonberg and Flynn 1992): in rounds of `parallelism` batches, each batch holds
    half the jobs left at the round's start over `parallelism`. A round's work still outweighs whatever a
    worker is behind by, so the workers finish together, within about the last (one-job) batch, in
    2 * parallelism * log2(jobs / parallelism) batches or so, against `jobs` at a run each."""
    sizes: list[int] = []
    left = jobs
    while left:
        size = max(1, math.ceil(left / (2 * parallelism)))
        for _ in range(parallelism):
            sizes.append(min(size, left))
            left -= sizes[-1]
            if not left:
                break
    return sizes


def map_parallelism(data: DataParams) -> int:
    """The map jobs that run at once: local workers, or the CPUs of the Ray cluster (one per job)."""
    if data.runner == "ray":
        import ray

        return max(1, int(ray.cluster_resources().get("CPU", 1)))
    return data.num_workers or len(os.sched_getaffinity(0))


def _in_job_order(futures: list[PrefectFuture[Any]]) -> Iterator[Any]:
    position = {future: index for index, future in enumerate(futures)}
    finished: dict[int, Any] = {}
    next_index = 0
    for future in as_completed(futures):
        finished[position[future]] = future.result()
        while next_index in finished:
            yield finished.pop(next_index)
            next_index += 1


def api_url() -> str:
    """The Prefect API of this flow run: PREFECT_API_URL, or the temporary server Prefect started for it."""
    return PREFECT_API_URL.value() or str(FlowRunContext.get().client.api_url)


def check_ray_nodes_reach_api() -> None:
    """Refuse Ray nodes on other machines when the Prefect API listens on this machine's loopback only:
    their task runs would retry the connection for minutes before failing."""
    import ray

    url = api_url()
    if not _is_loopback(urlsplit(url).hostname or ""):
        return
    here = ray.util.get_node_ip_address()
    elsewhere = sorted({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]} - {here})
    if elsewhere:
        raise ValueError(
            f"data.runner=ray: the Ray nodes on {', '.join(elsewhere)} cannot reach this run's Prefect API at "
            f"{url}, on this machine's loopback; start a Prefect server that every node can reach "
            f"(prefect server start --host 0.0.0.0) and set PREFECT_API_URL to it"
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
