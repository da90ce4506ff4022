"""Params: presets load, defaults equal the tiny preset, and every bad value is an error naming its field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from params import ParamsError, PipelineParams, flatten, load_params, params_hash, preset_names, to_yaml
from params.schema import (
    DataSource,
    ModelParams,
    OptimizerParams,
    ParallelParams,
    RecomputeParams,
    StrictModel,
    TokenizerParams,
)


def test_tiny_preset_equals_schema_defaults():
    assert load_params("tiny") == PipelineParams()


def test_none_source_means_defaults():
    assert load_params(None) == PipelineParams()


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_round_trips_through_yaml(name, tmp_path):
    params = load_params(name)
    path = tmp_path / "dump.yaml"
    path.write_text(to_yaml(params))
    assert load_params(path) == params


def test_llama_presets_mirror_real_layouts():
    seven = load_params("llama2_7b_dp8")
    assert (seven.parallel.world_size, seven.parallel.zero_stage, seven.global_batch_size) == (8, 1, 512)
    assert (seven.model.hidden_size, seven.model.num_layers, seven.model.seq_len) == (4096, 32, 4096)
    assert seven.optimizer.lr == 3e-4 and seven.optimizer.schedule == "cosine"
    thirteen = load_params("llama2_13b_tp4_pp2_dp4")
    parallel = thirteen.parallel
    assert (parallel.tensor_parallel, parallel.pipeline_parallel, parallel.data_parallel) == (4, 2, 4)
    assert parallel.world_size == 32 and thirteen.global_batch_size == 512


def test_override_types_come_from_yaml():
    params = load_params("tiny", ["train.steps=7", "optimizer.grad_clip=null", "lora.target_modules=[q, v]"])
    assert params.train.steps == 7
    assert params.optimizer.grad_clip is None
    assert params.lora.target_modules == ["q", "v"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.data_parallel=2", "parallel.zero_stage=2"], "parallel.zero_stage=2, parallel.data_parallel=2"),
    (["parallel.zero_stage=3"], "parallel.zero_stage=3, parallel.data_parallel=1"),
    (["parallel.data_parallel=2", "parallel.zero_stage=3", "parallel.optimizer_offload=false"],
     "needs parallel.optimizer_offload=true"),
])
def test_param_offload_needs_zero3_over_dp_and_optimizer_offload(overrides, message):
    with pytest.raises(ParamsError, match=message):
        load_params("tiny", ["parallel.param_offload=true", "parallel.optimizer_offload=true", *overrides])
    both = ["parallel.data_parallel=2", "parallel.zero_stage=3", "parallel.optimizer_offload=true"]
    assert load_params("tiny", [*both, "parallel.param_offload=true"]).parallel.param_offload


def test_misspelt_key_in_file_names_file_line_and_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: x\ntrain:\n  steps: 3\n  stepz: 4\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    message = str(caught.value)
    assert f"{path}:4" in message and "train.stepz" in message and "unknown field" in message


def test_misspelt_override_names_the_override():
    with pytest.raises(ParamsError, match=r"--set model\.hiden=3: model\.hiden: unknown field"):
        load_params("tiny", ["model.hiden=3"])


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  hidden_size: 128\n  num_heads: [4\n")
    with pytest.raises(ParamsError, match=rf"{path}:\d+: invalid YAML"):
        load_params(path)


@pytest.mark.parametrize(
    "override",
    ["nosuchsection", "=3", "train.steps.deeper=3"],
)
def test_malformed_overrides_are_errors(override):
    with pytest.raises(ParamsError):
        load_params("tiny", [override])


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ParamsError, match="tiny"):
        load_params("no_such_preset")


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ParamsError, match="does not exist"):
        load_params(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("model_class", "values", "message"),
    [
        (ModelParams, {"hidden_size": 130, "num_heads": 4}, "hidden_size=130 is not divisible by model.num_heads=4"),
        (ModelParams, {"num_heads": 4, "num_kv_heads": 3}, "num_heads=4 is not a multiple of model.num_kv_heads=3"),
        (ModelParams, {"hidden_size": 12, "num_heads": 4, "num_kv_heads": 4}, "head dim 3"),
        (ParallelParams, {"pipeline_parallel": 4, "micro_batches": 2}, "micro_batches=2 is fewer than"),
        (OptimizerParams, {"lr": 1e-4, "min_lr": 1e-3}, "min_lr=0.001 is greater than optimizer.lr=0.0001"),
        (OptimizerParams, {"warmup_steps": 5, "warmup_ratio": 0.1}, "not both"),
        (RecomputeParams, {"mode": "selected"}, "exactly one of"),
        (RecomputeParams, {"mode": "all", "every_k": 2}, "only used with mode=selected"),
        (TokenizerParams, {"bos_id": 2, "eos_id": 2}, "eos_id=2 collides with tokenizer.bos_id=2"),
        (DataSource, {"kind": "jsonl"}, "needs at least one entry in paths"),
        (DataSource, {"kind": "python_docstrings", "paths": ["a"]}, "takes no paths"),
    ],
)
def test_single_section_checks_name_both_fields(model_class, values, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(".", r"\.")):
        model_class(**values)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tensor_parallel=3"], "parallel.tensor_parallel=3 does not divide model.num_heads=4"),
        (["model.num_layers=2", "parallel.pipeline_parallel=4", "parallel.micro_batches=4"], "parallel.pipeline_parallel=4 does not divide model.num_layers=2"),
        (["tokenizer.pad_id=5000"], "tokenizer.pad_id=5000 is outside model.vocab_size=4096"),
        (["recompute.mode=selected", "recompute.layers=[0, 9]"], r"recompute.layers \[9\] are outside"),
        (["eval.stop_token_ids=[99999]"], "eval.stop_token_ids [99999]"),
    ],
)
def test_cross_section_checks_name_both_sides(overrides, message):
    with pytest.raises(ParamsError) as caught:
        load_params("tiny", overrides)
    assert message.replace("\\", "") in str(caught.value)


def test_params_hash_tracks_every_change():
    base = load_params("tiny")
    assert params_hash(base) == params_hash(load_params("tiny"))
    assert params_hash(base) != params_hash(load_params("tiny", ["train.seed=1"]))


def test_flatten_gives_dotted_string_params():
    flat = flatten(load_params("tiny"))
    assert flat["model.hidden_size"] == "128"
    assert flat["optimizer.warmup_ratio"] == "null"
    assert flat["lora.target_modules"] == '["q", "k", "v", "o"]'
    assert all(isinstance(value, str) for value in flat.values())


def test_every_field_is_documented():
    sections = [DataSource]
    for name, field in PipelineParams.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, StrictModel):
            sections.append(field.annotation)
        else:
            assert field.description, f"{name} has no description"
    for section in sections:
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no description"
