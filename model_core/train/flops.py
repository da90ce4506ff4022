"""Model FLOPs per token, peak FLOP/s per device, and MFU: the one place these are defined.

Convention (PaLM, Chowdhery et al. 2022, appendix B): training FLOPs per token = 6N + 12 L H Q T.
- 6N: a forward and backward pass through N matmul parameters (2 FLOPs per multiply-add forward, 4 backward).
  N is the non-embedding parameters (attention q/k/v/o with grouped-query k/v, SwiGLU gate/up/down, norms)
  plus the LM head, which is a real [hidden x vocab] matmul whether or not it is tied to the embedding.
  The embedding lookup is a gather, not a matmul, and is excluded; `include_embeddings=True` counts it as if
  it were one, which makes N the total parameter count of an untied model (the "6 x parameters" rule).
  In a mixture-of-experts block N counts the active parameters only: the router [E x hidden], the k
  experts a token is sent to and a shared expert if any (Switch/Mixtral convention), not all E; the E/k-fold work a dropless
  static-shape dispatch spends on empty slots is not model FLOPs.
- 12 L H Q T: attention scores QK^T and the weighted sum AV over the full seq_len T, forward and backward,
  for L layers, H query heads of head dim Q. Like PaLM it does not halve for the causal mask, and it counts
  T even when attention resets at document boundaries.
These are model FLOPs: recomputation is not counted, so MFU does not reward it.
The count is per token and the same on every device; `mfu` takes tokens/s and peak FLOP/s of the same scope
(one device's tokens/s and one device's peak, or both summed over the world).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import time
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from params.schema import ModelParams

# Dense (no 2:4 sparsity) peak FLOP/s per device for bf16/fp16 matmuls, from the vendors' datasheets.
# NVIDIA quotes Hopper tensor-core figures with sparsity; dense is half of them.
_HALF_PRECISION_PEAK = {
    "a100": 312e12,  # NVIDIA A100 datasheet: BF16/FP16 Tensor Core 312 TFLOPS (SXM and PCIe)
    "h100-sxm": 1979e12 / 2,  # NVIDIA H100 datasheet, SXM: BF16/FP16 Tensor Core 1,979 TFLOPS with sparsity
    "h100-pcie": 1513e12 / 2,  # NVIDIA H100 datasheet, PCIe: 1,513 TFLOPS with sparsity
    "h200": 1979e12 / 2,  # NVIDIA H200 datasheet, SXM: BF16/FP16 Tensor Core 1,979 TFLOPS with sparsity
    "ascend-910": 256e12,  # Huawei Ascend 910 (Hot Chips 2019): FP16 256 TFLOPS
}
# Not listed, so their MFU is None: fp32 on GPUs (TF32 or not depends on backend settings, an 8x difference)
# and Ascend 910B, whose SKUs (910B1..B4) differ and have no published per-SKU vendor figure.
KNOWN_DEVICES = (*_HALF_PRECISION_PEAK, "cpu")
# nvidia-smi names of the listed GPUs. H100 NVL and H200 NVL have other peaks and are deliberately absent.
_NVIDIA_NAMES = {
    "NVIDIA A100-SXM4-40GB": "a100",
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100-PCIE-40GB": "a100",
    "NVIDIA A100 80GB PCIe": "a100",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
}


def non_embedding_parameters(model: ModelParams) -> int:
    """Parameters of the transformer blocks and the final norm: no embedding table, no LM head; MoE blocks
    count their active parameters (see the module docstring)."""
    hidden, kv_width = model.hidden_size, model.num_kv_heads * model.head_dim
    attention = 2 * hidden * hidden + 2 * hidden * kv_width  # q, o: [h, h]; k, v: [h, kv_heads * head_dim]
    mlp = 3 * hidden * model.ffn_hidden_size  # SwiGLU gate, up, down
    norms = 2 * hidden
    total = model.num_layers * (attention + mlp + norms) + hidden
    if model.moe is not None:  # an MoE block: the router and the k active experts in place of the dense MLP
        active = model.moe.num_experts * hidden + model.moe.experts_per_token * 3 * hidden * model.expert_ffn_hidden_size
        if model.moe.shared_expert_ffn_hidden_size is not None:
            active += 3 * hidden * model.moe.shared_expert_ffn_hidden_size + (hidden if model.moe.shared_expert_gate else 0)
        total += len(model.moe_layers) * (active - mlp)
    return total


def flops_per_token(model: ModelParams, include_embeddings: bool = False) -> float:
    """Training (forward + backward) model FLOPs per token: 6N + 12 L H Q T, as the module docstring defines."""
    vocab_matmul = model.vocab_size * model.hidden_size
    matmul_parameters = non_embedding_parameters(model) + vocab_matmul * (2 if include_embeddings else 1)
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * model.seq_len
    return float(6 * matmul_parameters + attention)


class Peak(NamedTuple):
    """The peak FLOP/s MFU divides by, and where it comes from: `measured` on this machine (the CPU's compiled fp32
    matmul, `measure_cpu_matmul_flops`) or a vendor's datasheet (`_HALF_PRECISION_PEAK`)."""

    flops: float
    measured: bool


def peak_flops(device: str, dtype: str) -> float | None:
    """Peak FLOP/s of one device for matmuls in `dtype`, or None when not known.

    `device` is one of KNOWN_DEVICES (case-insensitive). GPUs and NPUs are known for bfloat16/float16;
    "cpu" is known for float32 only, measured once per process (it takes a timed run of matmuls) by
    `measure_cpu_matmul_flops`.
    """
    device = device.lower()
    if device == "cpu":
        return _measured_cpu_peak() if dtype == "float32" else None
    if dtype in ("bfloat16", "float16"):
        return _HALF_PRECISION_PEAK.get(device)
    return None


def peak_flops_for_current_device(dtype: str) -> Peak | None:
    """`peak_flops` of the device MindSpore targets and whether it was measured: the CPU's measured matmul
    rate, a listed NVIDIA GPU's datasheet figure, else None."""
    target = ms.get_context("device_target")
    if target == "CPU":
        flops = peak_flops("cpu", dtype)
        return Peak(flops, measured=True) if flops is not None else None
    if target == "GPU" and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"]
        name = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
        device = _NVIDIA_NAMES.get(name)
        flops = peak_flops(device, dtype) if device else None
        return Peak(flops, measured=False) if flops is not None else None
    return None


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s; None when the peak is unknown."""
    if peak is None:
        return None
    return tokens_per_second * flops_per_token / peak


@ms.jit
def _matmul_corner(a: Tensor, b: Tensor) -> Tensor:
    # Returning one element makes the call wait for the product without copying 16 MB back.
    return ops.matmul(a, b)[:1, :1]


def measure_cpu_matmul_flops(seconds: float = 1.0, size: int = 2048) -> float:
    """FLOP/s of a [size x size] fp32 matmul compiled by MindSpore on this CPU: the best of repeated runs."""
    rng = np.random.default_rng(0)
    a, b = (Tensor(rng.standard_normal((size, size), dtype=np.float32)) for _ in range(2))
    _matmul_corner(a, b).asnumpy()  # compile and warm up
    best, deadline, runs = float("inf"), time.perf_counter() + seconds, 0
    while runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        _matmul_corner(a, b).asnumpy()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return 2.0 * size**3 / best


@functools.cache
def _measured_cpu_peak() -> float:
    return measure_cpu_matmul_flops()
