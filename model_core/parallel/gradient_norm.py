"""The global gradient norm of a sharded model: one cell for every layout.

A rank's gradient buffers hold some of the model's gradients, and the global L2 norm must count each element
of the whole model's gradient exactly once:
  tensor parallelism  a split weight's block differs on every tp rank (sum its squares over the tp group); a
                      replicated one is the same on all of them (count it once);
  ZeRO-2/3            the buffers are this rank's shard of its dp group's (sum the squares over dp);
  pipeline            each stage holds other layers (sum over the pp group); the last stage's copy of a tied
                      embedding table equals the first stage's and is left out (`counted`);
  expert parallelism  an expert stack's block differs on every ep rank (sum its squares over the ep group), and
                      is the same on every tp rank (count it once over tp); under ZeRO-2 its buffers are this
                      rank's shard of its expert-dp group's (sum over expert-dp first).
So norm^2 = sum over pp of (sum over tp of the split squares + the replicated squares + sum over ep of the
expert squares), each first summed over dp when the buffers are shards. Groups that do not apply are None.
"""

from __future__ import annotations

from collections.abc import Sequence

import mindspore as ms
from mindspore import ParameterTuple, mint, nn, ops

from model_core.optim.step import sum_of_squares
from model_core.parallel.comm import Group


class ParallelGradientNorm(nn.Cell):
    """sqrt(the global sum of squared gradients) x `grad_scale`; `split`/`counted`/`expert`: per buffer (default:
    none split, all counted, none an expert block); `shard_group`: the dp group the buffers are shards of
    (ZeRO-2/3); `ep_group`: the ranks the expert blocks are shared out over; `expert_shard_group`: the expert-dp
    group the expert buffers are shards of (ZeRO-2 under ep)."""

    def __init__(
        self,
        buffers: ParameterTuple,
        split: Sequence[bool] | None = None,
        counted: Sequence[bool] | None = None,
        tp_group: Group | None = None,
        shard_group: Group | None = None,
        pp_group: Group | None = None,
        expert: Sequence[bool] | None = None,
        ep_group: Group | None = None,
        expert_shard_group: Group | None = None,
    ) -> None:
        super().__init__()
        split = tuple(split) if split is not None else (False,) * len(buffers)
        counted = tuple(counted) if counted is not None else (True,) * len(buffers)
        expert = tuple(expert) if expert is not None else (False,) * len(buffers)
        # Sorted here, not by branches in `construct`: an `if` in a loop over the buffers nests one graph call per
        # buffer, and a deep model's hundreds of buffers pass MindSpore's call depth limit.
        kinds = [("experts" if is_expert else "split" if is_split else "replicated") if is_counted else None
                 for is_split, is_counted, is_expert in zip(split, counted, expert)]
        self.split_buffers, self.replicated_buffers, self.expert_buffers = (
            tuple(buffer for buffer, kind in zip(buffers, kinds) if kind == wanted)
            for wanted in ("split", "replicated", "experts"))
        # Only groups of more than one rank communicate; the flags keep the others out of the graph.
        self.tp_group, self.across_tp = tp_group, tp_group is not None and tp_group.size > 1
        self.shard_group, self.across_shards = shard_group, shard_group is not None and shard_group.size > 1
        self.pp_group, self.across_pp = pp_group, pp_group is not None and pp_group.size > 1
        self.ep_group, self.across_ep = ep_group, ep_group is not None and ep_group.size > 1
        self.expert_shard_group = expert_shard_group
        self.across_expert_shards = self.across_ep and expert_shard_group is not None and expert_shard_group.size > 1

    @ms.jit
    def construct(self, grad_scale):
        split = ops.zeros((1,), ms.float32)
        for buffer in self.split_buffers:
            split = split + sum_of_squares(buffer)
        replicated = ops.zeros((1,), ms.float32)
        for buffer in self.replicated_buffers:
            replicated = replicated + sum_of_squares(buffer)
        experts = ops.zeros((1,), ms.float32)
        for buffer in self.expert_buffers:
            experts = experts + sum_of_squares(buffer)
        if self.across_shards:
            totals = self.shard_group.all_reduce(ops.cat((split, replicated)))
            split, replicated = totals[0:1], totals[1:2]
        if self.across_tp:
            split = self.tp_group.all_reduce(split)
        if self.across_expert_shards:
            experts = self.expert_shard_group.all_reduce(experts)
        if self.across_ep:
            experts = self.ep_group.all_reduce(experts)
        total = split + replicated + experts
        if self.across_pp:
            total = self.pp_group.all_reduce(total)
        return mint.sqrt(total).reshape(()) * grad_scale
