"""The llama family's state-dict adapter: Hugging Face `LlamaForCausalLM` <-> our `Llama`.

`TENSORS` names every tensor once: our name, the Hugging Face name, and the shape both have, computed
from the params. `CONFIG_KEYS` maps every ModelParams field to its config.json key. Both directions
use these two tables. The rules that hold for every tensor, written once:

- Layout: our Linear weights are [out, in] like torch.nn.Linear, so nothing is transposed. Every shape
  is checked against the config, which catches a transposed (non-square) matrix.
- Rotary: ours is the rotate-half layout of Hugging Face's Llama, so q/k rows are not permuted (the
  permutation in Hugging Face's own convert script maps Meta's interleaved layout to rotate-half; an
  HF-format checkpoint is already rotate-half). The logit parity tests check it.
- GQA: k/v_proj have num_kv_heads * head_dim rows, and query head h reads kv head
  h // (num_heads / num_kv_heads) in both implementations, so GQA weights need no change.
- Tied embeddings (`tie_word_embeddings`): we have no lm_head. A torch state dict still carries
  `lm_head.weight` (the same tensor); it is accepted only if equal to the embedding.
- Vocab padding: the embedding and lm_head get zero rows up to a multiple of `tensor_parallel`, so the
  vocabulary splits evenly across ranks; `to_hf` drops them again given the real vocab size.
- `rotary_emb.inv_freq` buffers in older checkpoints are derived from rope_theta and ignored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np
from pydantic import ValidationError

from model_core.convert.errors import ConversionError
from model_core.storage import StorageError, round_to
from params.schema import ModelParams

Shape = Callable[[ModelParams], tuple[int, ...]]


def _hidden(p: ModelParams) -> tuple[int, ...]:
    return (p.hidden_size,)


# Our name -> (Hugging Face name, shape of both). `{i}` is the layer index.
TENSORS: dict[str, tuple[str, Shape]] = {
    "embed_tokens.weight": ("model.embed_tokens.weight", lambda p: (p.vocab_size, p.hidden_size)),
    "layers.{i}.input_layernorm.weight": ("model.layers.{i}.input_layernorm.weight", _hidden),
    "layers.{i}.self_attn.q_proj.weight": (
        "model.layers.{i}.self_attn.q_proj.weight",
        lambda p: (p.num_heads * p.head_dim, p.hidden_size),
    ),
    "layers.{i}.self_attn.k_proj.weight": (
        "model.layers.{i}.self_attn.k_proj.weight",
        lambda p: (p.num_kv_heads * p.head_dim, p.hidden_size),
    ),
    "layers.{i}.self_attn.v_proj.weight": (
        "model.layers.{i}.self_attn.v_proj.weight",
        lambda p: (p.num_kv_heads * p.head_dim, p.hidden_size),
    ),
    "layers.{i}.self_attn.o_proj.weight": (
        "model.layers.{i}.self_attn.o_proj.weight",
        lambda p: (p.hidden_size, p.num_heads * p.head_dim),
    ),
    "layers.{i}.post_attention_layernorm.weight": ("model.layers.{i}.post_attention_layernorm.weight", _hidden),
    "layers.{i}.mlp.gate_proj.weight": (
        "model.layers.{i}.mlp.gate_proj.weight",
        lambda p: (p.ffn_hidden_size, p.hidden_size),
    ),
    "layers.{i}.mlp.up_proj.weight": (
        "model.layers.{i}.mlp.up_proj.weight",
        lambda p: (p.ffn_hidden_size, p.hidden_size),
    ),
    "layers.{i}.mlp.down_proj.weight": (
        "model.layers.{i}.mlp.down_proj.weight",
        lambda p: (p.hidden_size, p.ffn_hidden_size),
    ),
    "norm.weight": ("model.norm.weight", _hidden),
    "lm_head.weight": ("lm_head.weight", lambda p: (p.vocab_size, p.hidden_size)),  # absent when tied
}
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")  # the tensors with one row per token
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# ModelParams field -> (config.json key, value when the key is absent; None: required).
CONFIG_KEYS: dict[str, tuple[str, object]] = {
    "vocab_size": ("vocab_size", None),
    "hidden_size": ("hidden_size", None),
    "num_layers": ("num_hidden_layers", None),
    "num_heads": ("num_attention_heads", None),
    "num_kv_heads": ("num_key_value_heads", None),  # absent in plain-MHA configs: num_attention_heads
    "ffn_hidden_size": ("intermediate_size", None),
    "seq_len": ("max_position_embeddings", None),
    "rope_theta": ("rope_theta", 10_000.0),  # transformers >= 5 nests it in rope_parameters
    "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_embeddings": ("tie_word_embeddings", False),
    "init_std": ("initializer_range", 0.02),
}
# config.json keys of features our Llama does not have -> the only value it can convert.
FIXED_FEATURES: dict[str, object] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
}


def tensor_names(params: ModelParams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our name -> (Hugging Face name, shape) for every tensor of a model with these params."""
    names = {}
    for ours, (theirs, shape) in TENSORS.items():
        if ours == "lm_head.weight" and params.tie_embeddings:
            continue
        layers = range(params.num_layers) if "{i}" in ours else [None]
        for i in layers:
            names[ours.format(i=i)] = (theirs.format(i=i), shape(params))
    return names


def params_from_config(config: dict, seq_len: int | None = None) -> ModelParams:
    """ModelParams of a Hugging Face Llama config (its real vocab size); `seq_len` may shorten the context."""
    _check_features(config)
    flat = {**config, "rope_theta": _rope_theta(config)}
    flat.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    values = {}
    for field, (key, default) in CONFIG_KEYS.items():
        if flat.get(key) is None and default is None:
            raise ConversionError(f"config.json has no {key} (needed for model.{field})")
        values[field] = flat[key] if flat.get(key) is not None else default
    if seq_len is not None:
        if seq_len > values["seq_len"]:
            raise ConversionError(
                f"model.seq_len={seq_len} is longer than config.json max_position_embeddings={values['seq_len']}"
            )
        values["seq_len"] = seq_len
    params = _model_params(values)
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != params.head_dim:
        raise ConversionError(
            f"config.json head_dim={head_dim} differs from hidden_size / num_attention_heads = {params.head_dim}"
        )
    return params


def hf_config(params: ModelParams, vocab_size: int | None = None) -> dict:
    """config.json of a Hugging Face LlamaForCausalLM with these params (and the real `vocab_size`)."""
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    values = params.model_dump()
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
    config.update({key: values[field] for field, (key, _) in CONFIG_KEYS.items()})
    config.update({"head_dim": params.head_dim, **FIXED_FEATURES, "attention_dropout": 0.0, "pretraining_tp": 1})
    return config


def from_hf(
    hf_state: dict[str, np.ndarray],
    config: dict,
    dtype: str = "float32",
    tensor_parallel: int = 1,
    seq_len: int | None = None,
) -> tuple[dict[str, np.ndarray], ModelParams]:
    """Our weights (fp32 arrays rounded to `dtype`) and ModelParams, vocab padded to a multiple of tensor_parallel."""
    params = params_from_config(config, seq_len)
    state = dict(hf_state)
    if params.tie_embeddings and "lm_head.weight" in state:
        _check_tied_head(state.pop("lm_head.weight"), state.get("model.embed_tokens.weight"))
    expected = tensor_names(params)
    _check_names(state, {theirs: shape for theirs, shape in expected.values()}, "the checkpoint", "config.json", params)
    try:
        weights = {ours: round_to(state[theirs], dtype, theirs) for ours, (theirs, _) in expected.items()}
    except StorageError as error:  # a value the chosen dtype cannot hold
        raise ConversionError(str(error)) from error
    return pad_vocabulary(weights, params, tensor_parallel)


def pad_vocabulary(
    weights: dict[str, np.ndarray], params: ModelParams, tensor_parallel: int
) -> tuple[dict[str, np.ndarray], ModelParams]:
    """The embedding and head with zero rows up to a multiple of tensor_parallel, and params saying so."""
    padded = math.ceil(params.vocab_size / tensor_parallel) * tensor_parallel
    for name in VOCAB_ROWS:
        if name in weights:
            weights[name] = np.pad(weights[name], ((0, padded - params.vocab_size), (0, 0)))
    return weights, _model_params({**params.model_dump(), "vocab_size": padded, "vocab_padding": padded - params.vocab_size})


def to_hf(
    weights: dict[str, np.ndarray], params: ModelParams, vocab_size: int | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    """Hugging Face state dict and config.json; padded vocab rows beyond the real `vocab_size` are dropped."""
    real_vocab = params.unpadded_vocab_size if vocab_size is None else vocab_size
    if real_vocab > params.vocab_size:
        raise ConversionError(f"real vocab_size={real_vocab} exceeds model.vocab_size={params.vocab_size}")
    expected = tensor_names(params)
    _check_names(weights, {ours: shape for ours, (_, shape) in expected.items()}, "our checkpoint", "params", params)
    hf_state = {
        theirs: weights[ours][:real_vocab] if ours in VOCAB_ROWS else weights[ours]
        for ours, (theirs, _) in expected.items()
    }
    return hf_state, hf_config(params, real_vocab)


def _check_names(
    state: dict[str, np.ndarray],
    expected: dict[str, tuple[int, ...]],
    found_in: str,
    described_by: str,
    params: ModelParams,
) -> None:
    unexpected = sorted(name for name in state if name not in expected and not IGNORED.fullmatch(name))
    if unexpected:
        shown = ", ".join(f"{name} {tuple(state[name].shape)}" for name in unexpected[:5])
        raise ConversionError(
            f"unexpected tensor(s) in {found_in}: {shown}{' ...' if len(unexpected) > 5 else ''}; "
            f"{described_by} describes a llama with num_layers={params.num_layers}, "
            f"tie_embeddings={params.tie_embeddings}"
        )
    for name, shape in expected.items():
        if name not in state:
            raise ConversionError(
                f"tensor {name} (shape {shape} expected from {described_by}) is missing from {found_in}"
            )
        actual = tuple(state[name].shape)
        if actual != shape:
            hint = f"; vocab_size={params.vocab_size} in {described_by}" if name.endswith(VOCAB_ROWS) else ""
            raise ConversionError(f"{name}: shape {actual} in {found_in}, {shape} expected from {described_by}{hint}")


def _check_tied_head(head: np.ndarray, embedding: np.ndarray | None) -> None:
    if embedding is not None and (head.shape != embedding.shape or not np.array_equal(head, embedding)):
        raise ConversionError(
            f"config.json has tie_word_embeddings=true but lm_head.weight {tuple(head.shape)} differs from "
            f"model.embed_tokens.weight {tuple(embedding.shape)}"
        )


def _check_features(config: dict) -> None:
    for key, supported in FIXED_FEATURES.items():
        if config.get(key, supported) != supported:
            raise ConversionError(
                f"config.json {key}={config[key]!r} is not supported (our Llama has {key}={supported!r})"
            )
    rope_type = (config.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ConversionError(
            f"config.json rope_parameters.rope_type={rope_type!r} is not supported (our Llama has 'default')"
        )


def _rope_theta(config: dict) -> object:
    return config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")


def _model_params(values: dict) -> ModelParams:
    try:
        return ModelParams(**values)
    except ValidationError as error:
        raise ConversionError(f"config.json does not describe a valid model: {error}") from error
