"""AdamW with PyTorch's exact update, built on MindSpore's fused CPU Adam kernel, and global-norm gradient clipping.

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model_core.model.init import shape_of
from params.schema import OptimizerParams


def applies_weight_decay(parameter: Parameter) -> bool:
    """Decay weight matrices and embeddings (ndim >= 2), never norms or biases (1-D); a placeholder by the
    shape it stands for."""
    return len(shape_of(parameter)) >= 2


class AdamW(nn.Cell):
    """PyTorch-exact AdamW over `parameters`, updated in place; works in PyNative, jit and graph-mode Cells.

    Call it as `optimizer(grads, lr, step[, grad_scale])`: grads is a tuple in the order of `parameters`; lr, step
    and grad_scale (the loss scale's inverse times the clip factor) are scalar Tensors, so changing them never
    recompiles. With grad_scale the grads must be Parameters (the gradient buffers): each is scaled in place just
    before its own update, after the previous parameter's update has run, and holds the scaled values afterwards,
    so no scaled copy of the gradients is made (with `grad_slices`, the whole buffer is scaled and the slice cut).
    The call returns a Tensor that exists once every update is done, to order what must come after (zeroing the
    buffers: before the update has read them would lose the gradient). step is the bias-correction count t of
    this update, 1-based like torch's state["step"]: 1 on the first update, so schedule step s (0-based) updates with
    t = s + 1 (t = 0 divides by zero). The moments are Parameters named `adam_m.<name>` and
    `adam_v.<name>`, so saving this cell checkpoints them; `state_dict`/`load_state_dict` move them as numpy.
    Calling a graph-mode cell directly (not from inside another cell's construct) with a fresh grads tuple
    recompiles unless the tuple is wrapped in `ms.mutable`.

    With `working` (mixed precision), `parameters` are the fp32 master weights and `working[i]`, where not None,
    is the compute-dtype weight the model reads in place of parameter i: each is written, cast, right after its
    master is updated, so the model never holds an fp32 copy of it (`master_weights` reads the masters back).
    """

    def __init__(
        self,
        parameters: Sequence[Parameter],
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        names: Sequence[str] | None = None,
        working: Sequence[Parameter | None] | None = None,
    ):
        super().__init__()
        self.params = ParameterTuple(parameters)
        # Parameter.name changes as cells nest; state keys use the names as given here, fixed once.
        self.param_names = tuple(names) if names is not None else tuple(p.name for p in self.params)
        self.exp_avg = self.params.clone(prefix="adam_m", init="zeros")
        self.exp_avg_sq = self.params.clone(prefix="adam_v", init="zeros")
        self.decays = tuple(applies_weight_decay(p) for p in self.params)
        # (start, end) of the flattened gradient that updates parameter i, or None for the whole gradient (ZeRO-1
        # passes its full gradient buffers to an optimizer over its shard's pieces).
        self.grad_slices = (None,) * len(self.params)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self._beta1 = Tensor(self.beta1, ms.float32)
        self._beta2 = Tensor(self.beta2, ms.float32)
        self._fused_update = ops.Adam()
        working = list(working) if working is not None else [None] * len(self.params)
        self.working = ParameterTuple([w for w in working if w is not None])
        # For parameter i, the index of its working weight in `self.working`, or -1 where the model reads the master.
        self.writes = tuple(sum(w is not None for w in working[:i]) if working[i] is not None else -1
                            for i in range(len(working)))

    @classmethod
    def from_params(
        cls, parameters: Sequence[Parameter], optimizer: OptimizerParams, names: Sequence[str] | None = None,
        working: Sequence[Parameter | None] | None = None,
    ) -> AdamW:
        """The AdamW an `OptimizerParams` describes (lr and clipping are the caller's, per step)."""
        return cls(parameters, (optimizer.beta1, optimizer.beta2), optimizer.eps, optimizer.weight_decay, names, working)

    def construct(
        self, grads: tuple[Tensor, ...], lr: Tensor, step: Tensor, grad_scale: Tensor | None = None
    ) -> Tensor:
        t = step.astype(ms.float32)
        beta1_power = ops.pow(self._beta1, t)
        beta2_power = ops.pow(self._beta2, t)
        eps_t = self.eps * ops.sqrt(1.0 - beta2_power)
        keep = 1.0 - lr * self.weight_decay
        done = t
        for i in range(len(self.params)):
            grad = ops.depend(grads[i], done)
            if grad_scale is not None:
                # Scaled in place (the caller zeroes the buffer after the update anyway): the compiled graph then
                # keeps no scaled copy, which it would hold beside the buffer for as long as the graph lives. A
                # sliced gradient is scaled whole and then cut, so the graph keeps the cut piece only.
                grad = ops.assign(grads[i], grad * grad_scale)
            if self.grad_slices[i] is not None:
                start, end = self.grad_slices[i]
                grad = grad.reshape(-1)[start:end]
            if self.decays[i]:
                ops.assign(self.params[i], self.params[i] * keep)
            done = self._fused_update(
                self.params[i], self.exp_avg[i], self.exp_avg_sq[i],
                beta1_power, beta2_power, lr, self._beta1, self._beta2, eps_t, grad,
            )[0]
            j = self.writes[i]
            if j >= 0:
                done = ops.assign(self.working[j], ops.depend(self.params[i], done).astype(self.working[j].dtype))
        return ops.depend(t, done)

    def master_weights(self) -> dict[str, np.ndarray]:
        """Copies of the fp32 masters of the weights the model holds in the compute dtype, by name."""
        return {self.param_names[i]: self.params[i].asnumpy().copy() for i in range(len(self.params)) if self.writes[i] >= 0}

    def load_master_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Set the masters of compute-dtype weights from fp32 `weights` by name (the working weights are the
        caller's: `load_weights` casts them)."""
        for i in range(len(self.params)):
            if self.writes[i] >= 0:
                ops.assign(self.params[i], Tensor(np.asarray(weights[self.param_names[i]], dtype=np.float32)))

    def _moments(self) -> dict[str, Parameter]:
        return {
            **{f"adam_m.{name}": m for name, m in zip(self.param_names, self.exp_avg)},
            **{f"adam_v.{name}": v for name, v in zip(self.param_names, self.exp_avg_sq)},
        }

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the moments, keyed `adam_m.<name>` / `adam_v.<name>` by the parameter names given."""
        return {key: moment.asnumpy().copy() for key, moment in self._moments().items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Set every moment from `state`, which must hold exactly this optimizer's keys and shapes."""
        moments = self._moments()
        missing, unexpected = sorted(moments.keys() - state.keys()), sorted(state.keys() - moments.keys())
        if missing or unexpected:
            raise KeyError(f"optimizer state does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, moment in moments.items():
            value = np.asarray(state[name], dtype=np.float32)
            if value.shape != tuple(moment.shape):
                shape = tuple(moment.shape)
                raise ValueError(f"{name}: saved shape {value.shape} differs from the parameter's {shape}")
            ops.assign(moment, Tensor(value))  # in place: set_data would detach already-compiled graphs


def clip_by_global_norm(grads: tuple[Tensor, ...], max_norm: float) -> tuple[tuple[Tensor, ...], Tensor]:
    """Scale grads so their joint L2 norm is at most max_norm, as torch.nn.utils.clip_grad_norm_ does.

    Returns the scaled grads and the norm before clipping (inf or nan when a grad is not finite, which is
    how a caller detects a step to skip). Usable inside a graph-mode construct.
    """
    norm = ops.sqrt(ops.addn([ops.sum(ops.square(g.astype(ms.float32))) for g in grads]))
    scale = ops.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tuple([g * scale.astype(g.dtype) for g in grads]), norm
