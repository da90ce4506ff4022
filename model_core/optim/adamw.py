"""AdamW's arithmetic, PyTorch's exact update on MindSpore's fused CPU Adam kernel, and global-norm gradient clipping.

The update is torch.optim.AdamW's, bias correction included:
    p = p (1 - lr wd);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p - lr m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)
`ops.Adam` (one fused pass per parameter: m, v as above, p = p - lr_t m / (sqrt(v) + eps') with
lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)) does the moments and the step; passing eps' = eps sqrt(1 - b2^t) makes its
denominator torch's, which is exact algebra. The decoupled decay is a separate in-place multiply before it. This
pair is used rather than `ops.AdamWeightDecay`, which does both in one kernel, or the update written as ops and
`ops.assign`, because on the CPU both are several times slower (benchmarks/README.md, "AdamW kernels").

Weight decay applies to a parameter iff it has two or more dimensions (weight matrices, embeddings, LoRA
adapters); 1-D parameters, which are the norm weights and biases, are never decayed.

The optimizer that applies it, to whole weights on one device and to every parallel layout's shards, is
`model_core.parallel.optimizer.AdamW`.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, ops

from model_core.model.init import shape_of


def applies_weight_decay(parameter: Parameter) -> bool:
    """Decay weight matrices and embeddings (ndim >= 2), never norms or biases (1-D); a placeholder by the
    shape it stands for."""
    return len(shape_of(parameter)) >= 2


def adamw_scalars(beta1: Tensor, beta2: Tensor, eps: float, weight_decay: float, lr: Tensor, step: Tensor):
    """(t, beta1^t, beta2^t, eps', 1 - lr wd) of update number `step` (1-based, like torch's state["step"]: t = 0
    divides by zero): what `ops.Adam` takes besides a piece's values, with eps' = eps sqrt(1 - beta2^t) (see the
    module docstring), and the decay factor. Usable inside a compiled construct."""
    t = step.astype(ms.float32)
    beta1_power = ops.pow(beta1, t)
    beta2_power = ops.pow(beta2, t)
    eps_t = eps * ops.sqrt(1.0 - beta2_power)
    return t, beta1_power, beta2_power, eps_t, 1.0 - lr * weight_decay


def clip_by_global_norm(grads: tuple[Tensor, ...], max_norm: float) -> tuple[tuple[Tensor, ...], Tensor]:
    """Scale grads so their joint L2 norm is at most max_norm, as torch.nn.utils.clip_grad_norm_ does.

    Returns the scaled grads and the norm before clipping (inf or nan when a grad is not finite, which is
    how a caller detects a step to skip). Usable inside a graph-mode construct.
    """
    norm = ops.sqrt(ops.addn([ops.sum(ops.square(g.astype(ms.float32))) for g in grads]))
    scale = ops.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tuple([g * scale.astype(g.dtype) for g in grads]), norm
