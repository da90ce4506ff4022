"""MLflow bookkeeping for pipeline runs: one parent run per Prefect flow run, one child run per stage.

Everything goes through an explicit `MlflowClient` and run ids, never MLflow's thread-local "active run":
Prefect runs tasks on worker threads, where the flow's active run would not be visible.

MLflow is imported where a client is made, not with this module: every data-prep worker process imports it
(unpickling a task run's context names `Tracking` and the stage's flow, whose module imports this one), and
`import mlflow` there cost each worker ~1 s of CPU before its first job, in the stretch where the workers
start while the flow process hashes the inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from model_core.data.identity import SplitIdentity, split_identities
from params import PipelineParams, flatten, params_hash, to_yaml

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch call
MAX_METRICS_PER_BATCH = 1000
SOURCE_BUDGET_CHARS = 60_000  # MLflow keeps a dataset's source in 64 KB; a corpus of more files is summarised
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Tracking:
    """Where a pipeline run is recorded; small and serialisable so Prefect can hand it to tasks."""

    uri: str
    experiment_id: str
    parent_run_id: str
    flow_run_name: str = "local"  # the parent run's name; stage runs are named `<flow run>/<stage>` after it


def tracking_uri(params: PipelineParams) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri


def git_commit() -> str:
    """The commit of the llmflow checkout running this code, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


# MLflow 3's UI opens an experiment in its GenAI view unless this tag says it holds model training runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def _mlflow_client(uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_experiment(client: MlflowClient, params: PipelineParams) -> str:
    """The id of the params' experiment, created (and tagged as model training) on first use."""
    from mlflow.exceptions import MlflowException

    name = params.tracking.experiment
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            client.create_experiment(name, artifact_location=params.tracking.artifact_location)
        except MlflowException:  # created concurrently by another run
            pass
        experiment = client.get_experiment_by_name(name)
    if EXPERIMENT_KIND[0] not in experiment.tags:  # a kind the user chose in the UI is left alone
        client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
    return experiment.experiment_id


def open_pipeline_run(
    params: PipelineParams, flow_run_name: str, flow_run_id: str, deployment: str | None
) -> Tracking:
    """Create the parent run: named after the flow run, tagged, with flattened params and the params YAML."""
    uri = tracking_uri(params)
    client = _mlflow_client(uri)
    experiment_id = ensure_experiment(client, params)
    tags = {
        "prefect.flow_run_id": flow_run_id,
        "prefect.flow_run_name": flow_run_name,
        "prefect.deployment": deployment or "none",
        "mlflow.source.git.commit": git_commit(),
        "llmflow.params_hash": params_hash(params),
        "llmflow.preset": params.name,
    }
    run = client.create_run(experiment_id, run_name=flow_run_name, tags=tags)
    tracking = Tracking(uri=uri, experiment_id=experiment_id, parent_run_id=run.info.run_id, flow_run_name=flow_run_name)
    stage = StageRun(client, run.info.run_id)
    stage.log_params(flatten(params))
    stage.log_text(to_yaml(params), "params.yaml")
    return tracking


def close_pipeline_run(tracking: Tracking, succeeded: bool) -> None:
    _mlflow_client(tracking.uri).set_terminated(
        tracking.parent_run_id, status="FINISHED" if succeeded else "FAILED"
    )


class StageRun:
    """One MLflow run that a stage logs into; every call batches what it is given. A stage run of a pipeline
    knows its parent (`parent_run_id`), which lists the datasets of all its stages."""

    def __init__(self, client: MlflowClient, run_id: str, parent_run_id: str | None = None) -> None:
        self.client = client
        self.run_id = run_id
        self.parent_run_id = parent_run_id

    def log_params(self, values: Mapping[str, object]) -> None:
        from mlflow.entities import Param

        items = [Param(key, str(value)) for key, value in values.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])

    def log_metrics(self, values: Mapping[str, float], step: int = 0) -> None:
        self.log_metric_records([(step, dict(values))])

    def log_metric_records(self, records: list[tuple[int, Mapping[str, float]]]) -> None:
        """Many (step, {name: value}) records in as few calls as MLflow allows."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(name, float(value), now, step) for step, values in records for name, value in values.items()
        ]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(directory), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_bytes(self, content: bytes, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / Path(artifact_file).name
            path.write_bytes(content)
            parent = str(Path(artifact_file).parent)
            self.log_artifact(path, None if parent == "." else parent)

    def log_datasets(self, used: Iterable[tuple[SplitIdentity, str]]) -> None:
        """MLflow dataset inputs of this run, each with its context (how the stage used it: training, validation,
        evaluation, base model); the parent run gets each once, with the role of its split."""
        used = list(used)
        self.client.log_inputs(self.run_id, [_dataset_input(identity, context) for identity, context in used])
        if self.parent_run_id is not None:
            roles = [_dataset_input(identity, SPLIT_ROLES[identity.split]) for identity, _ in used]
            self.client.log_inputs(self.parent_run_id, roles)  # MLflow links a dataset to a run once


# How a stage used a dataset: the `mlflow.data.context` tag of its input, shown beside it in MLflow's UI.
TRAINING, VALIDATION, EVALUATION = "training", "validation", "evaluation"
BASE_MODEL = "base model"  # a fine-tune's pretraining data: what the model it adapts was trained on
SPLIT_ROLES = {"train": TRAINING, "validation": VALIDATION}


def training_datasets(dataset_dir: str | Path) -> list[tuple[SplitIdentity, str]]:
    """What a training stage reads of a prepared dataset: the train split it trains on and the validation split
    it measures its validation loss on."""
    return [(identity, SPLIT_ROLES[identity.split]) for identity in split_identities(dataset_dir)]


def evaluation_datasets(dataset_dirs: Iterable[str | Path]) -> list[tuple[SplitIdentity, str]]:
    """What the evaluate stage scores: the validation split of each held-out dataset."""
    return [(identity, EVALUATION) for directory in dataset_dirs for identity in split_identities(directory, ("validation",))]


def _dataset_input(identity: SplitIdentity, context: str):
    """A split as an MLflow dataset input: its name and content digest, a `local` source (MLflow's UI shows its
    `uri`) with the input files' sha256, its counts as the profile, and the context tag."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    dataset = Dataset(
        name=identity.name, digest=identity.digest, source_type="local", source=_source(identity),
        profile=json.dumps(identity.profile),
    )
    return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])


def _source(identity: SplitIdentity) -> str:
    """The dataset directory and its input files' sha256, as JSON; a list too long for MLflow is cut, and the
    count and a sha256 of the whole list (its `path<TAB>sha256` lines) are added."""
    listed: dict[str, str] = {}
    size = 0
    for item in identity.inputs:
        size += len(json.dumps(item.path)) + len(item.sha256) + 6  # the value's quotes, the separators
        if size > SOURCE_BUDGET_CHARS:
            break
        listed[item.path] = item.sha256
    source: dict[str, object] = {"uri": str(identity.directory), "inputs": listed}
    if size > SOURCE_BUDGET_CHARS:
        lines = "".join(f"{item.path}\t{item.sha256}\n" for item in identity.inputs)
        source.update(input_files=len(identity.inputs), inputs_sha256=hashlib.sha256(lines.encode()).hexdigest())
    return json.dumps(source)


def record_reuse(run: StageRun, stage: str, reused_from: str | Path | None) -> None:
    """Tag a stage run with whether its result was already there (`reused_from`) or made now; a reused stage
    is also said on the console, since nothing else of it shows."""
    run.set_tags({"llmflow.reused": str(reused_from is not None).lower()})
    if reused_from is not None:
        run.set_tags({"llmflow.reused_from": str(reused_from)})
        print(f"{stage}: reused {reused_from} (its result is there already; nothing to run)")


class MetricsBatcher:
    """A trainer metrics callback that sends records to MLflow in batches: one call per `every` records, or
    sooner once `seconds` have passed since the last, so a slow run still shows its progress in MLflow.

    Each record is a flat dict with a `step`; everything else in it becomes a metric at that step.
    """

    def __init__(self, run: StageRun, every: int = 50, seconds: float = 30.0) -> None:
        self.run = run
        self.every, self.seconds = every, seconds
        self.pending: list[tuple[int, dict[str, float]]] = []
        self.last_flush = time.monotonic()

    def __call__(self, record: dict[str, float]) -> None:
        values = {name: value for name, value in record.items() if name != "step"}
        self.pending.append((int(record["step"]), values))
        if len(self.pending) >= self.every or time.monotonic() - self.last_flush >= self.seconds:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.run.log_metric_records(self.pending)
            self.pending = []
        self.last_flush = time.monotonic()

    def __enter__(self) -> MetricsBatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.flush()


@contextmanager
def stage_run(tracking: Tracking, stage: str) -> Iterator[StageRun]:
    """A child run of the pipeline run, named `<flow run>/<stage>` (so runs of several pipelines read apart in
    MLflow's run table) and tagged `llmflow.stage`; FAILED if the stage raises, FINISHED otherwise."""
    client = _mlflow_client(tracking.uri)
    tags = {"mlflow.parentRunId": tracking.parent_run_id, "llmflow.stage": stage}
    run = client.create_run(tracking.experiment_id, run_name=f"{tracking.flow_run_name}/{stage}", tags=tags)
    try:
        yield StageRun(client, run.info.run_id, tracking.parent_run_id)
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")


@contextmanager
def pipeline_run(params: PipelineParams) -> Iterator[Tracking]:
    """The parent run of the current Prefect flow run, closed FINISHED or FAILED with the flow, with the
    headline metrics of the stages that ran copied onto it (`log_headline_metrics`)."""
    from prefect.runtime import deployment, flow_run

    tracking = open_pipeline_run(params, flow_run.name or "local", flow_run.id or "none", deployment.name)
    succeeded = False
    try:
        yield tracking
        succeeded = True
    finally:
        log_headline_metrics(tracking)
        close_pipeline_run(tracking, succeeded)


def record_warnings(tracking: Tracking, warnings: list[str]) -> None:
    """The run's warnings (params/rules.py `check_run`), once per pipeline run: printed (the console and, in a
    flow with log_prints, the Prefect log) and on the pipeline's MLflow run, as the tag `llmflow.warnings` (their
    count) and the text artifact warnings.txt."""
    for warning in warnings:
        print(f"warning: {warning}")
    run = StageRun(_mlflow_client(tracking.uri), tracking.parent_run_id)
    run.set_tags({"llmflow.warnings": str(len(warnings))})
    if warnings:
        run.log_text("\n".join(warnings) + "\n", "warnings.txt")


# A training stage's summary: its logged summary metrics and, from its per-step history, these.
TRAINING_STAGES = ("smoke", "pretrain", "finetune")
HISTORY_HEADLINES = {  # headline name -> (history metric, how its values are summarised)
    "best_loss": ("loss", min),
    "validation_loss": ("validation_loss", lambda values: values[-1]),
    "tokens_per_second": ("tokens_per_second", lambda values: sorted(values)[len(values) // 2]),
    "mfu": ("mfu", lambda values: sorted(values)[len(values) // 2]),
}


def stage_headlines(client: MlflowClient, run) -> dict[str, float]:
    """One stage run's headline metrics, named `<stage>.<metric>`: a training stage's final loss, best loss,
    last validation loss, median tokens/s and MFU and wall seconds; every metric of the evaluate stage."""
    stage = run.data.tags.get("llmflow.stage", run.info.run_name)
    if stage == "evaluate":
        return {f"evaluate.{name}": value for name, value in run.data.metrics.items()}
    if stage not in TRAINING_STAGES:
        return {}
    found = {f"{stage}.final_loss": run.data.metrics["final_loss"]} if "final_loss" in run.data.metrics else {}
    for headline, (metric, summary) in HISTORY_HEADLINES.items():
        values = [point.value for point in sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)]
        if values:
            found[f"{stage}.{headline}"] = summary(values)
    if run.info.end_time and run.data.tags.get("llmflow.reused") != "true":
        found[f"{stage}.wall_seconds"] = (run.info.end_time - run.info.start_time) / 1000
    return found


def log_headline_metrics(tracking: Tracking) -> None:
    """Copy every finished stage's headline metrics onto the pipeline's parent run, where MLflow's run table and
    Compare view put them beside the params a person varied."""
    client = _mlflow_client(tracking.uri)
    children = client.search_runs(
        [tracking.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{tracking.parent_run_id}'"
    )
    headlines: dict[str, float] = {}
    for child in children:
        headlines.update(stage_headlines(client, child))
    if headlines:
        StageRun(client, tracking.parent_run_id).log_metrics(headlines)
