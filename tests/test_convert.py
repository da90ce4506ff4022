"""Hugging Face <-> llmflow conversion: logit parity with transformers, lossless round trips, every
input format (safetensors, shards, pytorch_model.bin, bf16), bad inputs that stop without writing,
vocab padding, the conversion cache, the Prefect task, and training from a converted model."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from conftest import SMALL_MODEL
from safetensors.numpy import load_file, save_file

from model_core.convert import (
    ConversionError,
    check_model_agrees,
    hf_to_ms,
    hf_to_ms_cached,
    ms_to_hf,
    read_converted,
)
from model_core.convert.llama import from_hf, to_hf
from model_core.model import Llama
from model_core.model.weights import load_weights, model_weights
from model_core.storage import read_weights
from model_core.train import checkpoint as ckpt
from params import load_params
from params.schema import ModelParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16
TOKENS = (
    np.random.default_rng(7).integers(0, VOCAB - 1, (2, SEQ)).astype(np.int32)
)  # VOCAB - 1: also valid for a 255 vocab


def hf_model(tie: bool, vocab: int = VOCAB, seed: int = 0, **config):
    """A small random GQA LlamaForCausalLM; norms are randomised too so they take part in the comparison."""
    fields = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": SEQ,
        "rope_theta": 500.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
    }
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    return model


def small_model_params(**changes) -> ModelParams:
    """Our params for the small GQA model these tests convert (hidden 64, 2 layers, 4/2 heads)."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, seq_len=SEQ)
    return ModelParams(**{**fields, **changes})


def hf_logits(model, tokens: np.ndarray = TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def our_logits(weights: dict[str, np.ndarray], params: ModelParams, tokens: np.ndarray = TOKENS) -> np.ndarray:
    model = Llama(params)
    load_weights(model, weights)
    return model(ms.Tensor(tokens)).asnumpy()


def hf_state(model) -> dict[str, np.ndarray]:
    return {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """tie_embeddings -> (model, directory saved with save_pretrained)."""
    found = {}
    for tie in (True, False):
        model = hf_model(tie)
        directory = tmp_path_factory.mktemp(f"hf-tied-{tie}")
        model.save_pretrained(directory)
        found[tie] = (model, directory)
    return found


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_converted_model_matches_hugging_face_logits(hf_dirs, tmp_path, tie):
    model, directory = hf_dirs[tie]
    converted = hf_to_ms(directory, tmp_path / "ours")
    weights, params, vocab_size = read_converted(converted.path)
    assert (
        params.tie_embeddings is tie and params.num_kv_heads == 2 and vocab_size == VOCAB and params.rope_theta == 500.0
    )
    assert ("lm_head.weight" in weights) is not tie
    difference = np.abs(our_logits(weights, params) - hf_logits(model)).max()
    print(f"max |logit difference| ({'tied' if tie else 'untied'}, fp32): {difference:.2e}")
    assert difference <= 1e-4


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_ours_to_hf_to_ours_is_bit_exact(tmp_path, tie):
    params = small_model_params(tie_embeddings=tie)
    ms.set_seed(3)
    weights = model_weights(Llama(params))
    training = ckpt.save_checkpoint(
        tmp_path / "train", 5, weights, {}, {"model": params.model_dump(mode="json")}, keep=1
    )
    exported = ms_to_hf(training.path, tmp_path / "hf")
    back = hf_to_ms(exported.path, tmp_path / "ours")
    assert back.params == params
    again = read_weights(back.path)
    assert again.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    in_memory, _ = from_hf(*to_hf(weights, params))
    assert all(np.array_equal(in_memory[name], value) for name, value in weights.items())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_to_ours_to_hf_loads_in_transformers_with_identical_logits(hf_dirs, tmp_path, tie):
    model, directory = hf_dirs[tie]
    exported = ms_to_hf(hf_to_ms(directory, tmp_path / "ours").path, tmp_path / "hf")
    config = json.loads((exported.path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(exported.path).eval()
    np.testing.assert_array_equal(hf_logits(reloaded), hf_logits(model))
    original, back = hf_state(model), hf_state(reloaded)
    for name, value in original.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


# ----------------------------------------------------------------------------------------- inputs


def test_sharded_safetensors_give_the_same_weights(hf_dirs, tmp_path):
    model, directory = hf_dirs[False]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    assert_same_weights(hf_to_ms(tmp_path / "sharded", tmp_path / "a"), hf_to_ms(directory, tmp_path / "b"))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_pytorch_model_bin_gives_the_same_weights(hf_dirs, tmp_path, tie):
    model, directory = hf_dirs[tie]
    source = tmp_path / "bin"
    source.mkdir()
    shutil.copy(directory / "config.json", source)
    state = model.state_dict()  # a tied model's state dict carries lm_head.weight too
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # a buffer older checkpoints have
    torch.save(state, source / "pytorch_model.bin")
    assert_same_weights(hf_to_ms(source, tmp_path / "a"), hf_to_ms(directory, tmp_path / "b"))


def test_torch_reader_handles_strides_offsets_shared_storage_and_dtypes(tmp_path):
    from model_core.convert.torch_pickle import load_torch_state_dict

    base = torch.randn(6, 4)
    state = {
        "transposed": base.t(),
        "row": base[2],  # a view at an offset into a shared storage
        "bf16": torch.randn(3, 5).bfloat16(),
        "fp16": torch.randn(7).half(),
        "fp64": torch.randn(2, 2).double(),
    }
    torch.save(state, tmp_path / "state.bin")
    loaded = load_torch_state_dict(tmp_path / "state.bin")
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        np.testing.assert_array_equal(loaded[name], tensor.float().numpy(), err_msg=name)


def test_pytorch_model_bin_never_runs_pickled_code(hf_dirs, tmp_path):
    sentinel = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    source = tmp_path / "evil"
    source.mkdir()
    shutil.copy(hf_dirs[True][1] / "config.json", source)
    torch.save({"model.embed_tokens.weight": Payload()}, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"refusing to unpickle (posix|os)\.system"):
        hf_to_ms(source, tmp_path / "out")
    assert not sentinel.exists() and not (tmp_path / "out").exists()


def test_bf16_source_converts_exactly_and_exports_back_bit_for_bit(tmp_path):
    model = hf_model(tie=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    original = model.state_dict()
    converted = hf_to_ms(tmp_path / "bf16", tmp_path / "ours", dtype="bfloat16")
    weights = read_weights(converted.path)
    assert _stored_dtypes(converted.weights_path) == {"BF16"}
    np.testing.assert_array_equal(
        weights["layers.1.mlp.down_proj.weight"], original["model.layers.1.mlp.down_proj.weight"].float().numpy()
    )
    exported = ms_to_hf(converted.path, tmp_path / "hf", dtype="bfloat16")
    from safetensors.torch import load_file as load_torch

    back = load_torch(exported.path / "model.safetensors")
    assert all(
        back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor) for name, tensor in original.items()
    )
    source = tmp_path / "bin"
    source.mkdir()
    shutil.copy(tmp_path / "bf16" / "config.json", source)
    shutil.move(tmp_path / "pytorch_model.bin", source)
    assert_same_weights(hf_to_ms(source, tmp_path / "from-bin"), converted)


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", "bfloat16"), ("float16", "float16")])
def test_narrower_output_dtypes_round_like_torch(hf_dirs, tmp_path, dtype, torch_dtype):
    model, directory = hf_dirs[False]
    weights = read_weights(hf_to_ms(directory, tmp_path / "ours", dtype=dtype).path)
    expected = (
        model.state_dict()["model.layers.0.self_attn.q_proj.weight"].to(getattr(torch, torch_dtype)).float().numpy()
    )
    np.testing.assert_array_equal(weights["layers.0.self_attn.q_proj.weight"], expected)


def assert_same_weights(a, b) -> None:
    first, second = read_weights(a.path), read_weights(b.path)
    assert first.keys() == second.keys() and a.params == b.params
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value, err_msg=name)


def _stored_dtypes(path: Path) -> set[str]:
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


# -------------------------------------------------------------------------------------- bad inputs


def _edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


BAD_INPUTS = {
    "missing key": (
        False,
        lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        r"model\.layers\.1\.mlp\.up_proj\.weight \(shape \(96, 64\) expected from config\.json\) is missing",
    ),
    "unexpected key": (
        False,
        lambda d: _edit_tensors(
            d, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)})
        ),
        r"unexpected tensor\(s\) in the checkpoint: model\.layers\.2\.mlp\.up_proj\.weight \(96, 64\)",
    ),
    "transposed weight": (
        False,
        lambda d: _edit_tensors(
            d,
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.k_proj.weight": np.ascontiguousarray(
                        t["model.layers.0.self_attn.k_proj.weight"].T
                    )
                }
            ),
        ),
        r"model\.layers\.0\.self_attn\.k_proj\.weight: shape \(64, 32\) in the checkpoint, \(32, 64\) expected",
    ),
    "vocab size mismatch": (
        False,
        lambda d: _edit_config(d, vocab_size=300),
        r"model\.embed_tokens\.weight: shape \(256, 64\) in the checkpoint, \(300, 64\) expected .*; vocab_size=300",
    ),
    "tied head differs from embedding": (
        True,
        lambda d: _edit_tensors(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1})),
        r"tie_word_embeddings=true but lm_head\.weight \(256, 64\) differs from model\.embed_tokens\.weight",
    ),
    "unsupported feature": (
        False,
        lambda d: _edit_config(d, attention_bias=True),
        r"attention_bias=True is not supported",
    ),
    "unknown model type": (
        False,
        lambda d: _edit_config(d, model_type="mamba"),
        r"model_type='mamba' has no registered adapter",
    ),
    "no config": (False, lambda d: (d / "config.json").unlink(), r"has no config\.json"),
    "shard listed but missing": (
        False,
        lambda d: _shard_index(d, {"model.norm.weight": "model-00002-of-00002.safetensors"}),
        r"lists shard model-00002-of-00002\.safetensors, which is missing",
    ),
    "tensor in another shard than the index says": (
        False,
        lambda d: _shard_index(d, {"model.norm.weight": "model-00001-of-00001.safetensors"}),
        (
            r"tensor lm_head\.weight \(256, 64\) is in shard model-00001-of-00001\.safetensors, but "
            r"model\.safetensors\.index\.json places it in no shard"
        ),
    ),
}


def _shard_index(directory: Path, weight_map: dict[str, str]) -> None:
    """Turn model.safetensors into one shard described by an index with this weight_map."""
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_the_problem_and_writes_nothing(hf_dirs, tmp_path, case):
    tie, corrupt, message = BAD_INPUTS[case]
    source = copy_dir(hf_dirs[tie][1], tmp_path / "source")
    corrupt(source)
    with pytest.raises(ConversionError, match=message):
        hf_to_ms(source, tmp_path / "out" / "ours")
    with pytest.raises(ConversionError, match=message):
        hf_to_ms_cached(source, tmp_path / "cache")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_export_refuses_a_tokenizer_of_another_vocab_size(hf_dirs, tmp_path, sentencepiece_model):
    converted = hf_to_ms(hf_dirs[True][1], tmp_path / "ours")
    with pytest.raises(ConversionError, match=r"model vocab_size=256 does not match the tokenizer's 600 pieces"):
        ms_to_hf(converted.path, tmp_path / "hf", tokenizer=sentencepiece_model)
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    from test_tokenizer_check import train_small_tokenizer

    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")


def test_export_with_tokenizer_loads_in_transformers_and_encodes_alike(tmp_path, sentencepiece_model):
    from model_core.convert import check_tokenizers

    model = hf_model(tie=True, vocab=600)
    model.save_pretrained(tmp_path / "source")
    exported = ms_to_hf(
        hf_to_ms(tmp_path / "source", tmp_path / "ours").path, tmp_path / "hf", tokenizer=sentencepiece_model
    )
    assert {"tokenizer.model", "tokenizer_config.json", "config.json", "model.safetensors"} <= {
        p.name for p in exported.path.iterdir()
    }
    assert (exported.config["bos_token_id"], exported.config["eos_token_id"], exported.config["pad_token_id"]) == (
        1,
        2,
        3,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported.path)
    assert tokenizer("Return the number")["input_ids"][0] == 1
    report = check_tokenizers(sentencepiece_model, exported.path)
    assert report.aligned, report.format()


# -------------------------------------------------------------------------------- padding and cache


def test_vocab_padding_for_tensor_parallel_round_trips(tmp_path):
    model = hf_model(tie=False, vocab=255)
    model.save_pretrained(tmp_path / "source")
    converted = hf_to_ms(tmp_path / "source", tmp_path / "ours", tensor_parallel=2)
    weights, params, vocab_size = read_converted(converted.path)
    assert (params.vocab_size, vocab_size, converted.vocab_size) == (256, 255, 255)
    assert weights["embed_tokens.weight"].shape == (256, 64) and not weights["lm_head.weight"][255:].any()
    assert np.abs(our_logits(weights, params)[..., :255] - hf_logits(model)).max() <= 1e-4
    exported = ms_to_hf(converted.path, tmp_path / "hf")
    assert exported.config["vocab_size"] == 255
    reloaded = transformers.LlamaForCausalLM.from_pretrained(exported.path)
    for name, value in hf_state(model).items():
        np.testing.assert_array_equal(hf_state(reloaded)[name], value, err_msg=name)


def test_cache_reuses_valid_conversions_and_rebuilds_corrupted_ones(hf_dirs, tmp_path):
    directory = hf_dirs[True][1]
    first = hf_to_ms_cached(directory, tmp_path / "cache")
    again = hf_to_ms_cached(directory, tmp_path / "cache")
    assert not first.reused and again.reused and again.path == first.path and first.path.parent == tmp_path / "cache"
    other_dtype = hf_to_ms_cached(directory, tmp_path / "cache", dtype="bfloat16")
    other_cache = hf_to_ms_cached(directory, tmp_path / "elsewhere")
    assert other_dtype.path != first.path and not other_dtype.reused and not other_cache.reused
    with open(first.weights_path, "r+b") as handle:  # flip a byte in the weights
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 1]))
    rebuilt = hf_to_ms_cached(directory, tmp_path / "cache")
    assert not rebuilt.reused and rebuilt.path == first.path
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_explicit_destination_is_reused_or_refused(hf_dirs, tmp_path):
    directory = hf_dirs[True][1]
    assert not hf_to_ms(directory, tmp_path / "ours").reused
    assert hf_to_ms(directory, tmp_path / "ours").reused
    with pytest.raises(ConversionError, match="exists and is not this conversion"):
        hf_to_ms(directory, tmp_path / "ours", dtype="float16")
    with pytest.raises(ConversionError, match="exists and is not empty"):
        ms_to_hf(tmp_path / "ours", tmp_path / "ours")


def test_model_params_must_agree_with_the_config(hf_dirs):
    config = json.loads((hf_dirs[True][1] / "config.json").read_text())
    ours = small_model_params(seq_len=8, rope_theta=500.0, tie_embeddings=True)
    check_model_agrees(ours, config)
    with pytest.raises(ConversionError, match=r"model\.num_kv_heads=4 but config\.json gives num_kv_heads=2"):
        check_model_agrees(ours.model_copy(update={"num_kv_heads": 4}), config)
    with pytest.raises(
        ConversionError,
        match=r"model\.vocab_size=256 .* gives vocab_size=258 \(vocab_size=256 padded for tensor_parallel=3\)",
    ):
        check_model_agrees(ours, config, tensor_parallel=3)
    with pytest.raises(ConversionError, match=r"model\.seq_len=32 is longer than the config\.json context of 16"):
        check_model_agrees(ours.model_copy(update={"seq_len": 32}), config)


# ------------------------------------------------------------------------------ task and training


def small_hf_model_for_pipeline(directory: Path):
    """A random HF Llama shaped like conftest.SMALL_MODEL (vocab 512, seq 32, tied)."""
    model = hf_model(tie=True, vocab=512, intermediate_size=128, max_position_embeddings=32, rope_theta=10_000.0)
    model.save_pretrained(directory)
    return model


def test_convert_task_logs_to_mlflow_and_reuses_the_cache(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from tasks.convert import convert_hf
    from tasks.tracking import open_pipeline_run

    small_hf_model_for_pipeline(tmp_path / "hf")
    overrides = [
        *SMALL_MODEL,
        f"convert.hf_source={tmp_path / 'hf'}",
        f"convert.cache_dir={tmp_path / 'cache'}",
        "tracking.experiment=convert-task",
    ]
    params = load_params("tiny", overrides)
    tracking = open_pipeline_run(params, "convert-test", "none", None)
    first, second = convert_hf.fn(params, tracking), convert_hf.fn(params, tracking)
    assert not first.reused and second.reused and second.checkpoint_dir == first.checkpoint_dir
    assert ModelParams(**json.loads(first.params_path.read_text())).num_layers == 2
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([tracking.experiment_id], f"tags.mlflow.parentRunId = '{tracking.parent_run_id}'")
    assert sorted(run.data.tags["llmflow.reused"] for run in runs) == ["false", "true"]
    run = runs[0]
    assert {"seconds", "parameters", "vocab_size"} <= run.data.metrics.keys()
    assert run.data.params["convert.dtype"] == "float32" and run.data.tags["llmflow.source_hash"] == first.source_hash
    assert {a.path for a in client.list_artifacts(run.info.run_id, "convert")} == {
        "convert/params.json",
        "convert/conversion.json",
    }

    mismatched = load_params("tiny", [*overrides, "model.num_layers=3"])
    with pytest.raises(ConversionError, match=r"model\.num_layers=3 but .*config\.json gives num_layers=2"):
        convert_hf.fn(mismatched, tracking)


def test_converted_model_continues_training_from_a_sane_loss(dataset_dir, tmp_path):
    from model_core.train.trainer import Trainer

    small_hf_model_for_pipeline(tmp_path / "hf")
    params = load_params(
        "tiny",
        [
            *SMALL_MODEL,
            "train.log_interval=1",
            "train.eval_interval=1000",
            "train.eval_batches=2",
            "optimizer.warmup_steps=2",
            "optimizer.lr=3e-3",
            f"train.output_dir={tmp_path}",
        ],
    )
    converted = hf_to_ms(tmp_path / "hf", tmp_path / "ours", seq_len=params.model.seq_len)
    check_model_agrees(params.model, json.loads((tmp_path / "hf" / "config.json").read_text()))
    trainer = Trainer(params, dataset_dir, tmp_path / "ckpt", steps=10, initial_weights=converted.path)
    trainer.resume("none")
    started = model_weights(trainer.model)
    assert all(np.array_equal(started[name], value) for name, value in read_weights(converted.path).items())
    result = trainer.run()
    assert abs(result.initial_loss - math.log(512)) < 0.5, result.initial_loss
    assert result.final_loss < result.initial_loss - 0.3
