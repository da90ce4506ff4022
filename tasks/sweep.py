"""MLflow bookkeeping of a sweep: one parent run for the sweep, each trial's pipeline run nested under it
(`mlflow.parentRunId`, so MLflow's run table folds the trials, and their stages, under the sweep), the trials
ranked by the sweep's metric, the best one tagged, and the comparison table of `llmflow compare` logged on the
sweep's run."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from params.sweep import SweepParams, Trial, sweep_yaml
from tasks.compare import compare, render, write_loss_overlay
from tasks.tracking import StageRun, Tracking, ensure_experiment, git_commit, tracking_uri

TrialStatus = Literal["finished", "stopped", "failed"]


class TrialOutcome(BaseModel):
    """How one trial ended: finished (ranked by the metric), stopped by the smoke gate, or failed (`reason`)."""

    number: int
    label: str
    assignment: dict[str, Any]
    status: TrialStatus
    run_id: str | None  # its pipeline run, None when it failed before opening one
    reason: str | None = None
    metric: float | None = None

    def describe(self, metric: str) -> str:
        if self.status != "finished":
            return f"trial {self.number} ({self.label}): {self.status}: {self.reason}"
        result = f"{metric} {self.metric:.4f}" if self.metric is not None else f"finished without {metric}"
        return f"trial {self.number} ({self.label}): {result}"


class SweepRecord(BaseModel):
    """The ranked sweep: its MLflow run, every trial, the best one, and the comparison table."""

    sweep_run_id: str
    trials: list[TrialOutcome]
    best: TrialOutcome | None
    table: str


def open_sweep_run(
    sweep: SweepParams, trials: list[Trial], flow_run_name: str, flow_run_id: str, deployment: str | None
) -> Tracking:
    """The sweep's parent run, in the base params' experiment, with the sweep's settings as params and its
    resolved file as `sweep.yaml`."""
    base = trials[0].params
    uri = tracking_uri(base)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = ensure_experiment(client, base)
    tags = {
        "llmflow.kind": "sweep",
        "llmflow.sweep": sweep.name,
        "prefect.flow_run_id": flow_run_id,
        "prefect.flow_run_name": flow_run_name,
        "prefect.deployment": deployment or "none",
        "mlflow.source.git.commit": git_commit(),
    }
    run = client.create_run(experiment_id, run_name=flow_run_name, tags=tags)
    record = StageRun(client, run.info.run_id)
    settings = {"method": sweep.method, "metric": sweep.metric, "goal": sweep.goal, "trials": len(trials),
                "max_concurrency": sweep.max_concurrency, "base": sweep.params}
    record.log_params({f"sweep.{name}": value for name, value in settings.items()})
    record.log_params({f"space.{name}": json.dumps(values, default=_plain) for name, values in sweep.space.items()})
    record.log_text(sweep_yaml(sweep), "sweep.yaml")
    return Tracking(uri=uri, experiment_id=experiment_id, parent_run_id=run.info.run_id, flow_run_name=flow_run_name)


def _plain(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else str(value)


def pipeline_run_of(tracking: Tracking, flow_run_id: str) -> str | None:
    """The pipeline (parent) run that the Prefect flow run `flow_run_id` opened, if it got that far."""
    client = MlflowClient(tracking_uri=tracking.uri)
    found = client.search_runs(
        [tracking.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'", max_results=1
    )
    return found[0].info.run_id if found else None


def attach_trial(tracking: Tracking, outcome: TrialOutcome) -> None:
    """Nest a trial's pipeline run under the sweep's run and say how it ended."""
    if outcome.run_id is None:
        return
    StageRun(MlflowClient(tracking_uri=tracking.uri), outcome.run_id).set_tags({
        "mlflow.parentRunId": tracking.parent_run_id,
        "llmflow.sweep_run_id": tracking.parent_run_id,
        "llmflow.trial": outcome.number,
        "llmflow.trial_status": outcome.status,
    })


def record_sweep(tracking: Tracking, sweep: SweepParams, outcomes: list[TrialOutcome]) -> SweepRecord:
    """Read each finished trial's metric, tag the best trial (`llmflow.best_trial=true`, the others false), put
    its values and metric on the sweep's run, and log the comparison of every trial that opened a run."""
    client = MlflowClient(tracking_uri=tracking.uri)
    ranked = []
    for outcome in outcomes:
        if outcome.status == "finished" and outcome.run_id is not None:
            value = client.get_run(outcome.run_id).data.metrics.get(sweep.metric)
            outcome = outcome.model_copy(update={"metric": value})
        ranked.append(outcome)
    scored = [outcome for outcome in ranked if outcome.metric is not None]
    pick = min if sweep.goal == "minimize" else max
    best = pick(scored, key=lambda outcome: outcome.metric) if scored else None
    sweep_run = StageRun(client, tracking.parent_run_id)
    for outcome in ranked:
        if outcome.run_id is not None:
            StageRun(client, outcome.run_id).set_tags({"llmflow.best_trial": str(outcome is best).lower()})
    counts = {status: sum(o.status == status for o in ranked) for status in ("finished", "stopped", "failed")}
    sweep_run.log_metrics({f"trials_{status}": count for status, count in counts.items()})
    if best is not None:
        sweep_run.set_tags({"llmflow.best_trial": best.number, "llmflow.best_trial_run_id": best.run_id})
        sweep_run.log_params({f"best.{name}": value for name, value in best.assignment.items()})
        sweep_run.log_metrics({f"best.{sweep.metric}": best.metric})
    table = _comparison(tracking, sweep_run, [o.run_id for o in ranked if o.run_id is not None])
    return SweepRecord(sweep_run_id=tracking.parent_run_id, trials=ranked, best=best, table=table)


def _comparison(tracking: Tracking, sweep_run: StageRun, run_ids: list[str]) -> str:
    """`llmflow compare` of the trials: printed, and logged as comparison.md, comparison.json and a loss overlay."""
    if not run_ids:
        return "(no trial opened a pipeline run)"
    comparison = compare(tracking.uri, run_ids)
    sweep_run.log_text(render(comparison, tracking.uri, "markdown"), "comparison.md")
    sweep_run.log_text(render(comparison, tracking.uri, "json"), "comparison.json")
    with tempfile.TemporaryDirectory() as scratch:
        overlay = write_loss_overlay(comparison, Path(scratch) / "loss_curves.png")
        if overlay is not None:
            sweep_run.log_artifact(overlay)
    return render(comparison, tracking.uri, "table")


def close_sweep_run(tracking: Tracking, succeeded: bool) -> None:
    MlflowClient(tracking_uri=tracking.uri).set_terminated(
        tracking.parent_run_id, status="FINISHED" if succeeded else "FAILED"
    )
