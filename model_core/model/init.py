"""How the model's weights start: a random normal, or ones for norms, drawn per weight from (seed, path).

Each weight's initial values come from a generator keyed by the run's seed and the weight's path
(`layers.0.mlp.down_proj.weight`), never from a stream shared by the whole model, so any block of a weight can
be made on its own: a tensor-parallel rank draws the weight, keeps its block and drops the rest, and its block
equals the same block of the single-process initialisation bit for bit, whatever else that rank builds.

Inside `deferred_weights()` the model's cells get placeholders instead of weights: zero-element Parameters that
carry their `WeightInit`, so a 13B model is described without allocating it. Whoever builds the model then
replaces each placeholder that rank keeps with real values (`model_core.parallel.parallelize.build_shard`):
its block of the drawn values, or of the initial weights read from disk. Until then a layout may record on a
placeholder the shape this rank will hold of it (`held_shape`: a tensor-parallel block, a flat ZeRO-3 shard),
which is what cells built on top of it read through `shape_of`. Outside that context `new_weight` makes the
weight at once from MindSpore's own generator (`ms.set_seed`), as a plain single-device model does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor
from mindspore.common.initializer import Normal, initializer

_deferring = False


@dataclass(frozen=True)
class WeightInit:
    """A weight of `shape` drawn from N(0, scale^2) ("normal"), from U(-scale, scale) ("uniform", LoRA's A:
    Kaiming-uniform with bound 1/sqrt(in)), or all ones ("ones", norms) or zeros ("zeros", LoRA's B)."""

    shape: tuple[int, ...]
    kind: str
    scale: float = 1.0

    def values(self, seed: int, name: str) -> np.ndarray:
        """The whole weight's initial values for the run seeded `seed`, as fp32."""
        if self.kind in ("ones", "zeros"):
            return np.full(self.shape, 1.0 if self.kind == "ones" else 0.0, np.float32)
        key = hashlib.sha256(f"{seed}:{name}".encode()).digest()[:16]
        generator = np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))
        if self.kind == "uniform":
            values = generator.random(self.shape, dtype=np.float32) * np.float32(2 * self.scale) - np.float32(self.scale)
        else:
            values = generator.standard_normal(self.shape, dtype=np.float32) * np.float32(self.scale)
        return values


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Cells built inside get placeholder weights (see the module docstring)."""
    global _deferring
    previous, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = previous


def new_weight(shape: Sequence[int], std: float | None) -> Parameter:
    """A weight for a cell: drawn now, or a placeholder carrying its `WeightInit` inside `deferred_weights()`."""
    spec = WeightInit(tuple(shape), "ones") if std is None else WeightInit(tuple(shape), "normal", std)
    if _deferring:
        return placeholder(spec)
    return Parameter(initializer("ones" if std is None else Normal(std), spec.shape, ms.float32))


def placeholder(spec: WeightInit, held_shape: Sequence[int] | None = None) -> Parameter:
    """A zero-element Parameter standing for a weight made later from `spec`; `held_shape` is the shape this
    rank will hold of it (the whole shape unless given)."""
    parameter = Parameter(Tensor(np.zeros((0,), np.float32)))
    parameter.deferred = spec
    parameter.held_shape = tuple(spec.shape if held_shape is None else held_shape)
    return parameter


def deferred(parameter: Parameter) -> WeightInit | None:
    """The `WeightInit` a placeholder carries; None for a real weight."""
    return getattr(parameter, "deferred", None)


def shape_of(parameter: Parameter) -> tuple[int, ...]:
    """The shape of the weight as this rank holds it: a placeholder's `held_shape`, else the Parameter's own."""
    return tuple(parameter.held_shape) if deferred(parameter) is not None else tuple(parameter.shape)
