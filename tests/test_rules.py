"""The rule book (params/rules.py): every refused combination, driven through every entry point (the CLI
commands, the flows as a deployment run enters them, a sweep), fails before anything is prepared, converted or
launched, with one line naming both settings and both values."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.exceptions import ParameterTypeError

from flows.cli import main
from flows.data_prep import data_prep_flow
from flows.pretrain import pretrain_flow
from flows.sweep import sweep_flow
from params import ParamsError, load_params, preset_names
from params.loading import PRESETS_DIR, _apply_override
from params.rules import ParallelConfigError, run_problems

MOE = "model.moe.num_experts=4"  # top-2 of 4 experts in every block
EXPERIMENT = "refused-runs"
PARAM_OFFLOAD = ["parallel.data_parallel=2", "parallel.zero_stage=3", "parallel.optimizer_offload=true",
                 "parallel.param_offload=true"]

# (overrides of the tiny preset, what the refusal says: both settings and both values)
LAYOUTS = [
    pytest.param(["parallel.tensor_parallel=3"], "parallel.tensor_parallel=3 does not divide model.num_heads=4",
                 id="tp-heads"),
    pytest.param(["parallel.tensor_parallel=2", "model.vocab_size=4097"],
                 "parallel.tensor_parallel=2 does not divide model.vocab_size=4097", id="tp-vocab"),
    pytest.param(["parallel.pipeline_parallel=3", "parallel.micro_batches=3"],
                 "parallel.pipeline_parallel=3 does not divide model.num_layers=4", id="pp-layers"),
    pytest.param(["parallel.pipeline_parallel=2"],
                 "parallel.micro_batches=1 is fewer than parallel.pipeline_parallel=2", id="micro-batches"),
    pytest.param([MOE, "parallel.data_parallel=3", "parallel.expert_parallel=2"],
                 "parallel.expert_parallel=2 does not divide parallel.data_parallel=3", id="ep-dp"),
    pytest.param(["parallel.data_parallel=2", "parallel.expert_parallel=2"],
                 "parallel.expert_parallel=2 but model.moe is null", id="ep-without-experts"),
    pytest.param([MOE, "parallel.data_parallel=2", "parallel.zero_stage=3"],
                 "parallel.zero_stage=3 with model.moe (4 MoE blocks)", id="moe-zero3"),
    pytest.param([*PARAM_OFFLOAD, "parallel.pipeline_parallel=2", "parallel.micro_batches=2"],
                 "parallel.param_offload=true with parallel.pipeline_parallel=2", id="param-offload-pp"),
    pytest.param(["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "model.seq_len=129"],
                 "parallel.sequence_parallel=true: parallel.tensor_parallel=2 does not divide model.seq_len=129",
                 id="sp-seq-len"),
    pytest.param(["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "parallel.context_parallel=2",
                  "parallel.data_parallel=1"],
                 "parallel.sequence_parallel=true with parallel.context_parallel=2", id="sp-cp"),
]
# Refused only where the run fine-tunes.
FINE_TUNE = [*PARAM_OFFLOAD, "lora.enabled=true"]
FINE_TUNE_REFUSAL = "parallel.param_offload=true with LoRA fine-tuning (lora.enabled=true"


@pytest.fixture
def sandbox(tmp_path, mlflow_uri, monkeypatch):
    """Overrides that send everything a run could write under tmp_path, and a Popen that only records; on the way
    out, that no process was started, nothing written there and nothing recorded in MLflow."""
    (tmp_path / "hf").mkdir()
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: started.append(args))
    yield [
        f"data.output_dir={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'train'}",
        f"convert.hf_source={tmp_path / 'hf'}", f"convert.cache_dir={tmp_path / 'converted'}",
        f"tracking.uri={mlflow_uri}", f"tracking.experiment={EXPERIMENT}",
    ]
    assert not started, f"a process was started: {started}"
    assert not [name for name in ("data", "train", "converted") if (tmp_path / name).exists()]
    assert MlflowClient(mlflow_uri).get_experiment_by_name(EXPERIMENT) is None


def cli_refuses(argv: list[str], overrides: list[str], message: str, capsys) -> None:
    code = main([*argv, *(arg for item in overrides for arg in ("--set", item))])
    error = capsys.readouterr().err.strip()
    assert code != 0 and message in error and "\n" not in error, (argv, code, error)


def deployment_run(flow, name: str, value) -> None:
    """What a deployment run does before the flow's first task: validate the parameters, then enter the body."""
    flow.fn(**flow.validate_parameters({name: value}))


def raw_params(overrides: list[str]) -> dict:
    raw = yaml.safe_load((PRESETS_DIR / "tiny.yaml").read_text())
    for override in overrides:
        _apply_override(raw, override)
    return raw


def sweep_file(directory: Path, overrides: list[str]) -> Path:
    settings = dict(override.split("=", 1) for override in overrides)
    sweep = {
        "name": "refused", "params": "tiny", "method": "grid", "space": {"optimizer.lr": [0.001, 0.003]},
        "overrides": {name: yaml.safe_load(value) for name, value in settings.items()},
        "metric": "pretrain.validation_loss", "goal": "minimize",
    }
    path = directory / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def flows_refuse(flow_arguments: list[tuple], message: str) -> None:
    for flow, name, value in flow_arguments:
        with pytest.raises((ParameterTypeError, ParamsError, ParallelConfigError)) as caught:
            deployment_run(flow, name, value)
        assert message in str(caught.value), (flow.name, str(caught.value))


@pytest.mark.parametrize(("overrides", "message"), LAYOUTS)
def test_a_layout_that_cannot_run_is_refused_by_every_entry_point(overrides, message, sandbox, tmp_path, capsys):
    every = [*overrides, *sandbox]
    for command in (["run"], ["train"], ["finetune"], ["prep"], ["plan", "--try", "2"]):
        cli_refuses(command, every, message, capsys)
    sweep = sweep_file(tmp_path, every)
    cli_refuses(["sweep", str(sweep)], [], message, capsys)
    raw = raw_params(every)
    flows_refuse([(pretrain_flow, "params", raw), (data_prep_flow, "params", raw),
                  (sweep_flow, "sweep", yaml.safe_load(sweep.read_text()))], message)


def test_parameter_offload_is_refused_where_the_run_fine_tunes(sandbox, tmp_path, capsys):
    every = [*FINE_TUNE, *sandbox]
    for command in (["run"], ["finetune"]):
        cli_refuses(command, every, FINE_TUNE_REFUSAL, capsys)
    sweep = sweep_file(tmp_path, every)
    cli_refuses(["sweep", str(sweep)], [], FINE_TUNE_REFUSAL, capsys)
    flows_refuse([(pretrain_flow, "params", raw_params(every)), (sweep_flow, "sweep", yaml.safe_load(sweep.read_text()))],
                 FINE_TUNE_REFUSAL)
    # Pretraining alone (`llmflow train`, data prep, layout trials) has no LoRA: the same params pass for it.
    params = load_params("tiny", every)
    assert run_problems(params) == [] and run_problems(params, finetunes=True)[0].startswith(FINE_TUNE_REFUSAL)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_describes_a_run_that_can_happen(name):
    params = load_params(name)
    assert run_problems(params, world_size=params.parallel.world_size, finetunes=params.lora.enabled) == []
