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

The optimizer (`model_core.parallel.optimizer.AdamW`) shards the expert stacks' moments over expert-dp, as their
placements say, and speaks whole tensors in its state dict, so checkpoints stay layout-independent: expert moments
are gathered over ep when saved (`gather_experts`) and cut to the rank's block when loaded (`expert_block`).
Under ZeRO-2 `ExpertGradientShards` keeps the dense and the expert gradient stores apart, for the whole model
(`zero.ShardedAccumulateGradients`) or a pipeline stage: each micro-batch's dense gradients are
reduce-scattered over dp, the expert shards' over expert-dp (with expert-dp of one rank, dp = ep, a rank keeps
its experts' whole gradients, which no other rank shares).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn, ops

from model_core.model.moe import Experts, swiglu_experts
from model_core.parallel.comm import AllToAll, Group
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from model_core.parallel.zero import GradientShards, merged_order


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


class ExpertGradientShards(nn.Cell):
    """ZeRO-2's two gradient stores under expert parallelism: called with one micro-batch's full gradients of
    `weights`, it reduce-scatters the dense weights' over `dp_group` and the expert shards' (the weights at
    positions `experts`) over `expert_dp_group`, each into fp32 `buffers`: the dense shard's pieces, then the
    experts'. `piece_params` names the weight of every buffer; `shard_chunks` the two layouts' blocks by group
    ("dp", "expert_dp"); `chunk`, when given, the dense one (`zero.flat_shards`: a pipeline's tied table cut alike on
    both end stages); `bucket_bytes` as for `GradientShards`. The two stores' buckets run as one chain, merged in
    the order the backward finishes them (`zero.merged_order`), the same on every rank."""

    def __init__(self, weights: Sequence[Parameter], experts: set[int], dp_group: Group, expert_dp_group: Group,
                 chunk: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        self.dense_positions = tuple(i for i in range(len(weights)) if i not in experts)
        self.expert_positions = tuple(sorted(experts))
        dense = [weights[i] for i in self.dense_positions]
        self.dense = GradientShards(dense, dp_group, chunk, bucket_bytes)
        self.experts = GradientShards([weights[i] for i in self.expert_positions], expert_dp_group, None, bucket_bytes)
        self.buffers = ParameterTuple((*self.dense.buffers, *self.experts.buffers))
        self.piece_params = tuple(self.dense_positions[p] for p in self.dense.piece_params) + tuple(
            self.expert_positions[p] for p in self.experts.piece_params
        )
        self.shard_chunks = {"dp": self.dense.layout.chunk, "expert_dp": self.experts.layout.chunk}
        # One chain for both stores, in the order the backward finishes their buckets: two independent chains could
        # interleave their collectives differently on ranks that share both groups, and each would wait for the other.
        stores = ((self.dense, self.dense_positions), (self.experts, self.expert_positions))
        readiness = [[positions[store.ready[k]] if store.ready[k] < len(positions) else len(weights) for k in store.order]
                     for store, positions in stores]
        self.chain = tuple((s, stores[s][0].order[at]) for s, at in merged_order(readiness))
        self.last_sum = Parameter(ops.zeros((1,), ms.float32), name=f"grad_shard.chain_end.{weights[-1].name}",
                                  requires_grad=False)

    def construct(self, grads):
        dense_grads = tuple(grads[i] for i in self.dense_positions)
        expert_grads = tuple(grads[i] for i in self.expert_positions)
        done = ops.zeros((), ms.float32)
        previous = done
        for store, k in self.chain:
            if store == 0:
                previous, done = self.dense.sum_bucket(k, dense_grads, previous, done)
            else:
                previous, done = self.experts.sum_bucket(k, expert_grads, previous, done)
        return ops.assign(self.last_sum, done.reshape(-1)[:1])  # keeps the whole chain (`GradientShards.finish`)
