"""Pre-flight warnings (params/rules.py `run_warnings`): each fires with its numbers and its reason, none fires on
the presets, `check_run` hands them back while it still refuses what cannot run, and the pipeline records them once
on its MLflow run."""

import pytest
from mlflow.tracking import MlflowClient

from params import load_params, preset_names
from params.rules import ParallelConfigError, check_run, run_warnings, typical_learning_rate
from tasks.tracking import Tracking, record_warnings


@pytest.mark.parametrize("preset", preset_names())
def test_the_presets_start_without_a_warning(preset):
    assert run_warnings(load_params(preset)) == []


def test_a_rope_theta_too_small_for_the_sequence_is_named_with_its_wavelength_and_the_least_theta():
    (warning,) = run_warnings(load_params("tiny", ["model.rope_theta=10", "model.seq_len=1024"]))
    assert warning.startswith("model.rope_theta=10 with head dim 32: the slowest RoPE pair comes full circle every 54 ")
    assert "fewer than model.seq_len=1024" in warning and "raise model.rope_theta to at least 229" in warning
    assert run_warnings(load_params("tiny", ["model.rope_theta=229", "model.seq_len=1024"])) == []


def test_no_gradient_clipping_is_warned_about():
    (warning,) = run_warnings(load_params("tiny", ["optimizer.grad_clip=null"]))
    assert warning.startswith("optimizer.grad_clip=null: gradients are not clipped")


def test_a_learning_rate_far_above_the_models_size_is_warned_about_with_the_ceiling():
    (warning,) = run_warnings(load_params("tiny", ["optimizer.lr=0.05"]))
    assert warning.startswith("optimizer.lr=0.05 is 28x the 0.0018 that models of ~1.31M parameters train at")
    assert "lower optimizer.lr to 0.009 or less" in warning
    # The fit stays within a quarter of GPT-3's table: 6.7B trained at 1.2e-4, 175B at 6e-5.
    assert typical_learning_rate(6.7e9) == pytest.approx(1.2e-4, rel=0.25)
    assert typical_learning_rate(175e9) == pytest.approx(0.6e-4, rel=0.25)
    llama2_7b = load_params("llama2_7b_dp8")
    assert run_warnings(llama2_7b.model_copy(update={"optimizer": llama2_7b.optimizer.model_copy(update={"lr": 1e-3})}))


def test_fp16_without_loss_scaling_is_warned_about_and_dynamic_scaling_is_not():
    fixed = ["precision.compute_dtype=float16", "precision.initial_loss_scale=1", "precision.loss_scale_window=1000"]
    (warning,) = run_warnings(load_params("tiny", fixed))
    assert warning.startswith("precision.compute_dtype=float16 without loss scaling: precision.initial_loss_scale=1 ")
    assert "train.steps=300" in warning and "precision.loss_scale_window=1000" in warning
    assert run_warnings(load_params("tiny", ["precision.compute_dtype=float16"])) == []


def test_check_run_returns_the_warnings_and_still_refuses_a_run_that_cannot_happen():
    params = load_params("tiny", ["optimizer.grad_clip=null", "optimizer.lr=0.05"])
    assert check_run(params) == run_warnings(params) and len(check_run(params)) == 2
    with pytest.raises(ParallelConfigError, match="the world has 3"):
        check_run(params, world_size=3)


def test_the_pipeline_records_its_warnings_once_on_its_mlflow_run(mlflow_uri, capsys):
    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment("preflight")
    run = client.create_run(experiment)
    warnings = run_warnings(load_params("tiny", ["optimizer.grad_clip=null", "model.rope_theta=10", "model.seq_len=1024"]))
    record_warnings(Tracking(mlflow_uri, experiment, run.info.run_id), warnings)
    assert capsys.readouterr().out.splitlines() == [f"warning: {warning}" for warning in warnings]
    assert client.get_run(run.info.run_id).data.tags["llmflow.warnings"] == "2"
    local = client.download_artifacts(run.info.run_id, "warnings.txt")
    assert open(local).read().splitlines() == warnings
