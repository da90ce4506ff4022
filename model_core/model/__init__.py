"""The single-device Llama model, its attention kernel choice, loss, document-boundary positions, and LoRA."""

from model_core.model.attention import Attention, fused_attention_available
from model_core.model.documents import document_positions
from model_core.model.llama import Llama, count_parameters
from model_core.model.lora import (
    AdapterMismatchError,
    LoraLinear,
    LoraSummary,
    adapter_weights,
    apply_lora,
    base_sha256,
    load_adapters,
    merge_lora,
    save_adapters,
    unmerge_lora,
)
from model_core.model.loss import counted_tokens, token_cross_entropy

__all__ = [
    "AdapterMismatchError",
    "Attention",
    "Llama",
    "LoraLinear",
    "LoraSummary",
    "adapter_weights",
    "apply_lora",
    "base_sha256",
    "count_parameters",
    "counted_tokens",
    "document_positions",
    "fused_attention_available",
    "load_adapters",
    "merge_lora",
    "save_adapters",
    "token_cross_entropy",
    "unmerge_lora",
]
