"""The data-prep stage: a subflow on the task runner that params.data chooses (local worker processes or a
Ray cluster), whose task prepares (or reuses) the token shards, one mapped task per map step, and records
them in MLflow."""

from __future__ import annotations

import functools
import time
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.data import PrepResult, health, prepare_dataset
from params import PipelineParams, flatten
from tasks.progress import PhaseProgress, forwarded_logs
from tasks.retry import retry_on_transient_io
from tasks.runners import check_ray_nodes_reach_api, map_parallelism, map_task_runner, prefect_mapper
from tasks.tracking import StageRun, Tracking, record_reuse, stage_run, training_datasets


class DataResult(BaseModel):
    """What later stages need from data prep."""

    dataset_dir: Path
    manifest_path: Path
    tokenizer_path: Path
    reused: bool
    metrics: dict[str, float]


def prepare_data(params: PipelineParams, tracking: Tracking) -> DataResult:
    """The data stage as a subflow of the calling flow. Mapped tasks run on their flow run's task runner, and
    the calling flows' runners are fixed by their decorators (a deployment runs them as they are), so the
    map steps get a flow run of their own, on the runner that params.data chooses."""
    try:
        return data_prep_stage.with_options(task_runner=map_task_runner(params.data))(params, tracking)
    except ConnectionError as error:  # ray.init found no cluster at the address
        if params.data.runner != "ray":
            raise
        raise ValueError(
            f"data.runner=ray: no Ray cluster answers at data.ray_address={params.data.ray_address!r} ({error})"
        ) from error


@flow(name="data-prep-stage", log_prints=True)
def data_prep_stage(params: PipelineParams, tracking: Tracking) -> DataResult:
    if params.data.runner == "ray":
        check_ray_nodes_reach_api()
    return prepare_and_record(params, tracking)


@task(
    name="prepare-data",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_on_transient_io,
    cache_policy=NO_CACHE,  # reuse is decided by the dataset manifest, which survives any Prefect server
)
def prepare_and_record(params: PipelineParams, tracking: Tracking) -> DataResult:
    with stage_run(tracking, "data_prep") as run:
        run.log_params(_stage_params(params))
        progress = PhaseProgress("data prep")
        started = time.perf_counter()
        try:
            with forwarded_logs("model_core.data"):  # per-step documents/s, tokens/s, MB read and ETA
                mapper = functools.partial(prefect_mapper, parallelism=map_parallelism(params.data))
                result = prepare_dataset(params.data, params.tokenizer, params.model, progress, mapper)
        finally:
            progress.close()
        metrics = numeric_leaves(result.manifest, skip=MANIFEST_SETTINGS)
        metrics.update(numeric_leaves(result.report.get("reuse", {}), "reuse."))  # build statistics, not content
        metrics["seconds"] = time.perf_counter() - started
        run.log_metrics(metrics)
        run.set_tags({"llmflow.dataset_dir": str(result.output_dir)})
        record_health(run, health_of(result.manifest, params))
        run.log_datasets(training_datasets(result.output_dir))  # what it made, each split in the role it has
        record_reuse(run, "data prep", result.output_dir if result.reused else None)
        _log_artifacts(run, result)
    create_markdown_artifact(
        summary_markdown(result), key="data-prep-summary", description="Data prep counts, tokens and shards"
    )
    return DataResult(
        dataset_dir=result.output_dir,
        manifest_path=result.manifest_path,
        tokenizer_path=result.tokenizer_path,
        reused=result.reused,
        metrics=metrics,
    )


def _stage_params(params: PipelineParams) -> dict[str, object]:
    keep = ("data.", "tokenizer.", "model.vocab_size", "model.vocab_padding", "model.seq_len")
    return {key: value for key, value in flatten(params).items() if key.startswith(keep)}


def health_of(manifest: dict, params: PipelineParams) -> dict | None:
    """The manifest's data-health section judged against this run's data.health thresholds (a reused dataset was
    judged against those of the run that built it); None for a dataset prepared before data health existed."""
    section = manifest.get("health")
    return {**section, **health.judge(section, params.data.health)} if section else None


def record_health(run: StageRun, section: dict | None) -> None:
    """The data-health line and warnings in the console and the Prefect log, and on the data prep run: the tag
    `llmflow.data_health_warnings` (their count) and the text artifact data_health.txt (the measures are metrics)."""
    line = health.summary_line(section)
    print(line)
    if section is not None:
        run.set_tags({"llmflow.data_health_warnings": str(len(section["warnings"]))})
        run.log_text(line + "\n", "data_health.txt")


def _log_artifacts(run: StageRun, result: PrepResult) -> None:
    run.log_artifact(result.manifest_path, "data")
    run.log_artifact(result.tokenizer_path, "tokenizer")


# Manifest sections that record settings (already the stage's params) or per-shard detail, not measurements:
# left out of the stage's metrics, where only what prep counted and measured belongs.
MANIFEST_SETTINGS = frozenset(
    {"shards", "params", "format_version", "near_dedup", "tokenizer", "vocab_size", "seq_len", "thresholds"}
)


def numeric_leaves(tree: object, prefix: str = "", skip: frozenset[str] | set[str] = frozenset()) -> dict[str, float]:
    """Flatten the numbers of a nested dict into `a.b.c` -> float (booleans and strings are left out)."""
    found: dict[str, float] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in skip:
                continue
            found.update(numeric_leaves(value, f"{prefix}{key}.", skip))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        found[prefix.rstrip(".")] = float(tree)
    return found


def summary_markdown(result: PrepResult) -> str:
    """A Prefect artifact: the manifest's numbers as a table, one row each."""
    numbers = numeric_leaves(result.manifest, skip=MANIFEST_SETTINGS)
    rows = "\n".join(f"| {name} | {value:,.6g} |" for name, value in numbers.items())
    state = "reused an existing dataset" if result.reused else "prepared a new dataset"
    return f"# Data prep\n\n{state}: `{result.output_dir}`\n\n| quantity | value |\n|---|---|\n{rows}\n"
