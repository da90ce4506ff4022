"""A model's weights by path, copied out and loaded in: the one mapping between a built model and a checkpoint.

A weight is a floating-point Parameter; the integer flags that communication groups keep as Parameters (read
at run time by collectives' fallbacks) are not weights and never reach a checkpoint.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.common.dtype import float_type as _FLOATING


class WeightMismatchError(ValueError):
    """Weights that do not fit a model; the message names the parameter and both shapes, or what is missing."""


def named_weights(model: nn.Cell) -> dict[str, ms.Parameter]:
    """The model's weights by their path (`layers.0.self_attn.q_proj.weight`), stable however cells nest."""
    return {name: param for name, param in model.parameters_and_names() if param.dtype in _FLOATING}


def model_weights(model: nn.Cell) -> dict[str, np.ndarray]:
    """Copies of the weights: on CPU `asnumpy()` shares the Parameter's buffer, which training updates in place."""
    return {name: param.asnumpy().copy() for name, param in named_weights(model).items()}


def load_weights(model: nn.Cell, weights: dict[str, np.ndarray]) -> None:
    """Set every weight of `model` from `weights` (by path); names and shapes must match exactly."""
    params = named_weights(model)
    missing, unexpected = set(params) - set(weights), set(weights) - set(params)
    if missing or unexpected:
        raise WeightMismatchError(f"weights do not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, param in params.items():
        if weights[name].shape != param.shape:
            raise WeightMismatchError(f"{name}: stored shape {weights[name].shape} != model shape {param.shape}")
        # In place (set_data would detach compiled graphs), cast to the weight's dtype (compute-dtype working weights).
        ops.assign(param, ms.Tensor(weights[name]).astype(param.dtype))
