"""Lineage in MLflow: a stage run lists the datasets it used as MLflow dataset inputs (name, content digest,
source, context), the pipeline run lists each once, and `llmflow compare` shows a data row per stage and says
when two runs used different data. The stages' own calls are checked on a real pipeline in test_flows.py."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from flows.cli import main
from model_core.data.identity import InputDigest, SplitIdentity
from params import PipelineParams
from tasks.compare import compare, render
from tasks.tracking import BASE_MODEL, EVALUATION, TRAINING, VALIDATION, Tracking, ensure_experiment, stage_run


def split(kind: str, name: str, digest: str, inputs: tuple[InputDigest, ...] = ()) -> SplitIdentity:
    profile = {"rows": 4, "tokens": 100, "shards": 1, "seq_len": 32}
    return SplitIdentity(kind, name, digest, Path(f"/data/{kind}-{digest}"), inputs, profile)


def pipeline(client: MlflowClient, uri: str, experiment_id: str, name: str, corpus_digest: str) -> str:
    """A finished pipeline run whose stages record the datasets they used, as the stage tasks do."""
    parent = client.create_run(experiment_id, run_name=name).info.run_id
    tracking = Tracking(uri, experiment_id, parent, name)
    corpus = (split("pretraining", "train", corpus_digest), split("pretraining", "validation", corpus_digest[::-1]))
    instructions = (split("instructions", "train", "1111222233334444"), split("instructions", "validation", "5555666677778888"))
    used = {
        "data_prep": [(corpus[0], TRAINING), (corpus[1], VALIDATION)],
        "pretrain": [(corpus[0], TRAINING), (corpus[1], VALIDATION)],
        "finetune": [(corpus[0], BASE_MODEL), (instructions[0], TRAINING), (instructions[1], VALIDATION)],
        "evaluate": [(corpus[1], EVALUATION), (instructions[1], EVALUATION)],
    }
    for stage, datasets in used.items():
        with stage_run(tracking, stage) as run:
            run.log_datasets(datasets)
    client.set_terminated(parent)
    return parent


def inputs_of(client: MlflowClient, run_id: str) -> dict[str, tuple[str, str]]:
    found = client.get_run(run_id).inputs.dataset_inputs
    return {item.dataset.name: (item.dataset.digest, {tag.key: tag.value for tag in item.tags}["mlflow.data.context"])
            for item in found}


def test_stage_runs_list_their_datasets_and_compare_shows_which_data_differ(mlflow_uri, capsys):
    client = MlflowClient(mlflow_uri)
    experiment_id = ensure_experiment(client, PipelineParams(tracking={"uri": mlflow_uri, "experiment": "lineage"}))
    first = pipeline(client, mlflow_uri, experiment_id, "first", "aaaaaaaabbbbbbbb")
    same = pipeline(client, mlflow_uri, experiment_id, "same", "aaaaaaaabbbbbbbb")
    other = pipeline(client, mlflow_uri, experiment_id, "other", "ccccccccdddddddd")

    children = {run.data.tags["llmflow.stage"]: run for run in client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{first}'")}
    assert inputs_of(client, children["finetune"].info.run_id) == {
        "pretraining/train": ("aaaaaaaabbbbbbbb", "base model"),
        "instructions/train": ("1111222233334444", "training"),
        "instructions/validation": ("5555666677778888", "validation"),
    }
    assert inputs_of(client, children["evaluate"].info.run_id) == {
        "pretraining/validation": ("bbbbbbbbaaaaaaaa", "evaluation"),
        "instructions/validation": ("5555666677778888", "evaluation"),
    }
    # The pipeline run: every dataset of its stages once, in the role of its split.
    assert inputs_of(client, first) == {
        "pretraining/train": ("aaaaaaaabbbbbbbb", "training"),
        "pretraining/validation": ("bbbbbbbbaaaaaaaa", "validation"),
        "instructions/train": ("1111222233334444", "training"),
        "instructions/validation": ("5555666677778888", "validation"),
    }
    dataset = client.get_run(first).inputs.dataset_inputs[0].dataset
    assert dataset.source_type == "local" and json.loads(dataset.source)["uri"].startswith("/data/")
    assert json.loads(dataset.profile) == {"rows": 4, "tokens": 100, "shards": 1, "seq_len": 32}

    alike = compare(mlflow_uri, [first, same])
    assert alike.data_differs == [] and ("finetune", "instructions/train") in alike.data_rows
    assert "(every stage used the same data in these runs)" in render(alike, mlflow_uri).splitlines()

    differing = compare(mlflow_uri, [first, other])
    assert differing.data_differs == [
        ("data_prep", "pretraining/train"), ("data_prep", "pretraining/validation"), ("pretrain", "pretraining/train"),
        ("pretrain", "pretraining/validation"), ("finetune", "pretraining/train"), ("evaluate", "pretraining/validation"),
    ]
    table = render(differing, mlflow_uri).splitlines()
    assert "data: stage  dataset                  first     other" in table
    assert "pretrain     pretraining/train        aaaaaaaa  cccccccc" in table
    assert "finetune     instructions/train       11112222  11112222" in table
    assert "data differ: pretraining/train is aaaaaaaa in first, cccccccc in other (data_prep, pretrain, finetune)" in table
    markdown = render(differing, mlflow_uri, "markdown").splitlines()
    assert "| data: stage | dataset | first | other |" in markdown
    assert "| evaluate | pretraining/validation | bbbbbbbb | dddddddd |" in markdown
    assert "data differ: pretraining/validation is bbbbbbbb in first, dddddddd in other (data_prep, pretrain, evaluate)" in markdown

    assert main(["compare", first, other, "--tracking-uri", mlflow_uri, "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {"stage": "finetune", "dataset": "pretraining/train"} in shown["differing_data"]
    assert shown["runs"][1]["data"]["finetune"][0] == {
        "name": "pretraining/train", "digest": "ccccccccdddddddd", "context": "base model"}


def test_a_corpus_of_many_files_is_summarised_within_mlflows_limit_on_a_source(mlflow_uri):
    client = MlflowClient(mlflow_uri)
    experiment_id = ensure_experiment(client, PipelineParams(tracking={"uri": mlflow_uri, "experiment": "lineage-many"}))
    parent = client.create_run(experiment_id).info.run_id
    inputs = tuple(InputDigest(f"/corpus/{'deep/' * 20}part-{index:05d}.jsonl.zst", f"{index:064x}") for index in range(2000))
    with stage_run(Tracking(mlflow_uri, experiment_id, parent), "data_prep") as run:
        run.log_datasets([(split("pretraining", "train", "0123456789abcdef", inputs), TRAINING)])
    source = json.loads(client.get_run(parent).inputs.dataset_inputs[0].dataset.source)
    assert source["input_files"] == 2000 and len(source["inputs_sha256"]) == 64
    assert 0 < len(source["inputs"]) < 2000
    assert source["inputs"][inputs[0].path] == inputs[0].sha256
