"""The flows under Prefect's test harness: stages run, MLflow records parent and child runs, failures surface."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from conftest import small_pipeline_overrides
from flows.cli import main
from flows.data_prep import data_prep_flow
from flows.pretrain import pretrain_flow
from params import load_params, params_hash

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _runs(client: MlflowClient, experiment: str):
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time ASC"])
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    children = [run for run in runs if "mlflow.parentRunId" in run.data.tags]
    return parents, children


def test_pretrain_flow_records_parent_and_stage_runs(corpus_jsonl, tmp_path, mlflow_uri):
    params = load_params("tiny", small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-records"))
    result = pretrain_flow(params)

    assert result.data.manifest_path.is_file() and not result.data.reused
    client = MlflowClient(mlflow_uri)
    (parent,), (child,) = _runs(client, "flow-records")
    assert parent.info.run_id == result.mlflow_run_id
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["llmflow.params_hash"] == params_hash(params)
    assert tags["prefect.deployment"] == "none"
    assert len(tags["prefect.flow_run_id"]) == 36 and parent.info.run_name == tags["prefect.flow_run_name"]
    assert len(tags["mlflow.source.git.commit"]) in (40, len("unknown"))
    assert parent.data.params["model.vocab_size"] == "512"
    assert parent.data.params["train.steps"] == str(params.train.steps)
    assert "params.yaml" in [item.path for item in client.list_artifacts(parent.info.run_id)]

    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.run_name == "data_prep"
    assert child.data.params["model.seq_len"] == "64"
    assert child.data.metrics["seconds"] > 0
    assert any(name.endswith("tokens") and value > 0 for name, value in child.data.metrics.items())
    artifacts = {item.path for item in client.list_artifacts(child.info.run_id, "data")}
    artifacts |= {item.path for item in client.list_artifacts(child.info.run_id, "tokenizer")}
    assert "data/manifest.json" in artifacts
    assert any(path.startswith("tokenizer/") and path.endswith(".model") for path in artifacts)


def test_same_params_reuse_the_dataset(corpus_jsonl, tmp_path, mlflow_uri):
    params = load_params("tiny", small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-reuse"))
    first = data_prep_flow(params)
    second = data_prep_flow(params)
    assert not first.reused and second.reused
    assert second.dataset_dir == first.dataset_dir
    _, children = _runs(MlflowClient(mlflow_uri), "flow-reuse")
    assert [run.data.tags["llmflow.reused"] for run in children] == ["false", "true"]


def test_failed_stage_fails_flow_and_marks_runs_failed(tmp_path, mlflow_uri):
    overrides = small_pipeline_overrides(tmp_path / "missing.jsonl", tmp_path / "data", "flow-fails")
    params = load_params("tiny", overrides)
    with pytest.raises(ValueError, match="missing.jsonl"):
        pretrain_flow(params)
    (parent,), (child,) = _runs(MlflowClient(mlflow_uri), "flow-fails")
    assert parent.info.status == "FAILED" and child.info.status == "FAILED"
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_prefect_validates_the_params_parameter():
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="hidden_sise"):
        pretrain_flow({"model": {"hidden_sise": 64}})


def test_cli_run_and_exit_codes(corpus_jsonl, tmp_path, mlflow_uri, capsys):
    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-cli")
    args = [arg for override in overrides for arg in ("--set", override)]
    assert main(["run", *args]) == 0
    assert "pipeline finished: MLflow run" in capsys.readouterr().out

    assert main(["run", *args, "--set", "model.num_heads=3"]) == 2
    assert "model.hidden_size=128 is not divisible by model.num_heads=3" in capsys.readouterr().err

    missing = small_pipeline_overrides(tmp_path / "nope.jsonl", tmp_path / "data", "flow-cli")
    assert main(["prep", *[arg for override in missing for arg in ("--set", override)]]) == 1
    assert "nope.jsonl" in capsys.readouterr().err
