"""Mixed precision: which compute dtypes this backend can train in, and fp16's dynamic loss scale.

Master weights, optimizer state, norms, softmax and the loss are always fp32 (see model_core.model);
`compute_dtype` only changes the residual stream and the matmuls.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from params.schema import PrecisionParams

# Measured on MindSpore 2.10: the CPU MatMul, BatchMatMul, Softmax and Gather kernels reject bf16.
UNSUPPORTED = {("CPU", "bfloat16"): "MindSpore 2.10's CPU MatMul/BatchMatMul/Softmax kernels have no bfloat16"}


class PrecisionError(ValueError):
    """The requested precision cannot run on this backend."""


def check_precision(params: PrecisionParams, device_target: str) -> None:
    """Fail at start-up, with the reason and the alternatives, rather than at the first kernel."""
    reason = UNSUPPORTED.get((device_target, params.compute_dtype))
    if reason:
        raise PrecisionError(
            f"precision.compute_dtype={params.compute_dtype} cannot train on {device_target}: {reason}; "
            "use float32, or float16 with dynamic loss scaling"
        )


@dataclass
class LossScale:
    """Dynamic loss scaling for fp16: back off on overflow, grow after `window` clean steps.

    For fp32 and bf16 the scale is fixed at 1 and `update` only reports whether the step was finite.
    """

    scale: float
    factor: float
    window: int
    dynamic: bool
    clean_steps: int = 0

    @classmethod
    def from_params(cls, params: PrecisionParams) -> LossScale:
        if params.compute_dtype == "float16":
            return cls(params.initial_loss_scale, params.loss_scale_factor, params.loss_scale_window, dynamic=True)
        return cls(1.0, params.loss_scale_factor, params.loss_scale_window, dynamic=False)

    def update(self, finite: bool) -> None:
        """Record one step's outcome; the step itself is skipped by the caller when not finite."""
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / self.factor, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= self.factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
