"""The single-device Llama model, its attention kernel choice, loss, and document-boundary positions."""

from model_core.model.attention import Attention, fused_attention_available
from model_core.model.documents import document_positions
from model_core.model.llama import Llama, count_parameters
from model_core.model.loss import token_cross_entropy

__all__ = [
    "Attention",
    "Llama",
    "count_parameters",
    "document_positions",
    "fused_attention_available",
    "token_cross_entropy",
]
