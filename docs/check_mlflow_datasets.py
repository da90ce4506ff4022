"""Browser check: MLflow's run page shows the datasets a pipeline's stages used (lineage).

Runs one shrunk tiny pipeline with a LoRA fine-tune (`llmflow run`, as a user would), so that every stage that
reads data runs: data prep, smoke, pretrain, finetune, evaluate. Serves the store with `mlflow server`, opens
the page of the pipeline's parent run and of each of its stage runs in headless Chromium, clicks the run's
first dataset and checks that the dataset drawer lists the run's datasets with their digests and contexts as
the store records them (the parent: every dataset of its stages; the stages: e.g. finetune's
pretraining/train as "base model"). Writes a screenshot of the parent run's page with the drawer open. Exit
status 0 when all is there, 1 naming what is missing.

    apt-get install chromium && pip install playwright      # once; no browser download (Debian's Chromium)
    python docs/check_mlflow_datasets.py [--work DIR] [--screenshot docs/mlflow-datasets.png]

Not part of the test suite: it needs Chromium, which CI does not install, and a few minutes of CPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from mlflow_browser import arguments, chromium, pipeline_store, served

EXPERIMENT = "datasets-check"
STAGES = ("data_prep", "smoke", "pretrain", "finetune", "evaluate")
# Rows long enough for the instruction examples, and a LoRA fine-tune so that every stage that reads data runs.
PIPELINE = ["model.seq_len=128", "lora.enabled=true", "lora.steps=10"]


def recorded(client: MlflowClient) -> tuple[str, dict[str, object]]:
    """The experiment id and the latest pipeline run with its stage runs, by name ("pipeline" for the parent)."""
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    runs = client.search_runs([experiment], order_by=["attributes.start_time DESC"])
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    stages = {run.data.tags["llmflow.stage"]: run for run in runs
              if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    return experiment, {"pipeline": parent, **{stage: stages[stage] for stage in STAGES}}


def datasets(run) -> list[tuple[str, str, str]]:
    """A run's dataset inputs as the store holds them: (name, digest, context)."""
    return [(item.dataset.name, item.dataset.digest, next(tag.value for tag in item.tags if tag.key == "mlflow.data.context"))
            for item in run.inputs.dataset_inputs]


def page_texts(base: str, experiment: str, runs: dict[str, object], screenshot: Path) -> dict[str, str]:
    """The text of each run's page with its dataset drawer open (the run page's *Datasets* row shows the first
    and "+N"; the drawer lists them all, each with its context, and the details of the one clicked); a
    screenshot of the first (the parent's)."""
    from playwright.sync_api import sync_playwright

    texts = {}
    with sync_playwright() as playwright:
        browser = chromium(playwright)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        for name, run in runs.items():
            page.goto(f"{base}/#/experiments/{experiment}/runs/{run.info.run_id}")
            first, digest, _ = datasets(run)[0]
            page.get_by_role("button", name=f"{first} ({digest})").first.click(timeout=120_000)
            page.get_by_text("datasets used").first.wait_for(timeout=60_000)
            time.sleep(1)  # the drawer slides in
            if name == "pipeline":
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot))
            texts[name] = page.inner_text("body")
        browser.close()
    return texts


def main() -> int:
    args = arguments(__doc__, "mlflow-datasets.png")
    uri = pipeline_store(args.work, EXPERIMENT, [PIPELINE])
    experiment, runs = recorded(MlflowClient(uri))
    empty = [name for name, run in runs.items() if not datasets(run)]
    if empty:
        print(f"no dataset inputs recorded on the {', '.join(empty)} run(s) of experiment {EXPERIMENT!r} at {uri}")
        return 1
    with served(uri) as base:
        texts = page_texts(base, experiment, runs, args.screenshot)
    missing = [
        f"{name}: {dataset} ({digest}, {context})"
        for name, run in runs.items()
        for dataset, digest, context in datasets(run)
        if dataset not in texts[name] or digest not in texts[name] or context.lower() not in texts[name].lower()
    ]
    if missing:
        print(f"run pages lack datasets: {'; '.join(missing)}; screenshot {args.screenshot}")
        return 1
    shown = {name: len(datasets(run)) for name, run in runs.items()}
    print(f"the run pages show every dataset input with its digest and context ({shown}); screenshot {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
