"""Hugging Face <-> llmflow conversion: state-dict adapters per model family (llama built in), converted
checkpoints cached by content, export to a directory `transformers` loads, and a tokenizer comparison."""

from model_core.convert.checkpoint import (
    ConvertedCheckpoint,
    ExportedModel,
    check_model_agrees,
    convert_for_run,
    hf_to_ms,
    hf_to_ms_cached,
    locate_hf,
    ms_to_hf,
    read_converted,
)
from model_core.convert.errors import ConversionError
from model_core.convert.merge import merge_into_checkpoint
from model_core.convert.registry import (
    ModelFamily,
    RegistryError,
    family_for,
    isolated_registry,
    register,
    registered,
    unregister,
)
from model_core.convert.tokenizer_check import TokenizerReport, check_tokenizers, check_vocab

__all__ = [
    "ConversionError",
    "ConvertedCheckpoint",
    "ExportedModel",
    "ModelFamily",
    "RegistryError",
    "TokenizerReport",
    "check_model_agrees",
    "check_tokenizers",
    "check_vocab",
    "convert_for_run",
    "family_for",
    "hf_to_ms",
    "hf_to_ms_cached",
    "isolated_registry",
    "locate_hf",
    "merge_into_checkpoint",
    "ms_to_hf",
    "read_converted",
    "register",
    "registered",
    "unregister",
]
