"""`llmflow compare`: pipeline runs side by side, read back from MLflow: the params that differ between them,
their headline metrics (copied onto each parent run by `tasks.tracking.log_headline_metrics`), the datasets
each stage used (MLflow dataset inputs, by content digest) and which of them differ, their pretraining loss
curves on one plot, and where to open each run in MLflow's UI."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from model_core.storage import write_file
from model_core.tables import fixed_width, markdown
from tasks.plots import overlay_png

# Headline columns shown first when present, in this order; the evaluate stage's perplexities follow.
HEADLINES = (
    "pretrain.final_loss", "pretrain.best_loss", "pretrain.validation_loss", "pretrain.tokens_per_second",
    "pretrain.mfu", "pretrain.wall_seconds", "finetune.final_loss", "finetune.wall_seconds",
)


class CompareError(ValueError):
    """Runs that cannot be compared: unknown ids, an unknown experiment, nothing found."""


SHORT_DIGEST = 8  # digest characters shown in the tables (JSON has them whole)


@dataclass(frozen=True)
class Comparison:
    runs: list[dict]  # per run: id, name, experiment id, status, params, metrics, data (stage -> datasets)
    differing: list[str]  # param names whose values differ between the runs
    headlines: list[str]  # metric columns
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # run name -> pretraining loss
    experiment: str | None = None  # the experiment whose latest runs these are; None for runs named by id
    data_rows: list[tuple[str, str]] = field(default_factory=list)  # (stage, dataset name) used by any run
    data_differs: list[tuple[str, str]] = field(default_factory=list)  # those whose digest differs between runs


def compare(
    uri: str, run_ids: list[str] | None = None, experiment: str | None = None, last: int = 2
) -> Comparison:
    """The pipeline runs `run_ids`, or the `last` finished pipeline runs of `experiment`, compared."""
    _existing_store(uri)
    client = MlflowClient(tracking_uri=uri)
    runs = _runs(client, uri, run_ids, experiment, last)
    params = [run.data.params for run in runs]
    names = sorted({name for values in params for name in values})
    differing = [name for name in names if len({values.get(name) for values in params}) > 1]
    metrics = {name for run in runs for name in run.data.metrics}
    headlines = [name for name in HEADLINES if name in metrics]
    headlines += sorted(name for name in metrics if name.startswith("evaluate.") and name.endswith(".perplexity"))
    stages = [_stage_runs(client, run) for run in runs]
    rows = [
        {
            "id": run.info.run_id, "name": run.info.run_name, "experiment_id": run.info.experiment_id,
            "status": run.info.status, "params": {name: run.data.params.get(name) for name in differing},
            "metrics": {name: run.data.metrics.get(name) for name in headlines},
            "data": {stage: _datasets(child) for stage, child in children.items() if child.inputs.dataset_inputs},
        }
        for run, children in zip(runs, stages)
    ]
    curves = {run.info.run_name: _pretraining_curve(client, children.get("pretrain")) for run, children in zip(runs, stages)}
    data_rows, data_differs = _data_rows(rows)
    return Comparison(rows, differing, headlines, curves, None if run_ids else experiment, data_rows, data_differs)


def _existing_store(uri: str) -> None:
    """Refuse a SQLite store that is not there: opening one would create an empty database to find nothing in."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        if not path.is_file():
            raise CompareError(f"no MLflow store at {uri} ({path} does not exist); give --tracking-uri, or the --params "
                               "whose tracking.uri the pipeline recorded to")


def _runs(client: MlflowClient, uri: str, run_ids: list[str] | None, experiment: str | None, last: int) -> list:
    if run_ids:
        found = []
        for run_id in run_ids:
            try:
                found.append(client.get_run(run_id))
            except Exception as error:  # MLflow raises its own exception types for a missing run
                raise CompareError(f"no MLflow run {run_id} at this tracking URI ({error.__class__.__name__})") from error
        return found
    if experiment is None:
        raise CompareError("give run ids, or --experiment NAME (with --last N)")
    known = client.get_experiment_by_name(experiment)
    if known is None:
        raise CompareError(f"no MLflow experiment named {experiment!r} at {uri}; name one with --experiment, or give "
                           "run ids")
    parents = client.search_runs(
        [known.experiment_id], filter_string="attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
        max_results=200,
    )
    parents = [run for run in parents if _is_pipeline_run(run)][:last]
    if len(parents) < 2:
        raise CompareError(f"experiment {experiment!r} at {uri} has {len(parents)} finished pipeline run(s); "
                           "comparing needs 2")
    return parents[::-1]  # oldest first


def _is_pipeline_run(run) -> bool:
    """A pipeline's parent run: not a stage run, and not a sweep's run (a sweep's trials are pipeline runs nested
    under it)."""
    tags = run.data.tags
    if "llmflow.stage" in tags or tags.get("llmflow.kind") == "sweep":
        return False
    return "mlflow.parentRunId" not in tags or "llmflow.sweep_run_id" in tags


def _stage_runs(client: MlflowClient, parent) -> dict:
    """A pipeline run's stage runs by stage, in the order they started (a retried stage: its last run)."""
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )
    return {child.data.tags["llmflow.stage"]: child for child in children if "llmflow.stage" in child.data.tags}


def _datasets(run) -> list[dict]:
    """A stage run's MLflow dataset inputs: name, digest and the context the stage used each in."""
    return [
        {"name": item.dataset.name, "digest": item.dataset.digest,
         "context": next((tag.value for tag in item.tags if tag.key == MLFLOW_DATASET_CONTEXT), None)}
        for item in run.inputs.dataset_inputs
    ]


def _data_rows(rows: list[dict]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every (stage, dataset) any run used, in the order first seen, and those whose digest is not the same in
    every run that used it (a stage that did not run in one of them is no difference of data)."""
    digests: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        for stage, datasets in row["data"].items():
            for dataset in datasets:
                digests.setdefault((stage, dataset["name"]), set()).add(dataset["digest"])
    return list(digests), [key for key, found in digests.items() if len(found) > 1]


def _digest(row: dict, stage: str, name: str) -> str | None:
    return next((item["digest"] for item in row["data"].get(stage, []) if item["name"] == name), None)


def _pretraining_curve(client: MlflowClient, pretrain_run) -> list[tuple[int, float]]:
    if pretrain_run is None:
        return []
    history = client.get_metric_history(pretrain_run.info.run_id, "loss")
    return sorted((point.step, point.value) for point in history)


def run_link(uri: str, row: dict) -> str:
    """Where the run opens in MLflow's UI: a URL under an http(s) tracking server, else the UI's path, to open
    under `mlflow ui --backend-store-uri URI`."""
    path = f"#/experiments/{row['experiment_id']}/runs/{row['id']}"
    return f"{uri.rstrip('/')}/{path}" if uri.startswith(("http://", "https://")) else path


def render(comparison: Comparison, uri: str, form: str = "table") -> str:
    """The comparison as a fixed-width table, a Markdown table, or JSON."""
    if form == "json":
        rows = [{**row, "link": run_link(uri, row)} for row in comparison.runs]
        differs = [{"stage": stage, "dataset": name} for stage, name in comparison.data_differs]
        return json.dumps({"experiment": comparison.experiment, "differing_params": comparison.differing,
                           "headline_metrics": comparison.headlines, "differing_data": differs, "runs": rows}, indent=2)
    statuses = any(row["status"] != "FINISHED" for row in comparison.runs)  # e.g. a sweep's stopped trials
    header = ["run", *(["status"] if statuses else []), *comparison.differing, *comparison.headlines]
    body = [
        [row["name"], *([row["status"]] if statuses else []), *(str(row["params"][name]) for name in comparison.differing),
         *(_number(row["metrics"][name]) for name in comparison.headlines)]
        for row in comparison.runs
    ]
    links = [f"{row['name']}: {run_link(uri, row)}" for row in comparison.runs]
    if not comparison.differing:
        links.insert(0, "(no params differ between these runs)")
    heading = []
    if comparison.experiment is not None:
        taken = f"the last {len(comparison.runs)} finished pipeline runs of experiment {comparison.experiment!r}"
        heading = [f"{taken}, oldest first", ""]
    data = _data_table(comparison)
    if form == "markdown":
        data_section = ["", markdown(data[0]), "", *data[1]] if data else []
        return "\n".join([*heading, markdown([header, *body]), *data_section, "", *(f"- {link}" for link in links)])
    data_section = ["", fixed_width(data[0]), "", *data[1]] if data else []
    return "\n".join([*heading, fixed_width([header, *body]), *data_section, "", *links])


def _data_table(comparison: Comparison) -> tuple[list[list[str]], list[str]] | None:
    """A data row per stage and dataset, each run's short digest in it, and a note of the datasets that differ
    (None when no run recorded a dataset)."""
    if not comparison.data_rows:
        return None
    header = ["data: stage", "dataset", *(row["name"] for row in comparison.runs)]
    body = [
        [stage, name, *((_digest(row, stage, name) or "-")[:SHORT_DIGEST] for row in comparison.runs)]
        for stage, name in comparison.data_rows
    ]
    if not comparison.data_differs:
        return [header, *body], ["(every stage used the same data in these runs)"]
    stages: dict[tuple[str, tuple[str | None, ...]], list[str]] = {}  # a dataset and its digests -> its stages
    for stage, name in comparison.data_differs:
        stages.setdefault((name, tuple(_digest(row, stage, name) for row in comparison.runs)), []).append(stage)
    notes = [
        f"data differ: {name} is "
        + ", ".join(f"{digest[:SHORT_DIGEST]} in {row['name']}" for row, digest in zip(comparison.runs, digests) if digest)
        + f" ({', '.join(used_by)})"
        for (name, digests), used_by in stages.items()
    ]
    return [header, *body], notes


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"


def write_loss_overlay(comparison: Comparison, path: str | Path) -> Path | None:
    """The runs' pretraining loss curves on one plot (runs without per-step history are left out)."""
    curves = {name: points for name, points in comparison.curves.items() if points}
    if not curves:
        return None
    return write_file(path, overlay_png(curves, "pretraining loss"))
