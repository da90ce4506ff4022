"""`llmflow doctor`'s reading: gather a run's evidence from its directory or its MLflow run, have
`model_core.train.doctor` diagnose it, and record the report on a failed stage's MLflow run.

A run directory is a training stage's (`train.output_dir/pretrain-<key>`, `smoke-<key>`, or `llmflow train
--checkpoint-dir`): its `metrics.jsonl` (written for multi-rank runs; `llmflow train --metrics-jsonl` elsewhere),
its `params-*.yaml`, its `logs/` (worker and msrun logs, the ranks' heartbeats and refusal notes) and `run.json`,
which names its dataset (whose manifest holds the data's health). An MLflow run is a pipeline's parent run (the
failed training stage is diagnosed, else the last one) or one stage's run: its metric histories, the pipeline's
params, the data stage's dataset directory and, when they are on this machine, the stage's logs.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from model_core.data import read_manifest
from model_core.parallel import heartbeat
from model_core.parallel.oom import read_metrics
from model_core.train.doctor import Report, RunEvidence, diagnose
from params import PipelineParams, load_params

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from tasks.tracking import StageRun

# The metrics the doctor reads from a stage run (the trainer's record names).
METRICS = ("loss", "validation_loss", "grad_norm", "loss_scale", "skipped_steps", "tokens_per_second", "lr")
TRAINING_STAGES = ("pretrain", "smoke", "finetune")
LOG_TAIL_BYTES = 2 * 2**20  # of each log: the end says why a run stopped
_RUN_ID = re.compile(r"[0-9a-f]{32}")


class DoctorError(ValueError):
    """A run that cannot be read: the message names what is missing."""


def evidence_of_directory(
    directory: str | Path, params: PipelineParams | None = None, metrics: str | Path | None = None,
    logs: list[Path] | None = None, dataset: str | Path | None = None,
) -> RunEvidence:
    """A training run directory's evidence; `params`, `metrics`, `logs` (console output) and `dataset` add to or
    replace what the directory holds."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DoctorError(f"{directory} is not a directory")
    if params is None:
        written = sorted(directory.glob("params-*.yaml"), key=lambda path: path.stat().st_mtime)
        params = load_params(str(written[-1])) if written else None
    if metrics is None and (directory / "metrics.jsonl").is_file():
        metrics = directory / "metrics.jsonl"
    log_dir = directory / "logs" if (directory / "logs").is_dir() else directory
    found_logs = sorted(p for p in log_dir.glob("*.log") if not p.name.endswith(".previous.log")) + list(logs or [])
    failure = _rank_refusals(log_dir)
    return RunEvidence(
        params=params,
        metrics=read_metrics(metrics) if metrics is not None else [],
        health=_health(dataset or _dataset_of(directory, params)),
        logs={str(path): _tail(path) for path in found_logs},
        heartbeats=heartbeat.read_all(log_dir),
        failure=failure,
    )


def evidence_of_mlflow_run(uri: str, run_id: str) -> tuple[RunEvidence, str]:
    """(evidence, the stage run read) of a pipeline's parent run or of one of its stage runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    except Exception as error:  # MLflow raises its own exception types for a missing run
        raise DoctorError(f"no MLflow run {run_id} at {uri} ({error.__class__.__name__})") from error
    parent_id = run.data.tags.get("mlflow.parentRunId", run_id) if "llmflow.stage" in run.data.tags else run_id
    stages = _stage_runs(client, run.info.experiment_id, parent_id)
    stage = run if "llmflow.stage" in run.data.tags else _troubled_stage(stages)
    if stage is None:
        raise DoctorError(f"MLflow run {run_id} has no training stage (smoke, pretrain, finetune) to diagnose")
    params = _pipeline_params(client, parent_id)
    data_stage = next((s for s in stages if s.data.tags.get("llmflow.stage") == "data_prep"), None)
    dataset = data_stage.data.tags.get("llmflow.dataset_dir") if data_stage is not None else None
    directory = stage.data.params.get("stage.checkpoint_dir")
    on_disk = (
        evidence_of_directory(directory, params) if directory and Path(directory).is_dir() else RunEvidence(params)
    )
    on_disk.metrics = metric_records(client, stage.info.run_id)
    on_disk.health = _health(dataset)
    on_disk.failure = stage.data.tags.get("llmflow.failure") or on_disk.failure
    return on_disk, stage.info.run_id


def metric_records(client: MlflowClient, run_id: str) -> list[dict]:
    """The stage run's metric histories, joined into one record per step."""
    records: dict[int, dict] = {}
    for name in METRICS:
        for point in client.get_metric_history(run_id, name):
            records.setdefault(point.step, {"step": point.step})[name] = point.value
    return [records[step] for step in sorted(records)]


def diagnose_target(
    target: str, uri: str, params: PipelineParams | None = None, metrics: str | Path | None = None,
    logs: list[Path] | None = None, dataset: str | Path | None = None,
) -> tuple[Report, str]:
    """(report, what was read) for a run directory or an MLflow run id; what the caller gives wins over what the
    run recorded."""
    if Path(target).is_dir():
        return diagnose(evidence_of_directory(target, params, metrics, logs, dataset)), target
    if _RUN_ID.fullmatch(target):
        evidence, stage_id = evidence_of_mlflow_run(uri, target)
        evidence.params = params or evidence.params
        evidence.metrics = read_metrics(metrics) if metrics is not None else evidence.metrics
        evidence.logs.update({str(path): _tail(path) for path in logs or []})
        evidence.health = _health(dataset) if dataset is not None else evidence.health
        return diagnose(evidence), f"MLflow run {stage_id} at {uri}"
    raise DoctorError(f"{target} is neither a run directory nor an MLflow run id (32 hex digits)")


@contextmanager
def diagnosed_on_failure(
    params: PipelineParams, run: StageRun, directory: Path | None, dataset_dir: Path | None,
    stage: str | None = None,
) -> Iterator[None]:
    """Run a training stage's block; when it raises, `report_failed_stage` before the error goes on. `stage`
    "finetune": `params` are the fine-tuning trainer's (`finetune_params`)."""
    try:
        yield
    except Exception as error:
        report_failed_stage(params, run, directory, dataset_dir, f"{type(error).__name__}: {error}", stage)
        raise


def report_failed_stage(
    params: PipelineParams, run: StageRun, directory: Path | None, dataset_dir: Path | None, failure: str,
    stage: str | None = None,
) -> Report | None:
    """Diagnose a failed stage from its MLflow run and its directory, and leave the report on the console (and so
    in the Prefect log), as `doctor.md` and `doctor.json` on the run, and as the tag `llmflow.doctor.kind`. The
    doctor's own failure is said in one line: it must never hide the stage's."""
    try:
        evidence = RunEvidence(params)
        if directory is not None and directory.is_dir():
            evidence = evidence_of_directory(directory, params, dataset=dataset_dir)
        evidence.metrics = evidence.metrics or metric_records(run.client, run.run_id)
        evidence.health = evidence.health or _health(dataset_dir)
        evidence.failure = failure
        evidence.stage = stage
        report = diagnose(evidence)
        run.log_text(report.text() + "\n", "doctor.md")
        run.log_text(report.to_json() + "\n", "doctor.json")
        run.set_tags({"llmflow.doctor.kind": report.kind, "llmflow.failure": failure[:5000]})
    except Exception as error:  # noqa: BLE001 (the stage's own error is what the user must see)
        print(f"llmflow doctor could not diagnose this stage: {type(error).__name__}: {error}")
        return None
    print(f"llmflow doctor:\n{report.text()}")
    return report


def _stage_runs(client: MlflowClient, experiment_id: str, parent_id: str) -> list:
    return client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'", order_by=["attributes.start_time ASC"]
    )


def _troubled_stage(stages: list):
    """The first failed training stage, else the last training stage that ran."""
    training = [s for s in stages if s.data.tags.get("llmflow.stage") in TRAINING_STAGES]
    failed = [s for s in training if s.info.status == "FAILED"]
    return failed[0] if failed else (training[-1] if training else None)


def _pipeline_params(client: MlflowClient, parent_id: str) -> PipelineParams | None:
    with tempfile.TemporaryDirectory() as scratch:
        try:
            path = client.download_artifacts(parent_id, "params.yaml", scratch)
        except Exception:  # noqa: BLE001 (a run without its params is diagnosed from its metrics alone)
            return None
        return load_params(path)


def _dataset_of(directory: Path, params: PipelineParams | None) -> Path | None:
    """The dataset a run directory trained on: run.json names it, under params' data.output_dir."""
    try:
        record = json.loads((directory / "run.json").read_text())
    except (OSError, ValueError):
        return None
    if params is None or not record.get("dataset"):
        return None
    return Path(params.data.output_dir) / record["dataset"]


def _health(dataset: str | Path | None) -> dict | None:
    """The dataset manifest's health section; None when there is no dataset here or it has none."""
    if dataset is None or not Path(dataset).is_dir():
        return None
    try:
        return read_manifest(dataset).get("health")
    except (OSError, ValueError):
        return None


def _rank_refusals(log_dir: Path) -> str | None:
    notes = [f"rank {p.stem.removeprefix('rank-')}: {p.read_text(errors='replace').strip()}"
             for p in sorted(log_dir.glob("rank-*.error"))]
    return "\n".join(notes) or None


def _tail(path: Path) -> str:
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - LOG_TAIL_BYTES))
        return handle.read().decode("utf-8", errors="replace")
