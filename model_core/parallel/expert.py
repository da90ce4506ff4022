"""Expert parallelism, applied from outside the model: the experts of every MoE block shared out over an ep group.

The ep group is ep consecutive data-parallel replicas (`Layout.ep_group`); rank ep_index of it holds experts
[ep_index * E/ep, (ep_index + 1) * E/ep) of every MoE block (`placement.EXPERT_STACKS`). A rank routes its own
tokens and fills the [E, C, hidden] dispatch buffer exactly as one process would (`model_core.model.moe`); then
`ExpertParallelExperts`, swapped in for the block's `experts` cell:
  1. all-to-all over ep: block j of the buffer (the slots of rank j's experts) goes to rank j, and this rank
     receives [ep, E/ep, C, hidden], every member's slots for its own experts;
  2. its E/ep experts run on those ep x C slots each;
  3. the reverse all-to-all (the same permutation) brings each rank's outputs back into its [E, C, hidden] buffer,
     which the block combines as usual.
Every slot meets the same expert weights as in one process, so the layout changes no value. The backward of
each all-to-all is an all-to-all (`comm.AllToAll`): an expert's weight gradient on its rank sums the slots of
the whole ep group, and the trainer then sums it over the expert-data-parallel group (the dp / ep ranks holding
the same experts) instead of dp.

With tensor parallelism the MoE block's input is the same on every rank of a tp group, and each tp rank runs the
same routing and expert work on it (the experts are not split by tp): the simplest scheme that is exact, at the
price of tp-fold duplicate expert FLOPs. The ep groups join ranks of one tp index.

`ExpertParallelOptimizer` keeps the dense weights' AdamW (ZeRO-1 or 2 over dp) and the experts' (ZeRO-1 or 2
over expert-dp) side by side behind one call, and speaks whole tensors in its state dict, so checkpoints stay
layout-independent: expert moments are gathered over ep when saved and cut to the rank's block when loaded.
Under ZeRO-2 `ExpertGradientShards` keeps the two gradient stores apart the same way, for the whole model
(`ExpertShardedAccumulateGradients`) or a pipeline stage: each micro-batch's dense gradients are
reduce-scattered over dp, the expert shards' over expert-dp (with expert-dp of one rank, dp = ep, a rank keeps
its experts' whole gradients, which no other rank shares).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn, ops

from model_core.model.moe import Experts, swiglu_experts
from model_core.optim.adamw import AdamW
from model_core.optim.step import AccumulateGradients
from model_core.parallel.comm import AllToAll, Group
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from model_core.parallel.zero import GradientShards, ShardedAdamW, moment_bytes
from params.schema import OptimizerParams


class ExpertParallelExperts(nn.Cell):
    """[E, C, hidden] slots of this rank's tokens -> their experts' outputs, computed on the experts' ranks.

    Holds the block's expert weights under their own names (`gate_proj`, `up_proj`, `down_proj`, this rank's
    E/ep of each), so parameter paths are those of the single-device model."""

    def __init__(self, experts: Experts, group: Group) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = experts.gate_proj, experts.up_proj, experts.down_proj
        self.swiglu = experts.swiglu
        self.ep = group.size
        self.exchange = AllToAll(group)

    def construct(self, x):
        experts, slots, hidden = x.shape
        local = experts // self.ep
        received = self.exchange(x)  # [ep * local, C, hidden]: block j holds rank j's slots for this rank's experts
        mine = mint.transpose(received.reshape(self.ep, local, slots, hidden), 0, 1).reshape(local, self.ep * slots, hidden)
        done = swiglu_experts(mine, self.gate_proj, self.up_proj, self.down_proj, self.swiglu)
        back = mint.transpose(done.reshape(local, self.ep, slots, hidden), 0, 1).reshape(experts, slots, hidden)
        return self.exchange(back)


def expert_parallel(model: nn.Cell, group: Group) -> int:
    """Swap every MoE block's `experts` (in place, weights left as they are) for `ExpertParallelExperts` over
    `group`; returns how many blocks were swapped."""
    swapped = 0
    for layer in model.layers.cells():
        if layer.is_moe:
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, group)
            swapped += 1
    return swapped


def gather_experts(values: Mapping[str, np.ndarray], experts: set[str], group: Group) -> dict[str, np.ndarray]:
    """`values` with every tensor named in `experts` (this rank's block along axis 0) made whole over the ep
    group. Collective: every member calls it with the same names, in the same order."""
    return {
        name: group.all_gather(Tensor(value)).asnumpy() if name in experts and group.size > 1 else value
        for name, value in values.items()
    }


def expert_block(values: Mapping[str, np.ndarray], experts: set[str], group: Group) -> dict[str, np.ndarray]:
    """`values` with every whole tensor named in `experts` cut to this rank's block along axis 0."""
    def cut(value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.split(value, group.size)[group.index])

    return {name: cut(value) if name in experts and group.size > 1 else value for name, value in values.items()}


def moment_names(names: Sequence[str]) -> set[str]:
    """The optimizer-state keys of these parameters."""
    return {f"{prefix}.{name}" for prefix in ("adam_m", "adam_v") for name in names}


class ExpertParallelOptimizer(nn.Cell):
    """Two optimizers called as one AdamW, (grads, lr, step[, grad_scale]): `dense` updates the weights at
    `dense_positions` of the gradient tuple, `experts` those at `expert_positions` (this rank's expert shards,
    named `expert_names`). `state_dict` and `load_state_dict` speak whole tensors; both are collective over ep."""

    def __init__(self, dense: nn.Cell, experts: nn.Cell, dense_positions: Sequence[int], expert_positions: Sequence[int],
                 expert_names: Sequence[str], ep_group: Group) -> None:
        super().__init__()
        self.dense, self.experts = dense, experts
        self.dense_positions, self.expert_positions = tuple(dense_positions), tuple(expert_positions)
        self.expert_moments = moment_names(expert_names)
        self.ep_group = ep_group

    def construct(self, grads, lr, step, grad_scale=None):
        dense = self.dense(tuple(grads[i] for i in self.dense_positions), lr, step, grad_scale)
        return ops.depend(self.experts(tuple(grads[i] for i in self.expert_positions), lr, step, grad_scale), dense)

    def moment_bytes(self) -> int:
        return sum(o.moment_bytes() if hasattr(o, "moment_bytes") else moment_bytes(o) for o in (self.dense, self.experts))

    def state_dict(self) -> dict[str, np.ndarray]:
        experts = gather_experts(self.experts.state_dict(), self.expert_moments, self.ep_group)
        return {**self.dense.state_dict(), **experts}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        mine = expert_block(state, self.expert_moments, self.ep_group)
        self.dense.load_state_dict({k: v for k, v in mine.items() if k not in self.expert_moments})
        self.experts.load_state_dict({k: v for k, v in mine.items() if k in self.expert_moments})


class ExpertGradientShards(nn.Cell):
    """ZeRO-2's two gradient stores under expert parallelism: called with one micro-batch's full gradients of
    `weights`, it reduce-scatters the dense weights' over `dp_group` and the expert shards' (the weights at
    positions `experts`) over `expert_dp_group`, each into fp32 `buffers`: the dense shard's pieces, then the
    experts'. `piece_params` names the weight of every buffer; `shard_length` and `expert_shard_length` are the
    two shards' (`shard_length`, when given, as for `zero.shard_pieces`: a pipeline's tied table cut alike on
    both end stages); `bucket_bytes` as for `GradientShards`."""

    def __init__(self, weights: Sequence[Parameter], experts: set[int], dp_group: Group, expert_dp_group: Group,
                 shard_length: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        self.dense_positions = tuple(i for i in range(len(weights)) if i not in experts)
        self.expert_positions = tuple(sorted(experts))
        dense = [weights[i] for i in self.dense_positions]
        self.dense = GradientShards(dense, dp_group, shard_length, bucket_bytes)
        self.experts = GradientShards([weights[i] for i in self.expert_positions], expert_dp_group, None, bucket_bytes)
        self.buffers = ParameterTuple((*self.dense.buffers, *self.experts.buffers))
        self.piece_params = tuple(self.dense_positions[p] for p in self.dense.piece_params) + tuple(
            self.expert_positions[p] for p in self.experts.piece_params
        )
        self.shard_length, self.expert_shard_length = self.dense.shard_length, self.experts.shard_length

    def construct(self, grads):
        self.dense(tuple(grads[i] for i in self.dense_positions))
        self.experts(tuple(grads[i] for i in self.expert_positions))
        return True


class ExpertShardedAccumulateGradients(AccumulateGradients):
    """ZeRO-2 accumulation under expert parallelism: forward + backward of one micro-batch, its gradients added
    into `shards` (`ExpertGradientShards`: dense over `dp_group`, the expert shards at positions `experts` over
    `expert_dp_group`), whose `buffers`, `piece_params` and dense `shard_length` it shares."""

    def __init__(self, model: nn.Cell, experts: set[int], dp_group: Group, expert_dp_group: Group,
                 loss: nn.Cell | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        shards = ExpertGradientShards(model.trainable_params(), experts, dp_group, expert_dp_group, None, bucket_bytes)
        super().__init__(model, shards.buffers, loss)
        self.shards = shards
        self.piece_params = shards.piece_params
        self.shard_length = shards.shard_length

    @ms.jit
    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        outputs, grads = self.value_and_grad(tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise)
        self.shards(grads)
        return outputs[1], outputs[2]  # an ep model has MoE blocks: its routing statistics ride along


def expert_parallel_optimizer(
    weights: Sequence[Parameter], names: Sequence[str], experts: set[int], optimizer: OptimizerParams, zero_stage: int,
    dp_group: Group, expert_dp_group: Group, ep_group: Group, gradient_shards: ExpertGradientShards | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ExpertParallelOptimizer:
    """AdamW over `weights` whose positions `experts` are expert shards: the rest's moments ZeRO-1 sharded over
    `dp_group`, the experts' over `expert_dp_group` (when `zero_stage` >= 1 and the group has several ranks).
    Under ZeRO-2 `gradient_shards` holds the gradient shards (of the whole model or of a pipeline stage), and
    both optimizers update from them. `bucket_bytes`: as for `ShardedAdamW`."""
    dense, shards = [i for i in range(len(names)) if i not in experts], sorted(experts)
    if zero_stage == 2:
        pieces = len(gradient_shards.dense.buffers)
        return ExpertParallelOptimizer(
            ShardedAdamW([weights[i] for i in dense], optimizer, [names[i] for i in dense], dp_group,
                         sharded_gradients=True, shard_length=gradient_shards.shard_length, bucket_bytes=bucket_bytes),
            ShardedAdamW([weights[i] for i in shards], optimizer, [names[i] for i in shards], expert_dp_group,
                         sharded_gradients=True, shard_length=gradient_shards.expert_shard_length,
                         bucket_bytes=bucket_bytes),
            range(pieces), range(pieces, len(gradient_shards.buffers)), [names[i] for i in shards], ep_group,
        )

    def adamw(positions: list[int], group: Group) -> AdamW | ShardedAdamW:
        chosen, chosen_names = [weights[i] for i in positions], [names[i] for i in positions]
        if zero_stage >= 1 and group.size > 1:
            return ShardedAdamW(chosen, optimizer, chosen_names, group, bucket_bytes=bucket_bytes)
        return AdamW.from_params(chosen, optimizer, chosen_names)

    return ExpertParallelOptimizer(
        adamw(dense, dp_group), adamw(shards, expert_dp_group), dense, shards, [names[i] for i in shards], ep_group
    )
