"""A Ray cluster, Prefect API or MLflow server that does not answer stops a pipeline command within the
timeout its param sets, with one line naming the address and the param, and before anything is written."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows import cli
from params import load_params
from tasks.reachability import check_tracking_server

# Generous: each check is given 1 s; the bound is about not hanging, not about speed.
BOUND_S = 30.0


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for connection in accepted:
        connection.close()


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty working directory and a local MLflow store in it, which must stay empty."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def prep(workdir: Path, capsys, *overrides: str) -> tuple[int, str, float]:
    """`llmflow prep` into workdir/data: exit status, the last line on stderr, seconds taken."""
    started = time.monotonic()
    status = cli.main(["prep", "--set", f"data.output_dir={workdir / 'data'}", *[f"--set={o}" for o in overrides]])
    took = time.monotonic() - started
    return status, capsys.readouterr().err.strip().splitlines()[-1], took


@pytest.mark.parametrize("kind", ["closed", "silent"])
def test_a_ray_address_that_does_not_answer_stops_prep_within_the_timeout(kind, workdir, capsys, request):
    port = closed_port() if kind == "closed" else request.getfixturevalue("silent_port")
    address = f"127.0.0.1:{port}"
    status, last, took = prep(
        workdir, capsys, "data.runner=ray", f"data.ray_address={address}", "data.ray_connect_timeout_s=1"
    )
    assert status == 1 and took < BOUND_S
    why = "connection refused" if kind == "closed" else "accepts connections but no gRPC server answered within 1 s"
    assert last.startswith(f"llmflow prep: data.ray_address='{address}': no Ray cluster answers at {address} (")
    assert why in last
    assert "data.ray_connect_timeout_s=1" in last and "`ray status`" in last
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("kind", ["closed", "silent"])
def test_a_prefect_api_that_does_not_answer_stops_prep_within_the_timeout(kind, workdir, capsys, request):
    port = closed_port() if kind == "closed" else request.getfixturevalue("silent_port")
    url = f"http://127.0.0.1:{port}/api"
    with temporary_settings(updates={PREFECT_API_URL: url}):
        status, last, took = prep(workdir, capsys, "tracking.connect_timeout_s=1")
    assert status == 1 and took < BOUND_S
    why = "connection refused" if kind == "closed" else "no answer within 1 s"
    assert last.startswith(f"llmflow prep: PREFECT_API_URL={url}: the Prefect API does not answer ({why}")
    assert "tracking.connect_timeout_s=1" in last
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("kind", ["closed", "silent"])
def test_an_mlflow_server_that_does_not_answer_stops_prep_within_the_timeout(
    kind, workdir, capsys, request, monkeypatch
):
    port = closed_port() if kind == "closed" else request.getfixturevalue("silent_port")
    url = f"http://127.0.0.1:{port}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    status, last, took = prep(workdir, capsys, f"tracking.uri={url}", "tracking.connect_timeout_s=1")
    assert status == 1 and took < BOUND_S
    why = "connection refused" if kind == "closed" else "no answer within 1 s"
    assert last.startswith(f"llmflow prep: tracking.uri={url}: no MLflow tracking server answers ({why}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)  # the environment wins over params, and is named
    status, last, _ = prep(workdir, capsys, "tracking.connect_timeout_s=1")
    assert status == 1 and last.startswith(f"llmflow prep: MLFLOW_TRACKING_URI={url}: no MLflow tracking server")
    assert list(workdir.iterdir()) == []


def test_a_server_that_answers_even_with_an_error_status_passes(monkeypatch):
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_address[1]}")
        check_tracking_server(load_params("tiny", ["tracking.connect_timeout_s=5"]))
    finally:
        server.shutdown()
        server.server_close()
