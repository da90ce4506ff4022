"""Browser check: MLflow's *Compare* page of two pipeline runs shows the param they differ in and the headline
metrics side by side.

Runs two shrunk tiny pipelines that differ only in `optimizer.lr` (`llmflow run`, as a user would), serves their
store with `mlflow server`, opens the comparison of the two parent runs in headless Chromium and checks that the
rendered page, with "Show diff only" on, holds `optimizer.lr` with both values and the headline losses with both
runs' values (as MLflow rounds them, to 4 digits). Writes a screenshot of the params and metrics. Exit status 0 when all is there, 1 naming what is missing.

    apt-get install chromium && pip install playwright      # once; no browser download (Debian's Chromium)
    python docs/check_mlflow_compare.py [--work DIR] [--screenshot docs/mlflow-compare.png]

Not part of the test suite: it needs Chromium, which CI does not install, and ~5 minutes of CPU.
"""

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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import docstring_documents, small_pipeline_overrides  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from tasks.compare import compare  # noqa: E402

LEARNING_RATES = ("1e-3", "3e-3")
CHECKED_METRICS = ("pretrain.final_loss", "pretrain.validation_loss", "evaluate.base.pretraining.mean_loss")


def run_pipelines(work: Path, uri: str) -> None:
    corpus = work / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in docstring_documents()))
    overrides = small_pipeline_overrides(corpus, work / "data", "browser-check")
    environment = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    for lr in LEARNING_RATES:
        sets = [arg for item in [*overrides, f"optimizer.lr={lr}"] for arg in ("--set", item)]
        subprocess.run([sys.executable, "-m", "flows.cli", "run", "--params", "tiny", *sets], check=True,
                       env=environment, cwd=work)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(uri: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)  # its uvicorn and job runner go down with it (`stop`)
    deadline = time.monotonic() + 300  # its first start migrates the store; slow on a busy machine
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(1)
    stop(server)
    raise RuntimeError(f"mlflow server on port {port} did not answer within 300 s")


def stop(server: subprocess.Popen) -> None:
    """The server's whole process group: `mlflow server` starts uvicorn and a job runner that outlive it."""
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)


def page_text(url: str, screenshot: Path, wait_for: str) -> str:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1400})
        page.goto(url)
        page.get_by_text(wait_for).first.wait_for(timeout=120_000)
        time.sleep(2)  # the metric and param tables fill in after the page's first paint
        for toggle in page.get_by_role("switch").all():  # "Show diff only" on params, metrics and tags
            toggle.click()
        page.get_by_text("Metrics").last.scroll_into_view_if_needed()
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot))
        text = page.inner_text("body")
        browser.close()
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="where the runs and their store go (default: a temporary directory)")
    parser.add_argument("--screenshot", type=Path, default=REPO / "docs" / "mlflow-compare.png")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="llmflow-browser-check-"))
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    if not (work / "mlflow.db").exists():  # a --work of an earlier check keeps its two runs
        run_pipelines(work, uri)
    comparison = compare(uri, experiment="browser-check", last=2)
    runs = [row["id"] for row in comparison.runs]
    client = MlflowClient(uri)
    experiments = sorted({row["experiment_id"] for row in comparison.runs})
    port = free_port()
    server = serve(uri, port)
    try:
        url = f"http://127.0.0.1:{port}/#/compare-runs?runs={json.dumps(runs)}&experiments={json.dumps(experiments)}"
        text = page_text(url, args.screenshot, "optimizer.lr")
    finally:
        stop(server)
    expected = {"optimizer.lr": [str(float(lr)) for lr in LEARNING_RATES]}
    for name in CHECKED_METRICS:
        expected[name] = [f"{client.get_run(run).data.metrics[name]:.4g}" for run in runs]  # as MLflow shows a loss
    missing = [f"{name} {value}" for name, values in expected.items() for value in [name, *values] if value not in text]
    if missing:
        print(f"the comparison page at {url} lacks: {', '.join(missing)}; screenshot {args.screenshot}")
        return 1
    print(f"the comparison page of runs {runs} shows {', '.join(expected)} with both runs' values; "
          f"screenshot {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
