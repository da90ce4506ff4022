"""The MFU convention: FLOPs per token against Llama-2-7B's known size, the peak table and CPU calibration."""

from __future__ import annotations

import math

import pytest

from model_core.train import flops
from model_core.train.flops import (
    flops_per_token,
    measure_cpu_matmul_flops,
    mfu,
    non_embedding_parameters,
    peak_flops,
)
from params.schema import ModelParams

LLAMA2_7B = ModelParams(
    vocab_size=32000,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    ffn_hidden_size=11008,
    seq_len=4096,
    tie_embeddings=False,
)
LLAMA2_7B_PARAMETERS = 6_738_415_616  # LlamaForCausalLM("meta-llama/Llama-2-7b-hf").num_parameters()
ATTENTION_7B = 12 * 32 * 32 * 128 * 4096


def test_llama2_7b_counts_its_parameters():
    embedding_and_head = 2 * 32000 * 4096
    assert non_embedding_parameters(LLAMA2_7B) == LLAMA2_7B_PARAMETERS - embedding_and_head
    assert flops_per_token(LLAMA2_7B, include_embeddings=True) == 6 * LLAMA2_7B_PARAMETERS + ATTENTION_7B
    matmul_parameters = (flops_per_token(LLAMA2_7B) - ATTENTION_7B) / 6
    assert matmul_parameters == pytest.approx(6.74e9, rel=0.02)


def test_the_lm_head_counts_whether_tied_or_not():
    tied = LLAMA2_7B.model_copy(update={"tie_embeddings": True})
    assert flops_per_token(tied) == flops_per_token(LLAMA2_7B)


def test_grouped_query_attention_shrinks_only_the_kv_projections():
    gqa = LLAMA2_7B.model_copy(update={"num_kv_heads": 8})
    saved = 32 * 2 * 4096 * (32 - 8) * 128
    assert non_embedding_parameters(LLAMA2_7B) - non_embedding_parameters(gqa) == saved
    assert flops_per_token(LLAMA2_7B) - flops_per_token(gqa) == 6 * saved


def test_peak_table_knows_listed_devices_and_nothing_else():
    assert peak_flops("H100-SXM", "bfloat16") == pytest.approx(989.5e12)
    assert peak_flops("a100", "float16") == 312e12
    assert peak_flops("h200", "float32") is None
    assert peak_flops("ascend-910b", "bfloat16") is None
    assert peak_flops("tpu-v9", "bfloat16") is None
    assert peak_flops("cpu", "bfloat16") is None


def test_cpu_calibration_is_a_sane_rate():
    rate = measure_cpu_matmul_flops(seconds=0.2, size=1024)
    assert math.isfinite(rate) and 1e8 < rate < 1e13


def test_mfu_is_achieved_over_peak_and_none_without_a_peak():
    assert mfu(1000.0, 6e8, 1.2e12) == pytest.approx(0.5)
    assert mfu(1000.0, 6e8, None) is None


def test_this_machine_is_a_measured_cpu(monkeypatch):
    monkeypatch.setattr(flops, "_measured_cpu_peak", lambda: 3e11)
    assert flops.peak_flops_for_current_device("float32") == flops.Peak(3e11, measured=True)
    assert flops.peak_flops_for_current_device("bfloat16") is None
