"""LoRA (Hu et al., 2021), applied to a built Llama from outside: adapters, their files, and merging.

`apply_lora` replaces each targeted projection (`q_proj`, ..., `down_proj`) with a `LoraLinear` computing
    y = x W^T + (alpha / r) * B A dropout(x),   A [r, in] random, B [out, r] zeros
so a fresh adapter changes nothing. The `LoraLinear` holds the very same base `weight` Parameter under the
same attribute, so base paths (`layers.0.self_attn.q_proj.weight`) do not move and the adapters sit beside
it (`layers.0.self_attn.q_proj.lora_a`, `.lora_b`). Every other parameter is frozen (requires_grad=False),
so `AccumulateGradients(model)` trains only the adapters. Dropout acts in training mode only
(`model.set_train(True)`), read when a graph is compiled or a PyNative call runs.

Adapters are saved apart from the base (`adapters.safetensors` + `adapter_config.json`, which names the
sha256 of the base's model.safetensors, so they are never applied to another base). `merge_lora` folds
them into the base weights in place for inference and `unmerge_lora` restores the exact base
(`model_core.convert.merge` writes a merged copy of a checkpoint on disk).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import HeUniform, initializer

from model_core.model.fused import LinearFunction
from model_core.model.init import WeightInit, deferred, placeholder, shape_of
from model_core.model.llama import Linear
from model_core.storage import WEIGHTS, build_directory, file_sha256, read_safetensors, write_safetensors
from params.schema import LoraParams

TARGETS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
ADAPTERS, CONFIG = "adapters.safetensors", "adapter_config.json"
FORMAT_VERSION = 1
# Training state full fine-tuning keeps per parameter element and LoRA does not for a frozen one:
# the fp32 gradient buffer (AccumulateGradients) and AdamW's two fp32 moments.
STATE_BYTES_PER_FROZEN_ELEMENT = 4 + 4 + 4


class AdapterMismatchError(ValueError):
    """Adapters that do not belong to this base or this model; the message names both sides."""


class LoraLinear(nn.Cell):
    """A frozen `Linear` plus a trainable rank-r update: y = x W^T + (alpha / r) * (dropout(x) A^T) B^T.

    The frozen W needs no backward of its own: MindSpore drops the dW matmul of `LinearFunction`'s bprop
    when W is not differentiated, so a bprop that never computes dW would save nothing. Dropout is not free:
    its masks and dropped inputs are kept for the backward, and with adapters on all seven projections they
    outweigh the training state LoRA saves; a fused adapter with its own backward that kept only a bool mask
    peaked no lower, so it is not used (benchmarks/README.md, "Fine-tuning").

    A starts Kaiming-uniform (bound 1/sqrt(in)), B at zero. On a placeholder base (a model described inside
    `deferred_weights()` and made later) A and B are placeholders too: A's draw is keyed by its path like every
    other weight's, so any block of it is the same block of the single-process A.

    While merged, W holds W + (alpha/r) B A and B is zero, so the adapter adds exactly nothing in any graph,
    compiled before or after; the exact W and B are kept on the host until `unmerge`.
    """

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        out_features, in_features = shape_of(base.weight)
        self.weight = base.weight
        self.weight.requires_grad = False
        described = deferred(base.weight)
        if described is None:
            self.lora_a = Parameter(initializer(HeUniform(negative_slope=math.sqrt(5)), (rank, in_features), ms.float32))
            self.lora_b = Parameter(initializer("zeros", (out_features, rank), ms.float32))
        else:  # whole shapes for the draw, this rank's block shapes held
            whole_out, whole_in = described.shape
            self.lora_a = placeholder(WeightInit((rank, whole_in), "uniform", 1 / math.sqrt(whole_in)), (rank, in_features))
            self.lora_b = placeholder(WeightInit((whole_out, rank), "zeros"), (out_features, rank))
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        # One function per weight, so a layout can wrap each (ZeRO-3 gathers each weight where it is used).
        self.linear, self.linear_a, self.linear_b = LinearFunction(), LinearFunction(), LinearFunction()
        self.dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
        self.unmerged: tuple[np.ndarray, np.ndarray] | None = None  # exact (W, B) while merged

    def construct(self, x: Tensor) -> Tensor:
        update = self.linear_a(self.dropout(x), self.lora_a.astype(x.dtype)) * self.scale  # [..., r]
        return self.linear(x, self.weight.astype(x.dtype)) + self.linear_b(update, self.lora_b.astype(x.dtype))

    @property
    def merged(self) -> bool:
        return self.unmerged is not None

    def adapters(self) -> dict[str, np.ndarray]:
        """Copies of A and B (the real B, also while merged)."""
        lora_b = self.unmerged[1] if self.merged else self.lora_b.asnumpy()
        return {"lora_a": self.lora_a.asnumpy().copy(), "lora_b": lora_b.copy()}

    def merge(self) -> None:
        weight, lora_a, lora_b = (p.asnumpy().copy() for p in (self.weight, self.lora_a, self.lora_b))
        self.unmerged = (weight, lora_b)
        ops.assign(self.weight, Tensor(merged_weight(weight, lora_a, lora_b, self.scale)))
        ops.assign(self.lora_b, Tensor(np.zeros_like(lora_b)))

    def unmerge(self) -> None:
        weight, lora_b = self.unmerged
        ops.assign(self.weight, Tensor(weight))
        ops.assign(self.lora_b, Tensor(lora_b))
        self.unmerged = None


def merged_weight(weight: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, scale: float) -> np.ndarray:
    """W + scale * B A in fp32: the one merge rule, in memory and on disk."""
    update = lora_b.astype(np.float32) @ lora_a.astype(np.float32)
    return (weight.astype(np.float32) + np.float32(scale) * update).astype(np.float32)


# ------------------------------------------------------------------------------------------- applying


@dataclass(frozen=True)
class LoraSummary:
    """What `apply_lora` did. Counts are parameter elements; `saved_state_bytes` is the training state
    full fine-tuning would hold and LoRA does not: 12 bytes per frozen element (its fp32 gradient buffer
    and AdamW's two fp32 moments). The adapters' own 12 bytes per element (`trainable_parameters`) are not
    subtracted; weights and activations are not counted, both runs hold them."""

    adapted_modules: int
    trainable_parameters: int
    total_parameters: int
    trainable_share: float
    saved_state_bytes: int


def apply_lora(model: nn.Cell, lora: LoraParams, adapter: Callable[..., LoraLinear] | None = None) -> LoraSummary:
    """Wrap every `lora.target_modules` projection of every block the model holds in a `LoraLinear`; freeze the
    rest. `adapter(base, rank, alpha, dropout)` makes the wrapper instead, for projections a parallel layout has
    swapped (`model_core.parallel.tensor.tensor_parallel_adapter`).

    `lora.enabled` is the pipeline's switch for the fine-tune stage and is not read here.
    """
    adapted = 0
    for index, block in model.layers.name_cells().items():  # all blocks, or a pipeline stage's by their index
        for target in lora.target_modules:
            if block.is_moe and TARGETS[target].startswith("mlp."):
                continue  # an MoE block's experts are not adapted (`parallel.placement` places the same)
            parent_path, attribute = TARGETS[target].rsplit(".", 1)
            parent = getattr(block, parent_path)
            base = getattr(parent, attribute)
            path = f"layers.{index}.{TARGETS[target]}"
            if isinstance(base, LoraLinear):
                raise ValueError(f"{path} already has LoRA adapters; apply_lora runs once per model")
            if adapter is None and not isinstance(base, Linear):
                raise TypeError(f"{path} is a {type(base).__name__}; LoRA wraps model_core.model.llama.Linear only")
            make = adapter or LoraLinear
            setattr(parent, attribute, make(base, lora.rank, lora.alpha, lora.dropout))
            adapted += 1
    for path, param in model.parameters_and_names():
        param.requires_grad = path.endswith((".lora_a", ".lora_b"))
        # Attaching a cell renames its parameters to `q_proj.weight` etc., the same in every layer, so
        # anything keyed by Parameter.name would mix the layers up: every name goes back to its path.
        param.name = path
    return _summary(model, adapted)


def _summary(model: nn.Cell, adapted: int) -> LoraSummary:
    params = [param for _, param in model.parameters_and_names()]
    sizes = [(math.prod(shape_of(param)), param.requires_grad) for param in params]  # placeholders too
    return summary_of(adapted, sum(size for size, trainable in sizes if trainable), sum(size for size, _ in sizes))


def summary_of(adapted: int, trainable: int, total: int) -> LoraSummary:
    """The `LoraSummary` of `adapted` projections with `trainable` adapter elements in a model of `total`."""
    return LoraSummary(
        adapted_modules=adapted,
        trainable_parameters=trainable,
        total_parameters=total,
        trainable_share=trainable / total,
        saved_state_bytes=(total - trainable) * STATE_BYTES_PER_FROZEN_ELEMENT,
    )


def lora_layers(model: nn.Cell) -> dict[str, LoraLinear]:
    """Path (`layers.0.self_attn.q_proj`) -> LoraLinear, in model order."""
    return {path: cell for path, cell in model.cells_and_names() if isinstance(cell, LoraLinear)}


def adapter_weights(model: nn.Cell) -> dict[str, np.ndarray]:
    """`layers.0.self_attn.q_proj.lora_a` -> array, for every adapter of the model (the real B while merged)."""
    return {
        f"{path}.{name}": value for path, layer in lora_layers(model).items() for name, value in layer.adapters().items()
    }


def merge_lora(model: nn.Cell) -> None:
    """W += (alpha/r) B A in fp32 for every LoraLinear; the adapters then add nothing until `unmerge_lora`."""
    for path, layer in _layers_or_fail(model).items():
        if layer.merged:
            raise ValueError(f"{path} is already merged; unmerge_lora first")
        layer.merge()


def unmerge_lora(model: nn.Cell) -> None:
    """Put back the exact base weights and adapters that `merge_lora` replaced."""
    for path, layer in _layers_or_fail(model).items():
        if not layer.merged:
            raise ValueError(f"{path} is not merged; there is nothing to unmerge")
        layer.unmerge()


def _layers_or_fail(model: nn.Cell) -> dict[str, LoraLinear]:
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters; call apply_lora first")
    return layers


def _model_config(model: nn.Cell) -> dict:
    """rank, alpha and targets of the adapters a model carries, in the form adapter_config.json stores."""
    layers = _layers_or_fail(model)
    kinds = {suffix: kind for kind, suffix in TARGETS.items()}
    targets = {kinds[path.split(".", 2)[2]] for path in layers}
    first = next(iter(layers.values()))
    return {"rank": first.rank, "alpha": first.alpha, "target_modules": [t for t in TARGETS if t in targets]}


# ---------------------------------------------------------------------------------------------- files


def base_sha256(checkpoint_dir: str | Path) -> str:
    """sha256 of a checkpoint directory's model.safetensors: the identity adapters are tied to."""
    path = Path(checkpoint_dir) / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a base checkpoint directory holds {WEIGHTS}")
    return file_sha256(path)


def save_adapters(directory: str | Path, model: nn.Cell, lora: LoraParams, base_sha256: str) -> Path:
    """Write a whole model's adapters (`adapters.safetensors` + `adapter_config.json`) to `directory`."""
    config = _model_config(model)
    wanted = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": [t for t in TARGETS if t in lora.target_modules]}
    for key, value in wanted.items():
        if config[key] != value:
            raise AdapterMismatchError(f"lora.{key}={value} but the model's adapters have {key}={config[key]}")
    return write_adapters(directory, adapter_weights(model), lora, base_sha256, _summary(model, 0).total_parameters)


def write_adapters(
    directory: str | Path, weights: dict[str, np.ndarray], lora: LoraParams, base_sha256: str, total_parameters: int
) -> Path:
    """Write whole adapter tensors by path (`layers.0.self_attn.q_proj.lora_a`, ...), trained with `lora` on the
    base with `base_sha256`, to `directory` (replaced whole, atomically); `total_parameters` of the adapted model."""
    config = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": [t for t in TARGETS if t in lora.target_modules],
        "format_version": FORMAT_VERSION,
        "dropout": lora.dropout,
        "base_sha256": base_sha256,
        "adapted_modules": len(weights) // 2,  # an A and a B each
        "adapter_parameters": sum(value.size for value in weights.values()),
        "total_parameters": total_parameters,
    }

    def write(building: Path) -> None:
        write_safetensors(building / ADAPTERS, weights, "float32", metadata={"base_sha256": base_sha256})
        config["sha256"] = file_sha256(building / ADAPTERS)
        (building / CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    directory = Path(directory)
    build_directory(directory, write, replace=True)
    return directory


def read_adapters(directory: str | Path, base_sha256: str) -> tuple[dict[str, np.ndarray], dict]:
    """(adapter arrays, adapter_config) of a directory, refused unless made for the base with `base_sha256`."""
    directory = Path(directory)
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as error:
        raise AdapterMismatchError(f"{directory} holds no readable {CONFIG} ({error})") from error
    if config["base_sha256"] != base_sha256:
        raise AdapterMismatchError(
            f"adapters in {directory} were trained on the base with model.safetensors sha256 {config['base_sha256']}, "
            f"not this base ({base_sha256})"
        )
    if file_sha256(directory / ADAPTERS) != config["sha256"]:
        raise AdapterMismatchError(f"{directory / ADAPTERS} does not match its sha256 in {CONFIG}")
    return read_safetensors(directory / ADAPTERS), config


def load_adapters(model: nn.Cell, directory: str | Path, base_sha256: str) -> dict:
    """Set the adapters of a model (already through `apply_lora`) from `directory`; returns its config."""
    weights, config = read_adapters(directory, base_sha256)
    ours = _model_config(model)
    for key in ("rank", "alpha", "target_modules"):
        if config[key] != ours[key]:
            raise AdapterMismatchError(f"{directory / CONFIG} has {key}={config[key]} but the model's adapters have {key}={ours[key]}")
    layers = lora_layers(model)
    merged = [path for path, layer in layers.items() if layer.merged]
    if merged:
        raise ValueError(f"{merged[0]} is merged; unmerge_lora before loading other adapters")
    params = {f"{path}.{name}": getattr(layer, name) for path, layer in layers.items() for name in ("lora_a", "lora_b")}
    check_adapter_names(weights, params, directory / ADAPTERS)
    for name, param in params.items():
        if weights[name].shape != tuple(param.shape):
            raise AdapterMismatchError(f"{name}: {ADAPTERS} shape {weights[name].shape} != model shape {tuple(param.shape)}")
        ops.assign(param, Tensor(weights[name]))  # in place: set_data would detach compiled graphs
    return config


def check_adapter_names(found, expected, origin: Path) -> None:
    """`found` and `expected` (anything iterable over names) must hold the same names."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise AdapterMismatchError(f"{origin} does not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")

