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

import json
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from mlflow_browser import arguments, chromium, pipeline_store, served  # puts this checkout first on sys.path

from tasks.compare import compare

EXPERIMENT = "browser-check"
LEARNING_RATES = ("1e-3", "3e-3")
CHECKED_METRICS = ("pretrain.final_loss", "pretrain.validation_loss", "evaluate.base.pretraining.mean_loss")


def page_text(url: str, screenshot: Path, wait_for: str) -> str:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = chromium(playwright)
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
    args = arguments(__doc__, "mlflow-compare.png")
    uri = pipeline_store(args.work, EXPERIMENT, [[f"optimizer.lr={lr}"] for lr in LEARNING_RATES])
    comparison = compare(uri, experiment=EXPERIMENT, last=2)
    runs = [row["id"] for row in comparison.runs]
    client = MlflowClient(uri)
    experiments = sorted({row["experiment_id"] for row in comparison.runs})
    with served(uri) as base:
        url = f"{base}/#/compare-runs?runs={json.dumps(runs)}&experiments={json.dumps(experiments)}"
        text = page_text(url, args.screenshot, "optimizer.lr")
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
