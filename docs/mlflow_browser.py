"""What the MLflow browser checks (docs/check_mlflow_*.py) share: their arguments, a store of shrunk tiny pipeline
runs made with `llmflow run` as a user would, `mlflow server` on that store, and Debian's headless Chromium."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import docstring_documents, small_pipeline_overrides


def arguments(docstring: str, screenshot: str) -> argparse.Namespace:
    """--work (where the runs and their store go) and --screenshot (default docs/<screenshot>)."""
    parser = argparse.ArgumentParser(description=docstring.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="where the runs and their store go (default: a temporary directory)")
    parser.add_argument("--screenshot", type=Path, default=REPO / "docs" / screenshot)
    return parser.parse_args()


def pipeline_store(work: Path | None, experiment: str, runs: Sequence[Sequence[str]]) -> str:
    """The tracking URI of a store in `work` (a new temporary directory when None) holding, in `experiment`, one
    shrunk tiny pipeline run on the repository's docstrings per entry of `runs` (its extra overrides). A `work` of
    an earlier check keeps its store and runs nothing."""
    work = work or Path(tempfile.mkdtemp(prefix=f"llmflow-{experiment}-"))
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    if (work / "mlflow.db").exists():
        return uri
    corpus = work / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in docstring_documents()))
    environment = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    for extra in runs:
        overrides = [*small_pipeline_overrides(corpus, work / "data", experiment), *extra]
        sets = [arg for item in overrides for arg in ("--set", item)]
        subprocess.run([sys.executable, "-m", "flows.cli", "run", "--params", "tiny", *sets], check=True,
                       env=environment, cwd=work)
    return uri


@contextmanager
def served(uri: str) -> Iterator[str]:
    """`mlflow server` on the store at `uri` for the block: its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)  # its uvicorn and job runner go down with it
    try:
        deadline = time.monotonic() + 300  # its first start migrates the store; slow on a busy machine
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server on port {port} did not answer within 300 s") from None
                time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the whole group: uvicorn and the job runner outlive `mlflow server`
        server.wait(timeout=60)


def chromium(playwright):
    """Debian's Chromium, headless (no browser download): `apt-get install chromium && pip install playwright`."""
    return playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
