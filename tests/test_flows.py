"""The flows under Prefect's test harness: stages run, MLflow records parent and child runs, failures surface."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from conftest import small_pipeline_overrides
from flows.cli import main
from flows.data_prep import data_prep_flow
from flows.pretrain import pretrain_flow
from model_core.data.identity import split_identities
from model_core.model.lora import base_sha256
from model_core.storage import file_sha256
from params import load_params, params_hash

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _runs(client: MlflowClient, experiment: str):
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time ASC"])
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    children = [run for run in runs if "mlflow.parentRunId" in run.data.tags]
    return parents, children


def test_pretrain_flow_records_parent_and_stage_runs(corpus_jsonl, tmp_path, mlflow_uri):
    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-records")
    # Long enough rows for the instruction examples, so the fine-tune stage runs too.
    params = load_params("tiny", [*overrides, "model.seq_len=128", "lora.enabled=true", "lora.steps=10"])
    result = pretrain_flow(params)

    assert result.data.manifest_path.is_file() and not result.data.reused
    assert result.smoke.final_loss < result.smoke.initial_loss - params.smoke.min_loss_drop
    assert result.pretrain.steps == params.train.steps and result.pretrain.checkpoint.is_dir()
    client = MlflowClient(mlflow_uri)
    (parent,), children = _runs(client, "flow-records")
    assert [run.data.tags["llmflow.stage"] for run in children] == ["data_prep", "smoke", "pretrain", "finetune", "evaluate"]
    assert parent.info.run_id == result.mlflow_run_id
    assert {run.info.status for run in (parent, *children)} == {"FINISHED"}
    assert {run.data.tags["mlflow.parentRunId"] for run in children} == {parent.info.run_id}
    tags = parent.data.tags
    assert tags["llmflow.params_hash"] == params_hash(params)
    assert tags["prefect.deployment"] == "none"
    assert len(tags["prefect.flow_run_id"]) == 36 and parent.info.run_name == tags["prefect.flow_run_name"]
    assert [run.info.run_name for run in children][:2] == [f"{parent.info.run_name}/data_prep", f"{parent.info.run_name}/smoke"]
    assert len(tags["mlflow.source.git.commit"]) in (40, len("unknown"))
    assert parent.data.params["model.vocab_size"] == "512"
    assert parent.data.params["train.steps"] == str(params.train.steps)
    assert "params.yaml" in [item.path for item in client.list_artifacts(parent.info.run_id)]

    data_run, smoke_run, pretrain_run, finetune_run, evaluate_run = children
    assert data_run.data.params["model.seq_len"] == "128"
    assert data_run.data.metrics["seconds"] > 0
    assert any(name.endswith("tokens") and value > 0 for name, value in data_run.data.metrics.items())
    settings = [name for name in data_run.data.metrics if name.startswith(("params.", "tokenizer.", "near_dedup."))]
    assert settings == [] and data_run.data.params["data.min_chars"] == str(params.data.min_chars)  # params, not metrics
    assert parent.data.metrics["pretrain.final_loss"] == pretrain_run.data.metrics["final_loss"]  # the headline
    artifacts = {item.path for item in client.list_artifacts(data_run.info.run_id, "data")}
    artifacts |= {item.path for item in client.list_artifacts(data_run.info.run_id, "tokenizer")}
    assert "data/manifest.json" in artifacts
    assert any(path.startswith("tokenizer/") and path.endswith(".model") for path in artifacts)

    assert smoke_run.data.tags["llmflow.smoke_passed"] == "true"
    for run, steps in ((smoke_run, params.smoke.steps), (pretrain_run, params.train.steps)):
        history = client.get_metric_history(run.info.run_id, "loss")
        assert [m.step for m in history] == list(range(params.train.log_interval, steps + 1, params.train.log_interval))
        assert {"tokens_per_second", "grad_norm", "lr", "peak_memory_bytes", "validation_loss"} <= run.data.metrics.keys()
        names = {item.path for item in client.list_artifacts(run.info.run_id)}
        assert {"loss_curve.png", "checkpoint"} <= names
        checkpoint_files = {item.path.rsplit("/", 1)[-1] for item in client.list_artifacts(run.info.run_id, f"checkpoint/step-{steps:08d}")}
        assert {"model.safetensors", "state.json", "manifest.json"} <= checkpoint_files
        assert "optimizer.safetensors" not in checkpoint_files  # weights only unless tracking.log_optimizer_state

    assert [m.step for m in client.get_metric_history(finetune_run.info.run_id, "loss")] == [5, 10]
    assert 0 < finetune_run.data.metrics["trainable_share"] < 1
    assert finetune_run.data.tags["llmflow.base_sha256"] == base_sha256(result.pretrain.checkpoint)
    names = {item.path for item in client.list_artifacts(finetune_run.info.run_id, "adapters")}
    assert {"adapters/adapters.safetensors", "adapters/adapter_config.json"} <= names
    metrics = evaluate_run.data.metrics
    for model in ("base", "finetuned"):
        for held_out in ("pretraining", "instructions"):
            assert metrics[f"{model}.{held_out}.perplexity"] > 1
    assert evaluate_run.data.params["eval.seed"] == str(params.eval.seed)
    reports = {item.path for item in client.list_artifacts(evaluate_run.info.run_id, "eval/finetuned")}
    assert {"eval/finetuned/eval_report.json", "eval/finetuned/eval_report.md"} <= reports
    assert set(result.evaluation.losses) == {"base", "finetuned"}

    # Lineage: each stage's datasets by content digest, in the context it used them; the pipeline run has each once.
    corpus = {identity.split: identity.digest for identity in split_identities(result.data.dataset_dir)}
    instructions = {identity.split: identity.digest for identity in split_identities(result.finetune.instructions_dir)}
    training = {("pretraining/train", corpus["train"], "training"), ("pretraining/validation", corpus["validation"], "validation")}
    assert _datasets(data_run) == _datasets(smoke_run) == _datasets(pretrain_run) == training
    tuning = {("instructions/train", instructions["train"], "training"),
              ("instructions/validation", instructions["validation"], "validation")}
    assert _datasets(finetune_run) == {("pretraining/train", corpus["train"], "base model"), *tuning}
    assert _datasets(evaluate_run) == {("pretraining/validation", corpus["validation"], "evaluation"),
                                       ("instructions/validation", instructions["validation"], "evaluation")}
    assert _datasets(parent) == training | tuning
    source = json.loads(pretrain_run.inputs.dataset_inputs[0].dataset.source)
    assert source == {"uri": str(result.data.dataset_dir), "inputs": {str(corpus_jsonl.resolve()): file_sha256(corpus_jsonl)}}


def _datasets(run) -> set[tuple[str, str, str]]:
    """A run's MLflow dataset inputs as (name, digest, context)."""
    return {(item.dataset.name, item.dataset.digest, next(tag.value for tag in item.tags if tag.key == "mlflow.data.context"))
            for item in run.inputs.dataset_inputs}


def test_smoke_failure_stops_before_pretraining(corpus_jsonl, tmp_path, mlflow_uri):
    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-smoke-fails")
    params = load_params("tiny", [*overrides, "smoke.steps=5", "smoke.min_loss_drop=50"])
    with pytest.raises(ValueError, match="smoke run failed: loss went from .* smoke.min_loss_drop=50.0"):
        pretrain_flow(params)
    (parent,), children = _runs(MlflowClient(mlflow_uri), "flow-smoke-fails")
    assert [run.data.tags["llmflow.stage"] for run in children] == ["data_prep", "smoke"]
    assert parent.info.status == "FAILED" and children[1].info.status == "FAILED"
    assert children[1].data.tags["llmflow.smoke_passed"] == "false"


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
    # The stages themselves are checked above; here only the command's exit codes, so no smoke run.
    overrides = [*small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-cli"), "smoke.enabled=false", "train.steps=5"]
    args = [arg for override in overrides for arg in ("--set", override)]
    assert main(["run", *args]) == 0
    assert "pipeline finished: MLflow run" in capsys.readouterr().out

    assert main(["run", *args, "--set", "model.num_heads=3"]) == 2
    assert "model.hidden_size=64 is not divisible by model.num_heads=3" in capsys.readouterr().err

    missing = small_pipeline_overrides(tmp_path / "nope.jsonl", tmp_path / "data", "flow-cli")
    assert main(["prep", *[arg for override in missing for arg in ("--set", override)]]) == 1
    assert "nope.jsonl" in capsys.readouterr().err


def test_hugging_face_source_adds_a_convert_stage_that_pretraining_starts_from(corpus_jsonl, tmp_path, mlflow_uri):
    from test_convert import small_hf_model_for_pipeline

    small_hf_model_for_pipeline(tmp_path / "hf")
    overrides = [
        *small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-convert"),
        f"convert.hf_source={tmp_path / 'hf'}",
        f"convert.cache_dir={tmp_path / 'converted'}",
        "smoke.enabled=false",
        "train.steps=5",
    ]
    result = pretrain_flow(load_params("tiny", overrides))
    assert result.converted is not None and result.smoke is None
    (parent,), children = _runs(MlflowClient(mlflow_uri), "flow-convert")
    assert [run.data.tags["llmflow.stage"] for run in children] == ["data_prep", "convert", "pretrain", "evaluate"]
    assert children[2].data.params["stage.initial_weights"] == str(result.converted.checkpoint_dir)


def test_cli_convert_round_trip_and_tokenizer_check(tmp_path, capsys):
    from test_convert import small_hf_model_for_pipeline

    small_hf_model_for_pipeline(tmp_path / "hf")
    assert main(["convert", "hf-to-ms", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "ours")]) == 0
    assert main(["convert", "ms-to-hf", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "config.json").is_file()
    assert main(["convert", "hf-to-ms", "--src", str(tmp_path / "missing"), "--dst", str(tmp_path / "x")]) == 1
    assert "missing" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.extended  # the flow around LoRA on dp2 ranks, which tests/test_finetune.py checks by default
def test_pretrain_flow_with_lora_under_dp2_fine_tunes_on_ranks_too(corpus_jsonl, tmp_path, mlflow_uri):
    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "flow-lora-dp2")
    sets = ["model.seq_len=128", "lora.enabled=true", "lora.steps=4", "parallel.data_parallel=2", "smoke.enabled=false",
            "train.steps=4", "train.log_interval=2"]
    result = pretrain_flow(load_params("tiny", [*overrides, *sets]))
    assert result.finetune is not None and result.finetune.steps == 4
    assert (result.finetune.adapters_dir / "adapters.safetensors").is_file()
    assert (result.finetune.adapters_dir.parent / "logs").is_dir()  # the fine-tune ran as msrun ranks
    client = MlflowClient(mlflow_uri)
    _, children = _runs(client, "flow-lora-dp2")
    assert [run.data.tags["llmflow.stage"] for run in children] == ["data_prep", "pretrain", "finetune", "evaluate"]
    assert [m.step for m in client.get_metric_history(children[2].info.run_id, "loss")] == [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("layout,sets,first_file", [
    ("tp2", ["parallel.tensor_parallel=2"], "model-tp1-of-2.safetensors"),
    # The stage launches pp2 as it launches tp2; only the checkpoint's file names differ.
    pytest.param("pp2", ["parallel.pipeline_parallel=2", "parallel.micro_batches=2"], "model-pp1-of-2.safetensors",
                 marks=pytest.mark.extended),
])
def test_pretrain_stage_runs_sharded_under_msrun_and_streams_rank_0_metrics(corpus_jsonl, tmp_path, mlflow_uri, layout, sets, first_file):
    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", f"flow-{layout}")
    params = load_params("tiny", [*overrides, *sets, "smoke.enabled=false", "train.steps=10"])
    result = pretrain_flow(params)
    checkpoint = result.pretrain.checkpoint
    assert result.pretrain.steps == 10 and (checkpoint / first_file).is_file()
    assert (checkpoint.parent / "logs").is_dir()
    client = MlflowClient(mlflow_uri)
    _, children = _runs(client, f"flow-{layout}")
    assert [run.data.tags["llmflow.stage"] for run in children] == ["data_prep", "pretrain", "evaluate"]
    pretrain_run = children[1]
    assert [m.step for m in client.get_metric_history(pretrain_run.info.run_id, "loss")] == [5, 10]
    assert pretrain_run.data.metrics["final_loss"] == result.pretrain.final_loss < result.pretrain.initial_loss
    assert ("pipeline_bubble" in pretrain_run.data.metrics) == (layout == "pp2")
    assert children[2].data.metrics["base.pretraining.perplexity"] > 1  # evaluated from the joined blocks