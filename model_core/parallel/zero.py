"""ZeRO stages 1 and 2: AdamW moments (1) and gradients too (2) sharded over the data-parallel group.

All parameters, flattened and concatenated in order, are cut into `dp` equal shards (the last one padded).
A rank keeps Adam moments only for its shard, which falls into pieces, one per parameter it touches. A step
copies its pieces of the parameters, updates them with the gradient's matching pieces through the same fused
AdamW as unsharded training, and all-gathers the updated shards into every parameter. The arithmetic is
element-wise, so the result is the unsharded update, bit for bit up to the gradient sum. `state_dict`/
`load_state_dict` speak the unsharded format (full moments keyed by parameter path), so checkpoints stay
independent of the layout; `state_dict` is a collective: every rank calls it.

ZeRO-1 sums the full gradients over the group once per step and lets each rank slice its pieces out.
ZeRO-2 keeps no full gradient buffer: each micro-batch's gradients, flattened the same way, are
reduce-scattered over the group at once and only this rank's shard is added into shard-sized buffers, one
per piece (`GradientShards`, which pipeline stages use too); the gradient norm sums the shards' squares over
the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model_core.optim.adamw import AdamW, applies_weight_decay
from model_core.optim.step import AccumulateGradients
from model_core.parallel.comm import Group
from params.schema import OptimizerParams


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `index`, flattened: part of one rank's shard."""

    index: int
    start: int
    end: int


def shard_pieces(sizes: Sequence[int], shards: int, shard: int, length: int | None = None) -> tuple[list[Piece], int]:
    """The pieces of shard `shard` of `shards` over parameters of these sizes, and the shard length: the
    flat parameters split evenly, or into shards of `length` (at least that even split) when given."""
    total = sum(sizes)
    length = max(-(-total // shards), length or 0)
    first, last = shard * length, min(total, (shard + 1) * length)
    pieces, offset = [], 0
    for index, size in enumerate(sizes):
        start, end = max(first, offset), min(last, offset + size)
        if start < end:
            pieces.append(Piece(index, start - offset, end - offset))
        offset += size
    return pieces, length


class ShardedAdamW(nn.Cell):
    """AdamW over `parameters` with this rank's 1/dp of the moments; called like AdamW: (grads, lr, step).

    grads are one full gradient per parameter, or with `sharded_gradients` (ZeRO-2) one per piece of this
    rank's shard, in the order of `ShardedAccumulateGradients.buffers`."""

    def __init__(
        self,
        parameters: Sequence[Parameter],
        optimizer: OptimizerParams,
        names: Sequence[str],
        group: Group,
        sharded_gradients: bool = False,
        shard_length: int | None = None,
    ) -> None:
        """`shard_length` as for `shard_pieces` (ZeRO-2 passes its gradient shards' length)."""
        super().__init__()
        self.params = ParameterTuple(parameters)
        self.param_names = tuple(names)
        self.group = group
        self.sharded_gradients = sharded_gradients
        self.shapes = tuple(tuple(p.shape) for p in parameters)
        self.sizes = tuple(int(np.prod(shape)) for shape in self.shapes)
        pieces, self.shard_length = shard_pieces(self.sizes, group.size, group.index, shard_length)
        if not pieces:
            raise ValueError(f"{sum(self.sizes)} parameters are too few to shard over {group.size} ranks")
        self.pieces = tuple((p.index, p.start, p.end) for p in pieces)
        self.padding = self.shard_length - sum(end - start for _, start, end in self.pieces)
        copies = [
            Parameter(ops.zeros((end - start,), ms.float32), name=f"zero1.{names[i]}.{start}", requires_grad=False)
            for i, start, end in self.pieces
        ]
        self.inner = AdamW.from_params(copies, optimizer, [f"{names[i]}[{start}:{end}]" for i, start, end in self.pieces])
        # The pieces are flat; decay follows the parameter they come from (matrices yes, norms no).
        self.inner.decays = tuple(applies_weight_decay(parameters[i]) for i, _, _ in self.pieces)

    def construct(self, grads, lr, step):
        for k, (i, start, end) in enumerate(self.pieces):
            ops.assign(self.inner.params[k], self.params[i].reshape(-1)[start:end])
        if not self.sharded_gradients:
            grads = tuple(grads[i].reshape(-1)[start:end] for i, start, end in self.pieces)
        self.inner(grads, lr, step)
        full = self.group.all_gather(self._padded([self.inner.params[k] for k in range(len(self.pieces))]))
        offset = 0
        for i in range(len(self.params)):
            ops.assign(self.params[i], full[offset : offset + self.sizes[i]].reshape(self.shapes[i]))
            offset += self.sizes[i]

    def _padded(self, parts):
        if self.padding:
            parts = parts + [ops.zeros((self.padding,), ms.float32)]
        return ops.cat(parts)

    def moment_bytes(self) -> int:
        return moment_bytes(self.inner)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full moments keyed `adam_m.<name>` / `adam_v.<name>`, as unsharded AdamW writes them. Collective."""
        state = {}
        for prefix, moments in (("adam_m", self.inner.exp_avg), ("adam_v", self.inner.exp_avg_sq)):
            full = self.group.all_gather(self._padded(list(moments))).asnumpy()
            offset = 0
            for name, size, shape in zip(self.param_names, self.sizes, self.shapes):
                state[f"{prefix}.{name}"] = full[offset : offset + size].reshape(shape).copy()
                offset += size
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Take this rank's pieces of full (unsharded) moments."""
        expected = {f"{prefix}.{name}" for prefix in ("adam_m", "adam_v") for name in self.param_names}
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise KeyError(f"optimizer state does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for prefix, moments in (("adam_m", self.inner.exp_avg), ("adam_v", self.inner.exp_avg_sq)):
            for moment, (i, start, end) in zip(moments, self.pieces):
                value = np.asarray(state[f"{prefix}.{self.param_names[i]}"], dtype=np.float32).reshape(-1)
                ops.assign(moment, Tensor(value[start:end]))


class GradientShards(nn.Cell):
    """ZeRO-2's gradient store: fp32 `buffers`, one per piece of this rank's shard of the weights' flattened,
    concatenated gradients (the pieces `ShardedAdamW` updates). Called inside a compiled step with one
    micro-batch's full gradients, it reduce-scatters them over the group and adds this rank's shard in.

    `shard_length` (`shard_pieces`) lets two pipeline stages that hold the same tied table first cut it at
    the same offsets, so its gradient pieces can be summed over the two stages piece by piece."""

    def __init__(self, weights: Sequence[Parameter], group: Group, shard_length: int | None = None) -> None:
        super().__init__()
        sizes = [int(np.prod(w.shape)) for w in weights]
        pieces, self.shard_length = shard_pieces(sizes, group.size, group.index, shard_length)
        self.buffers = ParameterTuple(
            Parameter(
                ops.zeros((p.end - p.start,), ms.float32),
                name=f"grad_shard.{weights[p.index].name}.{p.start}",
                requires_grad=False,
            )
            for p in pieces
        )
        self.group = group
        self.piece_params = tuple(p.index for p in pieces)  # the weight each buffer is a piece of
        self.padding = self.shard_length * group.size - sum(sizes)
        self.piece_lengths = tuple(p.end - p.start for p in pieces)

    def construct(self, grads):
        flat = [grad.reshape(-1).astype(ms.float32) for grad in grads]
        if self.padding:
            flat.append(ops.zeros((self.padding,), ms.float32))
        shard = self.group.reduce_scatter(ops.cat(flat))
        offset = 0
        for buffer, length in zip(self.buffers, self.piece_lengths):
            ops.assign_add(buffer, shard[offset : offset + length])
            offset += length
        return shard


class ShardedAccumulateGradients(AccumulateGradients):
    """ZeRO-2 accumulation: forward + backward of one micro-batch, its gradients reduce-scattered over the
    group and this rank's shard added into fp32 buffers, one per piece (the pieces `ShardedAdamW` updates)."""

    def __init__(self, model: nn.Cell, group: Group, loss: nn.Cell | None = None) -> None:
        """`loss` as for `AccumulateGradients` (tensor parallelism passes its vocab-parallel one)."""
        shards = GradientShards(model.trainable_params(), group)
        super().__init__(model, shards.buffers, loss)
        self.shards = shards
        self.piece_params = shards.piece_params
        self.shard_length = shards.shard_length

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads = self.value_and_grad(tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise)
        self.shards(grads)
        if self.routed:  # an MoE model's routing statistics ride along, as in `AccumulateGradients`
            return outputs[1], outputs[2]
        return outputs[1]


def moment_bytes(optimizer: AdamW) -> int:
    """Bytes of Adam moments this process actually holds (read back from the arrays, not computed)."""
    return sum(moment.asnumpy().nbytes for moment in (*optimizer.exp_avg, *optimizer.exp_avg_sq))
