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
from model_core.model.llama import Embedding


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
    replaces the single-device token loss (tensor parallelism passes its vocab-parallel one).

    The token embedding's gradient is taken by rows (`lookup`): the step looks the tokens up itself and
    differentiates with respect to the rows it looked up, so the backward never makes the lookup's gradient as a
    dense vocabulary x hidden tensor (nor, for a tied table, the sum of that and the head's). The rows are added into
    the table's buffer in place (`ops.scatter_add`), or, where a dense gradient must travel (ZeRO-2's
    reduce-scatter, an overlapped all-reduce), into the head's gradient (`dense_gradients`). This applies where the
    model looks its tokens up in a plain `Embedding` it trains; tensor parallelism's vocab-parallel table and
    ZeRO-3's gathered one keep their own backward."""

    def __init__(self, model: nn.Cell, buffers: ParameterTuple | None = None, loss: nn.Cell | None = None) -> None:
        super().__init__()
        self.loss = loss if loss is not None else SummedTokenLoss(model)
        self.weights = ParameterTuple(model.trainable_params())
        self.buffers = buffers if buffers is not None else ParameterTuple(
            Parameter(ops.zeros(w.shape, ms.float32), name=f"grad_accum.{w.name}", requires_grad=False)
            for w in self.weights
        )
        self.routed = bool(getattr(self.loss, "routed", False))  # returns (summed, routing statistics)
        self.lookup = looked_up_table(model, self.weights)
        # With the rows taken apart, an untied table's gradient is its rows' alone: it is not differentiated.
        self.tied = self.lookup >= 0 and bool(model.tie_embeddings)
        self.dense = tuple(i for i in range(len(self.weights)) if i != self.lookup or self.tied)
        self.slots = tuple(self.dense.index(i) if i in self.dense else -1 for i in range(len(self.weights)))
        self.value_and_grad = ops.value_and_grad(
            self.loss, 0 if self.lookup >= 0 else None, ParameterTuple(self.weights[i] for i in self.dense),
            has_aux=True,
        )
        self.add_order = backward_order(len(self.dense), self.slots[self.lookup] if self.tied else -1)

    def backward(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        """(the loss's outputs, the gradients of the weights in `dense`, the looked-up rows' gradient [B, T, hidden]
        or None) of one micro-batch."""
        if self.lookup < 0:
            outputs, grads = self.value_and_grad(tokens, labels, loss_mask, position_ids, segment_ids, scale,
                                                 router_noise)
            return outputs, grads, None
        rows = ops.gather(self.weights[self.lookup], tokens, 0)
        outputs, (rows_grad, grads) = self.value_and_grad(rows, labels, loss_mask, position_ids, segment_ids, scale,
                                                          router_noise)
        return outputs, grads, rows_grad

    def dense_gradients(self, tokens, grads, rows_grad, with_head=True):
        """Every weight's gradient, in weight order, from `backward`'s: the looked-up rows added into the table's
        (the tied head's, or zeros; zeros too without `with_head`, where the caller takes the head's apart), the one
        dense table gradient a collective can take."""
        if self.lookup < 0:
            return grads
        table = self.weights[self.lookup]
        if self.tied and with_head:
            head = grads[self.slots[self.lookup]]
        else:
            head = ops.zeros(table.shape, ms.float32)
        whole = ops.tensor_scatter_add(head.astype(ms.float32), tokens.expand_dims(-1), rows_grad.astype(ms.float32))
        out = ()
        for i in range(len(self.weights)):
            out = out + ((whole,) if i == self.lookup else (grads[self.slots[i]],))
        return out

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads, rows_grad = self.backward(tokens, labels, loss_mask, position_ids, segment_ids, scale,
                                                  router_noise)
        for j in self.add_order:
            i = self.dense[j]
            ops.assign_add(self.buffers[i], grads[j].astype(self.buffers[i].dtype))  # fp16 weights' into fp32
        if self.lookup >= 0:  # each looked-up row's gradient into its row, repeated tokens' one after another
            ops.scatter_add(self.buffers[self.lookup], tokens, rows_grad.astype(self.buffers[self.lookup].dtype))
        if self.routed:
            return outputs[1], outputs[2]
        return outputs[1]


def backward_order(count: int, head: int = -1) -> tuple[int, ...]:
    """The order in which to add `count` weights' gradients (positions in model order) into their buffers: the order
    the backward makes them, the last weight's first, and before all of them `head`'s, a tied table's gradient as the
    head (-1: none), which the backward makes first though its table is the first weight.

    The adds are side effects, so the compiled graph runs them one after another in program order, and a gradient
    is freed only once its own add has run: an add placed later than its gradient is made keeps that gradient alive
    through every add before it. Placed where its table's position puts it, last, a tied table's head gradient
    (vocabulary x hidden, fp32) would stay alive through the whole backward."""
    order = [j for j in range(count - 1, -1, -1) if j != head]
    return tuple([head, *order] if head >= 0 else order)


def rows_table(model: nn.Cell) -> Parameter | None:
    """The table whose gradient `AccumulateGradients` takes by rows: the one a model looks its tokens up in with a
    plain `Embedding` and trains; None where it has none (a later pipeline stage, a frozen table) or looks up
    another way (vocab-parallel, ZeRO-3)."""
    embedding = getattr(model, "embed_tokens", None)
    if type(embedding) is not Embedding or not getattr(model, "takes_tokens", False):
        return None
    return embedding.weight if embedding.weight.requires_grad else None


def looked_up_table(model: nn.Cell, weights: ParameterTuple) -> int:
    """The index in `weights` of `rows_table(model)`, -1 where there is none."""
    table = rows_table(model)
    return next((i for i, weight in enumerate(weights) if weight is table), -1) if table is not None else -1


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
    the next step.

    The zeroing is a compiled graph of its own (`ZeroGradients`). In the update's graph it would write buffers the
    update reads, and a graph copies every Load of a Parameter it writes later (TensorMove): each piece's update
    then read a copy of its whole buffer, a vocabulary table's gradient among them (benchmarks/README.md, "Model
    states against the ZeRO paper")."""

    def __init__(self, buffers: ParameterTuple, optimizer: nn.Cell) -> None:
        super().__init__()
        self.update = _Update(buffers, optimizer)
        self.zero = ZeroGradients(buffers)

    @property
    def optimizer(self) -> nn.Cell:
        return self.update.optimizer

    def construct(self, lr, step, grad_scale):
        self.update(lr, step, grad_scale)
        self.zero()
        return grad_scale


class _Update(nn.Cell):
    def __init__(self, buffers: ParameterTuple, optimizer: nn.Cell) -> None:
        super().__init__()
        self.buffers = buffers
        self.optimizer = optimizer

    @ms.jit
    def construct(self, lr, step, grad_scale):
        return self.optimizer(self.buffers, lr, step, grad_scale)


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
