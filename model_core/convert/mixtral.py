"""The mixtral family's state-dict adapter: Hugging Face `MixtralForCausalLM` <-> our `Llama` with a
mixture-of-experts block in every layer.

Embeddings, attention, norms and the head follow the llama family's tables and rules (model_core/convert/
llama.py). Each block's feed-forward is Mixtral's `block_sparse_moe`: its `gate` [E, hidden] is our router,
and expert e's `w1` (gate), `w3` (up) and `w2` (down), [out, in] like every torch Linear, are slice e of our
stacked `experts.gate_proj`, `experts.up_proj` and `experts.down_proj`. Routing is the same: softmax over the
router logits in fp32, top `num_experts_per_tok`, renormalised. Checkpoints are read and written in this
per-expert layout, the one Mixtral checkpoints ship in and `transformers` saves (it stacks the experts in
memory only).

Mixtral has an MoE block in every layer, no shared expert and no capacity limit; a model whose `model.moe`
leaves some blocks dense has no Mixtral form and is refused on export.
"""

from __future__ import annotations

import numpy as np

from model_core.convert import llama
from model_core.convert.errors import ConversionError
from model_core.storage import StorageError, round_to
from params.schema import ModelParams

ROUTER = ("layers.{i}.mlp.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight")
EXPERTS = {  # our stacked tensor -> Mixtral's per-expert weight
    "layers.{i}.mlp.experts.gate_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "layers.{i}.mlp.experts.up_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "layers.{i}.mlp.experts.down_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
}
DENSE_FFN = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# config.json keys of Mixtral features our model does not have -> the only value it converts.
FIXED_FEATURES = {"router_jitter_noise": 0.0, "sliding_window": None}


def params_from_config(config: dict, seq_len: int | None = None) -> ModelParams:
    """ModelParams of a Hugging Face Mixtral config: the llama fields plus `moe` in every block."""
    for key, supported in FIXED_FEATURES.items():
        if config.get(key, supported) not in (supported, 0):
            raise ConversionError(f"config.json {key}={config[key]!r} is not supported (our model has {key}={supported!r})")
    for key in ("num_local_experts", "num_experts_per_tok"):
        if config.get(key) is None:
            raise ConversionError(f"config.json has no {key} (needed for model.moe)")
    dense = llama.params_from_config(config, seq_len)
    moe = {"num_experts": config["num_local_experts"], "experts_per_token": config["num_experts_per_tok"]}
    return llama._model_params({**dense.model_dump(), "moe": moe})


def hf_config(params: ModelParams, vocab_size: int | None = None) -> dict:
    """config.json of a Hugging Face MixtralForCausalLM with these params (and the real `vocab_size`)."""
    check_exportable(params)
    config = llama.hf_config(params, vocab_size)
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
        config.pop(key, None)
    config.update({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": params.moe.num_experts,
        "num_experts_per_tok": params.moe.experts_per_token,
        "router_aux_loss_coef": params.moe.aux_loss_coef,
        "output_router_logits": False,
        **FIXED_FEATURES,
    })
    return config


def check_exportable(params: ModelParams) -> None:
    """Mixtral's form: an MoE block in every layer, renormalised top-k, experts as wide as intermediate_size."""
    if params.moe is None or params.moe_layers != tuple(range(params.num_layers)):
        raise ConversionError(
            f"Mixtral has a mixture-of-experts block in every layer; model.moe gives them in blocks "
            f"{list(params.moe_layers)} of model.num_layers={params.num_layers}"
        )
    if params.moe.gating != "softmax":
        raise ConversionError(f"Mixtral's router is a softmax over the experts; model.moe.gating={params.moe.gating}")
    if not params.moe.normalize_top_k or params.expert_ffn_hidden_size != params.ffn_hidden_size:
        raise ConversionError(
            "Mixtral renormalises the top-k router probabilities and its experts are ffn_hidden_size wide: "
            f"model.moe.normalize_top_k={params.moe.normalize_top_k}, "
            f"expert_ffn_hidden_size={params.expert_ffn_hidden_size}, ffn_hidden_size={params.ffn_hidden_size}"
        )


def tensor_names(params: ModelParams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our name -> (Hugging Face name, shape) of the tensors that map one to one (all but the experts)."""
    names = {
        ours: named for ours, named in llama.tensor_names(params).items()
        if not ours.endswith(tuple(f"{path}.weight" for path in DENSE_FFN))
    }
    for i in range(params.num_layers):
        names[ROUTER[0].format(i=i)] = (ROUTER[1].format(i=i), (params.moe.num_experts, params.hidden_size))
    return names


def expert_names(params: ModelParams) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """Our stacked expert tensor -> (Mixtral's per-expert names in expert order, the shape of each)."""
    hidden, inner = params.hidden_size, params.expert_ffn_hidden_size
    shapes = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
    return {
        ours.format(i=i): ([theirs.format(i=i, e=e) for e in range(params.moe.num_experts)], shapes[ours.rsplit(".", 1)[1]])
        for i in range(params.num_layers)
        for ours, theirs in EXPERTS.items()
    }


def from_hf(
    hf_state: dict[str, np.ndarray],
    config: dict,
    dtype: str = "float32",
    tensor_parallel: int = 1,
    seq_len: int | None = None,
) -> tuple[dict[str, np.ndarray], ModelParams]:
    """Our weights (fp32 arrays rounded to `dtype`) and ModelParams; the vocabulary padded as llama's."""
    params = params_from_config(config, seq_len)
    state = dict(hf_state)
    if params.tie_embeddings and "lm_head.weight" in state:
        llama._check_tied_head(state.pop("lm_head.weight"), state.get("model.embed_tokens.weight"))
    plain, experts = tensor_names(params), expert_names(params)
    expected = {theirs: shape for theirs, shape in plain.values()}
    expected.update({name: shape for names, shape in experts.values() for name in names})
    llama._check_names(state, expected, "the checkpoint", "config.json", params)
    try:
        weights = {ours: round_to(state[theirs], dtype, theirs) for ours, (theirs, _) in plain.items()}
        for ours, (names, _) in experts.items():
            weights[ours] = np.stack([round_to(state[name], dtype, name) for name in names])
    except StorageError as error:
        raise ConversionError(str(error)) from error
    return llama.pad_vocabulary(weights, params, tensor_parallel)


def to_hf(
    weights: dict[str, np.ndarray], params: ModelParams, vocab_size: int | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    """Hugging Face state dict (experts one tensor each) and config.json; padding rows dropped."""
    check_exportable(params)
    real_vocab = params.unpadded_vocab_size if vocab_size is None else vocab_size
    if real_vocab > params.vocab_size:
        raise ConversionError(f"real vocab_size={real_vocab} exceeds model.vocab_size={params.vocab_size}")
    plain, experts = tensor_names(params), expert_names(params)
    expected = {ours: shape for ours, (_, shape) in plain.items()}
    expected.update({ours: (params.moe.num_experts, *shape) for ours, (_, shape) in experts.items()})
    llama._check_names(weights, expected, "our checkpoint", "params", params)
    hf_state = {
        theirs: weights[ours][:real_vocab] if ours in llama.VOCAB_ROWS else weights[ours]
        for ours, (theirs, _) in plain.items()
    }
    for ours, (names, _) in experts.items():
        hf_state.update({name: weights[ours][e] for e, name in enumerate(names)})
    return hf_state, hf_config(params, real_vocab)
