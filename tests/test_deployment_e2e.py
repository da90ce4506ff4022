"""End to end as a user runs it: a real Prefect server, a process work pool, a deployment, a worker,
`prefect deployment run pretrain-flow/nightly`, and the MLflow runs it leaves behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import small_pipeline_overrides
from params import load_params

REPO_ROOT = Path(__file__).resolve().parent.parent
POOL = "llmflow-local"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(api_url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"prefect server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout} s")


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def _prefect(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "prefect", *args]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_deployment_run_completes_and_is_tracked(corpus_jsonl, tmp_path):
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_URI": mlflow_uri,
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # the worker finds the run at once, not within 10 s
    }
    server_cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = _start(server_cmd, env, tmp_path / "server.log")
    worker = None
    try:
        _wait_healthy(api_url, server)
        _prefect(["work-pool", "create", POOL, "--type", "process"], env, timeout=120)
        _prefect(
            ["--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "nightly"],
            env,
            timeout=180,
        )
        worker_cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
        worker = _start(worker_cmd, env, tmp_path / "worker.log")

        params = load_params("tiny", small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "deployed"))
        run_args = ["deployment", "run", "pretrain-flow/nightly", "--params", json.dumps({"params": params.model_dump(mode="json")})]
        done = _prefect([*run_args, "--watch", "--watch-interval", "1", "--watch-timeout", "600"], env, timeout=660)
        assert "Completed" in done.stdout, done.stdout + (tmp_path / "worker.log").read_text()[-3000:]

        client = MlflowClient(mlflow_uri)
        experiment = client.get_experiment_by_name("deployed")
        runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
        parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert parents[0].data.tags["prefect.deployment"] == "nightly"
        stages = [run.data.tags["llmflow.stage"] for run in runs if "mlflow.parentRunId" in run.data.tags]
        assert stages == ["data_prep", "smoke", "pretrain", "evaluate"]
        assert all(run.info.status == "FINISHED" for run in runs)

        schedules = _prefect(["deployment", "inspect", "pretrain-flow/nightly"], env, timeout=60).stdout
        assert "'active': False" in schedules and "0 2 * * *" in schedules
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)
    assert server.poll() is not None and (worker is None or worker.poll() is not None)
