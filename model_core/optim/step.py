"""The compiled pieces of one optimizer step: accumulate a micro-batch's gradients, measure their norm,
apply AdamW (or throw the gradients away).

Each piece is a `nn.Cell` whose construct is compiled with `ms.jit`, so the process stays in PyNative
mode (nothing global changes) while the heavy work runs as a graph. Inputs that change every step (the
learning rate, the step number, the gradient scale) are Tensors, so they never trigger a recompile.

Gradient accumulation is exact: the objective of a micro-batch is its *summed* token loss times
`scale = loss_scale / tokens_in_the_whole_step`, so k micro-batches add up to the gradient of the mean
loss over all their tokens, as one k-times-larger batch would.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn, ops

from model_core.model import token_cross_entropy
from model_core.model.fused import row_sum


class SummedTokenLoss(nn.Cell):
    """(summed token loss x scale, summed token loss) of one micro-batch; the first is differentiated.

    A model with mixture-of-experts blocks adds its routing losses to the objective, each weighted by its
    coefficient and by the micro-batch's counted tokens (so accumulation over micro-batches gives their
    token-weighted mean, like the token loss), and returns a third output, `routing_statistics`: [count x aux,
    count x z, dropped choices, tokens per expert of every MoE block (flattened)]. The second output stays
    the token loss alone, which is what the metrics call the loss. `router_noise`: the MoE blocks' router
    jitter (`model.moe.router_noise`), None for none."""

    def __init__(self, model: nn.Cell, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.routed = bool(getattr(model, "has_moe", False))
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef

    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        if self.routed:
            logits, routing = self.model.routed(tokens, position_ids, segment_ids, router_noise)
            mean, count = token_cross_entropy(logits, labels, loss_mask)
            summed = mean * count
            objective, statistics = routed_objective(summed, count, routing, self.aux_loss_coef, self.z_loss_coef)
            return objective * scale, summed, statistics
        logits = self.model(tokens, position_ids, segment_ids)
        mean, count = token_cross_entropy(logits, labels, loss_mask)
        summed = mean * count
        return summed * scale, summed


def routed_objective(summed, count, routing, aux_loss_coef: float, z_loss_coef: float):
    """(the objective: summed token loss + count x the weighted routing losses, the routing statistics) of a
    micro-batch whose model returned `routing` = (aux, z, load, dropped); see `SummedTokenLoss`."""
    weighted, statistics = routing_loss(count, routing, aux_loss_coef, z_loss_coef)
    return summed + weighted, statistics


def routing_loss(count, routing, aux_loss_coef: float, z_loss_coef: float):
    """(count x the weighted routing losses, the routing statistics) of `routing` = (aux, z, load, dropped): the
    part of `routed_objective` a pipeline stage adds for the MoE blocks it holds."""
    aux, z, load, dropped = routing
    weighted = count * (aux_loss_coef * aux + z_loss_coef * z)
    return weighted, mint.cat([ops.stack([count * aux, count * z, dropped]), load.reshape(-1)])


class AccumulateGradients(nn.Cell):
    """Forward + backward of one micro-batch, adding its gradients into fp32 buffers.

    `buffers` replaces the default one-per-weight full-size buffers (ZeRO-2 passes this rank's shard); `loss`
    replaces the single-device token loss (tensor parallelism passes its vocab-parallel one)."""

    def __init__(self, model: nn.Cell, buffers: ParameterTuple | None = None, loss: nn.Cell | None = None) -> None:
        super().__init__()
        self.loss = loss if loss is not None else SummedTokenLoss(model)
        self.weights = ParameterTuple(model.trainable_params())
        self.buffers = buffers if buffers is not None else ParameterTuple(
            Parameter(ops.zeros(w.shape, ms.float32), name=f"grad_accum.{w.name}", requires_grad=False)
            for w in self.weights
        )
        self.routed = bool(getattr(self.loss, "routed", False))  # returns (summed, routing statistics)
        self.value_and_grad = ops.value_and_grad(self.loss, None, self.weights, has_aux=True)

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads = self.value_and_grad(tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise)
        # Added last weight first, in the order the backward finishes the gradients: each add can then run as soon as
        # its gradient exists, which frees it, instead of the whole fresh set waiting for the embedding's, last.
        for i in range(len(grads) - 1, -1, -1):
            ops.assign_add(self.buffers[i], grads[i].astype(self.buffers[i].dtype))  # fp16 weights' into fp32
        if self.routed:
            return outputs[1], outputs[2]
        return outputs[1]


class GradientNorm(nn.Cell):
    """Global L2 norm of the accumulated gradients times `grad_scale` (1 / loss scale)."""

    def __init__(self, buffers: ParameterTuple) -> None:
        super().__init__()
        self.buffers = buffers

    @ms.jit
    def construct(self, grad_scale):
        total = ops.zeros((), ms.float32)
        for buffer in self.buffers:
            total = total + sum_of_squares(buffer)
        return mint.sqrt(total) * grad_scale


SQUARES_ROW = 1024  # elements of the rows a flat tensor is cut into before it is summed


def sum_of_squares(x):
    """sum(x * x) in two levels: row sums first, then their sum. The CPU kernel that reduces a whole tensor to a
    scalar is several times slower (benchmarks/README.md, "Sum of squares"), and a long fp32 sum loses digits with
    its length: a flat ZeRO shard summed as one row of 0.5M elements put the gradient norm 1e-5 off its float64
    value, so a flat tensor is cut into rows of `SQUARES_ROW` (and a short tail) first."""
    if x.ndim > 1 or x.shape[0] <= SQUARES_ROW:
        return mint.sum(row_sum(x * x))
    whole = x.shape[0] - x.shape[0] % SQUARES_ROW
    rows = x[:whole].reshape(-1, SQUARES_ROW) if whole < x.shape[0] else x.reshape(-1, SQUARES_ROW)
    total = mint.sum(row_sum(rows * rows))
    if whole < x.shape[0]:
        tail = x[whole:]
        total = total + mint.sum(tail * tail)
    return total


class ApplyGradients(nn.Cell):
    """optimizer(buffers, lr, step, grad_scale), which scales each buffer as it uses it, then zero the buffers for
    the next step."""

    def __init__(self, buffers: ParameterTuple, optimizer: nn.Cell) -> None:
        super().__init__()
        self.buffers = buffers
        self.optimizer = optimizer

    @ms.jit
    def construct(self, lr, step, grad_scale):
        done = self.optimizer(self.buffers, lr, step, grad_scale)
        zero_in_turn(self.buffers, done)
        return grad_scale


class ZeroGradients(nn.Cell):
    """Throw the accumulated gradients away (a skipped, non-finite step)."""

    def __init__(self, buffers: ParameterTuple) -> None:
        super().__init__()
        self.buffers = buffers

    @ms.jit
    def construct(self):
        zero_in_turn(self.buffers, ops.zeros((), ms.float32))
        return True


def zero_in_turn(buffers, after):
    """Zero every buffer, one after the other and after `after`: each zero tensor is made only once the previous
    buffer is written, so at most one is alive (made up front, they would add a whole gradient set to the peak)."""
    done = after
    for buffer in buffers:
        done = ops.assign(buffer, mint.zeros_like(ops.depend(buffer, done)))
    return done


def scalar(value: float) -> Tensor:
    return Tensor(value, ms.float32)
