"""Data prep's map steps as mapped Prefect tasks: the task runner params choose, results in job order, the
first failure at once, and the same dataset from one local worker, two, or a two-node local Ray cluster."""

from __future__ import annotations

import heapq
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import docstring_documents
from prefect import flow
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner
from prefect_ray import RayTaskRunner

from flows.data_prep import data_prep_flow
from model_core.data import DataPrepError
from params import load_params
from params.schema import DataParams, DataSource
from tasks import runners
from tasks.runners import check_ray_nodes_reach_api, factored_batches, map_task_runner, prefect_mapper

pytestmark = pytest.mark.usefixtures("prefect_harness")


def wait_for_the_next_job(job: tuple[int, Path]) -> int:
    """Job 0 finishes only after job 1, so the jobs finish out of order."""
    index, directory = job
    if index == 0:
        _wait_for(directory / "1.done")
    (directory / f"{index}.done").touch()
    return index * index


def fail_or_wait_for_the_failure(job: tuple[int, Path]) -> None:
    """Job 1 fails; job 0 notes whether the caller saw that failure while job 0 was still running."""
    index, directory = job
    if index == 1:
        raise DataPrepError(f"{directory / 'shard.jsonl'}:7: invalid JSON (Expecting value)")
    if _wait_for(directory / "failure-seen"):
        (directory / "job-0-saw-the-failure").touch()


def _wait_for(path: Path, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def ray_node(job: int) -> str:
    import ray

    time.sleep(1)  # while a job holds a node's one CPU, Ray sends the queued ones to the idle node
    return ray.get_runtime_context().get_node_id()


def test_the_task_runner_follows_data_params(tmp_path):
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in files:
        path.write_text('{"text": "a document"}\n')
    two_shards = [DataSource(kind="jsonl", paths=[str(path) for path in files])]
    one = map_task_runner(DataParams(sources=two_shards, num_workers=1))
    two = map_task_runner(DataParams(sources=two_shards, num_workers=2))
    assert isinstance(one, ThreadPoolTaskRunner) and one._max_workers == 1  # this process: nothing to start
    assert isinstance(two, ProcessPoolTaskRunner) and two._max_workers == 2
    single_shard = map_task_runner(DataParams(num_workers=2))  # the standard library's docstrings: one shard
    assert isinstance(single_shard, ThreadPoolTaskRunner)
    assert map_task_runner(DataParams(runner="ray", ray_address="ray://head:10001")).address == "ray://head:10001"
    # prefect-ray hands a bare ray.init() both null and "auto", which joins a cluster found here or else
    # starts one; null must start one, "auto" must find one.
    assert map_task_runner(DataParams(runner="ray")).address == "local"
    auto = map_task_runner(DataParams(runner="ray", ray_address="auto"))
    assert auto.address is None and auto.init_kwargs["address"] == "auto"


def test_results_come_back_in_job_order(tmp_path):
    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def square():
        return list(prefect_mapper("square", wait_for_the_next_job, [(0, tmp_path), (1, tmp_path), (2, tmp_path)]))

    assert square() == [0, 1, 4]


def square(number: int) -> int:
    return number * number


def test_batched_results_come_back_in_job_order():
    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def squares():
        return list(prefect_mapper("square", square, list(range(11)), parallelism=2))

    assert squares() == [number * number for number in range(11)]


@pytest.mark.parametrize("jobs", [1, 2, 5, 30, 119, 477])
@pytest.mark.parametrize("parallelism", [1, 2, 3, 8])
def test_factored_batches_shrink_and_cover_every_job(jobs, parallelism):
    sizes = factored_batches(jobs, parallelism)
    assert sum(sizes) == jobs and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)
    assert len(sizes) <= 2 * parallelism * (np.log2(max(jobs / parallelism, 1)) + 2)


@pytest.mark.parametrize("jobs", [30, 119, 477])
def test_workers_taking_factored_batches_finish_within_a_job_of_each_other(jobs):
    """Two workers take the next batch as they finish one; jobs cost 0.8 to 1.2 (shards of one size
    whose text encodes at different speeds). Eight equal batches left them up to three jobs apart."""
    for seed in range(20):
        costs = np.random.default_rng(seed).uniform(0.8, 1.2, jobs)
        finish, first = [0.0, 0.0], 0
        for size in factored_batches(jobs, 2):
            heapq.heappush(finish, heapq.heappop(finish) + costs[first : first + size].sum())
            first += size
        assert max(finish) - min(finish) <= 1.2


def test_the_first_failure_comes_back_at_once_as_the_jobs_own_error(tmp_path):
    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def fail():
        try:
            list(prefect_mapper("fail", fail_or_wait_for_the_failure, [(0, tmp_path), (1, tmp_path)]))
        except DataPrepError:
            (tmp_path / "failure-seen").touch()
            raise

    message = re.escape(f"{tmp_path / 'shard.jsonl'}:7: invalid JSON (Expecting value)")
    with pytest.raises(DataPrepError, match=rf"^{message}$"):
        fail()
    assert (tmp_path / "job-0-saw-the-failure").exists()


def test_ray_nodes_on_other_machines_are_refused_a_loopback_api(monkeypatch):
    import ray

    nodes = [{"NodeManagerAddress": "10.0.0.1", "Alive": True}, {"NodeManagerAddress": "10.0.0.2", "Alive": True}]
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(runners, "api_url", lambda: "http://127.0.0.1:4200/api")
    with pytest.raises(ValueError, match=r"Ray nodes on 10\.0\.0\.2 cannot reach .* http://127\.0\.0\.1:4200/api"):
        check_ray_nodes_reach_api()
    nodes[1]["Alive"] = False
    check_ray_nodes_reach_api()
    nodes[1]["Alive"] = True
    monkeypatch.setattr(runners, "api_url", lambda: "http://10.0.0.1:4200/api")
    check_ray_nodes_reach_api()


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster of two single-CPU nodes, shared by this module's Ray tests (it takes ~15 s to start)."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        # Ray's workers unpickle this module's step functions by name.
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()


def corpus_files(directory: Path, bad_lines: dict[int, bytes] | None = None) -> list[Path]:
    """The docstring corpus as two JSONL files; `bad_lines` replace lines (1-based) of the second."""
    documents = docstring_documents()
    files = []
    for number, texts in enumerate((documents[::2], documents[1::2])):
        lines = [json.dumps({"text": text}).encode() for text in texts]
        for line, content in (bad_lines or {}).items() if number == 1 else ():
            lines[line - 1] = content
        path = directory / f"part-{number}.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        files.append(path)
    return files


def prep_params(files: list[Path], output_dir: Path, *overrides: str, kind: str = "jsonl"):
    paths = ", ".join(f"'{path}'" for path in files)
    return load_params(
        "tiny",
        [
            f"data.sources=[{{kind: {kind}, paths: [{paths}]}}]",
            f"data.output_dir={output_dir}",
            "data.shard_bytes=8192",  # several byte-range shards per file: several jobs per map step
            "data.rows_per_shard=64",
            "model.vocab_size=512",
            "model.seq_len=32",
            "tracking.experiment=data-runners",
            *overrides,
        ],
    )


@pytest.mark.slow
def test_a_steps_jobs_run_on_both_ray_nodes(ray_address):
    @flow(task_runner=RayTaskRunner(address=ray_address))
    def where():
        return list(prefect_mapper("ray-node", ray_node, list(range(4))))

    assert len(set(where())) == 2


@pytest.mark.slow
def test_one_and_two_local_workers_and_a_two_node_ray_cluster_write_identical_manifests(
    tmp_path, mlflow_uri, ray_address
):
    files = corpus_files(tmp_path)
    mixture = f"data.sources=[{{kind: jsonl, paths: ['{files[0]}'], weight: 0.7}}, {{kind: jsonl, paths: ['{files[1]}'], weight: 0.3}}]"
    runs = {
        "one local worker": ["data.num_workers=1"],
        "two local workers": ["data.num_workers=2"],
        "ray": ["data.runner=ray", f"data.ray_address={ray_address}"],
    }
    manifests, reports = {}, {}
    for name, overrides in runs.items():
        result = data_prep_flow(prep_params(files, tmp_path / name.replace(" ", "-"), mixture, *overrides))
        manifests[name] = result.manifest_path.read_bytes()
        reports[name] = json.loads((result.dataset_dir / "prep_report.json").read_text())
    assert reports["ray"]["reuse"]["input_shards"] >= 4
    assert manifests["one local worker"] == manifests["two local workers"] == manifests["ray"]
    assert [source["rows"] > 0 for source in json.loads(manifests["ray"])["splits"]["train"]["sources"]] == [True, True]


@pytest.mark.slow
def test_a_bad_shard_on_ray_is_reported_with_its_file_and_line(tmp_path, mlflow_uri, ray_address):
    malformed, undecodable = 30, 35  # of the second file's 39 lines: read by its fourth byte-range job
    files = corpus_files(tmp_path, {malformed: b'{"text": "cut short', undecodable: b'{"text": "bad \xff byte"}'})
    ray = ["data.runner=ray", f"data.ray_address={ray_address}"]

    kept = data_prep_flow(prep_params(files, tmp_path / "kept", *ray, "data.max_bad_record_fraction=0.05"))
    bad_records = json.loads(kept.manifest_path.read_text())["bad_records"]
    assert [record.split(": ")[0] for record in bad_records] == [f"{files[1]}:{malformed}", f"{files[1]}:{undecodable}"]
    assert "invalid JSON" in bad_records[0] and "undecodable" in bad_records[1]

    first = re.escape(f"first: {files[1]}:{malformed}: invalid JSON")
    with pytest.raises(DataPrepError, match=rf"^1 of \d+ records .* are malformed, .*; {first}"):
        data_prep_flow(prep_params(files, tmp_path / "refused", *ray, "data.max_bad_record_fraction=0"))


@pytest.mark.slow
def test_an_error_raised_in_a_ray_job_reaches_the_caller_as_itself(tmp_path, mlflow_uri, ray_address):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "notes.parquet"
    pq.write_table(pa.table({"body": docstring_documents()}), parquet)
    ray = ["data.runner=ray", f"data.ray_address={ray_address}"]
    with pytest.raises(DataPrepError, match=rf"^{re.escape(str(parquet))}: no column 'text' \(columns: body\)$"):
        data_prep_flow(prep_params([parquet], tmp_path / "out", *ray, kind="parquet"))
