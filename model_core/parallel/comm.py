"""The one communication module of the parallel code: collectives over any group of ranks.

`group(ranks)` gives a `Group` (a Cell, so its methods can be called from a jit-compiled construct) with
all-reduce (sum, mean or max), all-gather, reduce-scatter, all-to-all, broadcast and point-to-point. Each uses the backend's
native operator where the backend has it for that group, and otherwise is built from an all-reduce sum,
the one collective that works on every group of MindSpore's CPU backend (MCCL):
  all-gather      all-reduce of a zero-filled buffer with this rank's block written in;
  all-reduce max  all-gather, then the maximum over the gathered blocks (MCCL's AllReduce sums only);
  reduce-scatter  all-reduce, then keep this rank's block;
  all-to-all      all-reduce of a zero-filled [size, *x.shape] buffer with this rank's x written in at its
                  index, then block `index` of every member's x (`all_to_all_contribution`, `received_blocks`);
  broadcast       all-reduce where every rank but the root sends zeros;
  point-to-point  all-reduce in the 2-rank group {source, destination} where the destination sends zeros.
The fallbacks cost more bandwidth (an all-gather moves size x the data) but are exact: adding zeros changes
no bit. Whether this rank is the root is read from a Parameter at run time, not decided in Python: in a jit
graph the root's `AllReduce(x)` would otherwise be merged with any other `AllReduce(x)` (common
subexpression elimination) on the root alone, and the ranks would then disagree on how many collectives
to run. Blocks are along axis 0 (all-gather and reduce-scatter: along any axis), in group order. A group of one rank needs no communication and no
`mindspore.communication.init()`, so single-process code can call the same methods.

The code that only runs where a backend has the native operator (ZeRO-2's reduce-scattered buckets, sequence
parallelism's stacked blocks) is tested on CPU with stand-ins: `LLMFLOW_EMULATED_COLLECTIVES=reduce_scatter`
(a comma-separated subset of `EMULABLE`) in a process's environment when it asks for a group makes the group take
its native path for those operators, each operator replaced by its fallback with the operator's own contract
(an axis-0 reduce-scatter that returns this rank's block, and so on). It changes no value, only which of our code
runs; on Ascend and GPU it is never set.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from functools import cache

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from model_core.parallel import heartbeat
from model_core.parallel.launch import COLLECTIVE_TIMEOUT_ENV

# Which collectives each backend offers natively on a group other than the world group. On CPU (MCCL)
# AllGather and Broadcast work on the world group only; ReduceScatter and Send/Receive not at all.
_NATIVE_ON_SUBGROUPS = {"hccl": True, "nccl": True, "mccl": False}
_NATIVE_ON_WORLD = {
    "hccl": {"all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p", "max"},
    "nccl": {"all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p", "max"},
    "mccl": {"all_gather", "broadcast"},  # measured: "AllReduce only support reduce sum on CPU"
}
_BACKEND_OF_DEVICE = {"Ascend": "hccl", "GPU": "nccl", "CPU": "mccl"}
EMULATED_COLLECTIVES_ENV = "LLMFLOW_EMULATED_COLLECTIVES"
EMULABLE = ("all_gather", "reduce_scatter", "all_to_all")


def backend() -> str:
    return _BACKEND_OF_DEVICE[ms.get_context("device_target")]


def world_size() -> int:
    """Ranks in the job: 1 unless this process was started by msrun (and comm was initialised)."""
    from mindspore.communication import get_group_size

    return get_group_size() if is_initialised() else 1


def rank() -> int:
    from mindspore.communication import get_rank

    return get_rank() if is_initialised() else 0


def is_initialised() -> bool:
    from mindspore.communication import GlobalComm

    return bool(GlobalComm.INITED)


def init() -> None:
    """Join the msrun job (idempotent). MindSpore's CPU collectives read their wait for a late peer from
    MS_NODE_TIMEOUT, which the launcher keeps short for its scheduler: a rank's own wait replaces it here,
    before the collectives are first made. msrun's scheduler runs this same program (MS_ROLE=MS_SCHED) and
    keeps the node timeout."""
    if not is_initialised():
        from mindspore.communication import init as init_communication

        if COLLECTIVE_TIMEOUT_ENV in os.environ and os.environ.get("MS_ROLE") != "MS_SCHED":
            os.environ["MS_NODE_TIMEOUT"] = os.environ[COLLECTIVE_TIMEOUT_ENV]
        init_communication()


@cache
def _group_name(ranks: tuple[int, ...]) -> str:
    """The backend's name for the group of `ranks`, created once; every member must ask for it."""
    from mindspore.communication import GlobalComm, create_group

    if ranks == tuple(range(world_size())):
        return GlobalComm.WORLD_COMM_GROUP
    name = "llmflow_" + "_".join(map(str, ranks))
    create_group(name, list(ranks))
    return name


def group(ranks: Sequence[int]) -> Group:
    """The (cached) collectives over `ranks`, which must include this rank. Call with a tuple."""
    return _cached_group(tuple(ranks), emulated_collectives())


@cache
def _cached_group(ranks: tuple[int, ...], emulated: frozenset[str]) -> Group:
    return Group(ranks, rank(), emulate=emulated)


def emulated_collectives() -> frozenset[str]:
    """The native operators `LLMFLOW_EMULATED_COLLECTIVES` asks groups to stand in for (tests; see the module)."""
    names = frozenset(name.strip() for name in os.environ.get(EMULATED_COLLECTIVES_ENV, "").split(",") if name.strip())
    unknown = sorted(names - set(EMULABLE))
    if unknown:
        raise ValueError(f"{EMULATED_COLLECTIVES_ENV}: {', '.join(unknown)} cannot be emulated (only {', '.join(EMULABLE)})")
    return names


class Group(nn.Cell):
    """Collectives over one ordered group of ranks; `index` is this rank's place in it."""

    def __init__(self, ranks: tuple[int, ...], my_rank: int, use_native: bool = True,
                 emulate: frozenset[str] = frozenset()) -> None:
        """`use_native=False` takes the all-reduce fallbacks even where native operators exist (tests); `emulate`
        takes the native path for those operators (of `EMULABLE`) where the backend lacks them, with stand-ins."""
        super().__init__()
        if len(set(ranks)) != len(ranks) or my_rank not in ranks:
            raise ValueError(f"group {list(ranks)} must list distinct ranks including this rank {my_rank}")
        self.ranks = ranks
        self.size = len(ranks)
        self.index = ranks.index(my_rank)
        self.my_rank = my_rank
        if self.size == 1:
            return
        kind = backend()
        name = _group_name(ranks)
        is_world = ranks == tuple(range(world_size()))
        native = _NATIVE_ON_WORLD[kind] if use_native and (is_world or _NATIVE_ON_SUBGROUPS[kind]) else set()
        stand_ins = set(emulate) - native if use_native else set()
        native = native | stand_ins
        self.native_all_gather = "all_gather" in native
        self.native_reduce_scatter = "reduce_scatter" in native
        self.native_all_to_all = "all_to_all" in native
        self.native_broadcast = "broadcast" in native
        self.native_p2p = "p2p" in native
        self.native_max = "max" in native
        self.backend_name = name
        self.stand_ins = frozenset(stand_ins)
        self._sum = ops.AllReduce(ops.ReduceOp.SUM, name)
        self._is_me = Parameter(  # one-hot over members: the fallbacks' root test, read at run time
            Tensor(np.eye(self.size, dtype=np.int32)[self.index]), name=f"{name}.is_me", requires_grad=False
        )
        if self.native_all_gather:
            self._gather = StandIn(self, "all_gather") if "all_gather" in stand_ins else ops.AllGather(name)
        if self.native_reduce_scatter:
            self._scatter = (StandIn(self, "reduce_scatter") if "reduce_scatter" in stand_ins
                             else ops.ReduceScatter(ops.ReduceOp.SUM, name))
        if self.native_all_to_all:
            self._all_to_all = StandIn(self, "all_to_all") if "all_to_all" in stand_ins else ops.AlltoAll(self.size, 0, 0, name)
        if self.native_max:
            self._max = ops.AllReduce(ops.ReduceOp.MAX, name)
        if self.native_broadcast:  # root_rank is fixed per primitive: one per possible root
            self._broadcasts = tuple(ops.Broadcast(root, name) for root in ranks)

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """Sum (or op="mean" the mean, op="max" the element-wise maximum) of x over the group, on every member."""
        if self.size == 1:
            return x
        if op == "max":
            if self.native_max:
                return self._max(x)
            return self.all_gather(x.reshape((1,) + x.shape)).max(axis=0)
        total = self._sum(x)
        return total / self.size if op == "mean" else total

    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        """Every member's x concatenated along `axis` in group order, on every member."""
        if self.size == 1:
            return x
        if self.native_all_gather:  # the operator gathers along axis 0: its blocks are moved to `axis` after
            gathered = self._gather(x)
            return gathered if axis == 0 else ops.cat(ops.split(gathered, x.shape[0], 0), axis)
        return self._sum(gather_contribution(x, self.index, self.size, axis))

    def reduce_scatter(self, x: Tensor, axis: int = 0) -> Tensor:
        """Block `index` (of `size` equal blocks along `axis`) of the group's sum of x."""
        if self.size == 1:
            return x
        if self.native_reduce_scatter:  # the operator scatters along axis 0: the blocks are stacked there first
            stacked = x if axis == 0 else ops.cat(ops.split(x, x.shape[axis] // self.size, axis), 0)
            return self._scatter(stacked)
        return own_block(self._sum(x), self.index, self.size, axis)

    def all_gather_sequence(self, x: Tensor) -> Tensor:
        """Every member's x [B, T_r, ...] concatenated along axis 1 (the sequence) in group order: [B, size * T_r, ...].
        Natively: the axis-0 all-gather, its member blocks then laid side by side by slicing (no transpose)."""
        if self.size == 1:
            return x
        if self.native_all_gather:
            return blocks_along_sequence(self._gather(x), self.size)
        return self._sum(sequence_gather_contribution(x, self.index, self.size))

    def reduce_scatter_sequence(self, x: Tensor) -> Tensor:
        """Block `index` (of `size` equal blocks along axis 1, the sequence) of the group's sum of x [B, T, ...]."""
        if self.size == 1:
            return x
        if self.native_reduce_scatter:
            return self._scatter(sequence_blocks_stacked(x, self.size))
        return own_sequence_block(self._sum(x), self.index, self.size)

    def all_to_all(self, x: Tensor) -> Tensor:
        """Block `index` of every member's x (`size` equal blocks along axis 0), concatenated in group order:
        member j's block i reaches member i as block j. No gradient of its own: see `AllToAll`."""
        if self.size == 1:
            return x
        if self.native_all_to_all:
            return self._all_to_all(x)
        return received_blocks(self._sum(all_to_all_contribution(x, self.index, self.size)), self.index, self.size)

    def broadcast(self, x: Tensor, root: int) -> Tensor:
        """The x of global rank `root` (a member), on every member."""
        if self.size == 1:
            return x
        root_index = self.ranks.index(root)
        if self.native_broadcast:
            return self._broadcasts[root_index]((x,))[0]
        return self._sum(broadcast_contribution(x, self._is_me[root_index]))


_fusion_ids = itertools.count(1)


class ReleasingReduceScatter(nn.Cell):
    """`Group.reduce_scatter` (axis 0) through a collective of its own, for one bucket of a chain of gradient sums
    inside a backward graph, where what reads each bucket's result must run while the backward goes on.

    MindSpore's kernel-by-kernel execution order (`ExecOrderBuilder`) queues what reads a plain collective's result
    only once no other computation is ready: inside a backward, once the backward has ended, so every bucket's result,
    and everything that waits for it, stays alive until then. What reads a collective that carries a non-zero `fusion`
    attribute is queued as soon as the next such collective of its group is issued. Each of these collectives
    carries an id of its own, so the attribute's other use, merging the collectives that share an id into one,
    never applies."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.size, self.index = group.size, group.index
        if self.size == 1:
            return
        self.native = group.native_reduce_scatter and "reduce_scatter" not in group.stand_ins
        operator = (ops.ReduceScatter(ops.ReduceOp.SUM, group.backend_name) if self.native
                    else ops.AllReduce(ops.ReduceOp.SUM, group.backend_name))
        operator.add_prim_attr("fusion", next(_fusion_ids))
        self.operator = operator

    def construct(self, x):
        if self.size == 1:
            return x
        if self.native:
            return self.operator(x)
        return own_block(self.operator(x), self.index, self.size)


class StandIn(nn.Cell):
    """A native operator's contract (axis 0, group order) built from the group's all-reduce: `LLMFLOW_EMULATED_COLLECTIVES`."""

    def __init__(self, group: Group, operator: str) -> None:
        super().__init__()
        self.sum = group._sum
        self.index, self.size, self.operator = group.index, group.size, operator

    def construct(self, x):
        if self.operator == "all_gather":
            return self.sum(row_contribution(x, self.index, self.size))
        if self.operator == "reduce_scatter":
            return own_block(self.sum(x), self.index, self.size)
        return received_blocks(self.sum(all_to_all_contribution(x, self.index, self.size)), self.index, self.size)


class AllToAll(nn.Cell):
    """`Group.all_to_all` with its gradient: an all-to-all is a permutation of blocks between members that is its
    own transpose, so the gradient of the input is the all-to-all of the output's gradient."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def construct(self, x):
        return self.group.all_to_all(x)

    def bprop(self, x, out, dout):
        return (self.group.all_to_all(dout),)


def send_receive(x: Tensor, source: int, destination: int) -> Tensor:
    """Point-to-point: `destination` returns `source`'s x (same shape and dtype on both); `source` gets x back.

    Both ranks call it; no other rank may. Built from a 2-rank all-reduce unless the backend has Send/Receive.
    """
    pair = group(tuple(sorted((source, destination))))
    me = pair.my_rank
    if me not in (source, destination) or source == destination:
        raise ValueError(f"rank {me} cannot take part in a transfer from rank {source} to rank {destination}")
    if pair.native_p2p:
        return _native_send_receive(x, source, destination, me)
    return pair.broadcast(x, source)


def _native_send_receive(x: Tensor, source: int, destination: int, me: int) -> Tensor:
    if me == source:
        ops.Send(sr_tag=0, dest_rank=destination)(x)
        return x
    return ops.Receive(sr_tag=0, src_rank=source, shape=tuple(x.shape), dtype=x.dtype)()


# The fallbacks' arithmetic, kept apart from the collective so it can be checked in one process.


def gather_contribution(x: Tensor, index: int, size: int, axis: int = 0) -> Tensor:
    """A buffer of `size` blocks the shape of x along `axis`: zeros, except block `index`, which is x."""
    if axis:  # moved to the front and back: the row form below is the one MindSpore's graph compiler takes
        return row_contribution(x.swapaxes(0, axis), index, size).swapaxes(0, axis)
    return row_contribution(x, index, size)


def row_contribution(x: Tensor, index: int, size: int) -> Tensor:
    """A buffer of `size` blocks the shape of x along axis 0: zeros, except block `index`, which is x."""
    rest = tuple(x.shape[1:])
    before, after = index * x.shape[0], (size - 1 - index) * x.shape[0]
    parts = []
    if before:
        parts.append(ops.zeros((before,) + rest, x.dtype))
    parts.append(x)
    if after:
        parts.append(ops.zeros((after,) + rest, x.dtype))
    return ops.cat(parts) if len(parts) > 1 else x


def all_to_all_contribution(x: Tensor, index: int, size: int) -> Tensor:
    """[size, *x.shape]: zeros, except row `index`, which is x (summed over the group: every member's x)."""
    return row_contribution(x.reshape((1,) + tuple(x.shape)), index, size)


def received_blocks(gathered: Tensor, index: int, size: int) -> Tensor:
    """From every member's x stacked [size, n, ...], block `index` (of `size` along n) of each, concatenated."""
    rows = gathered.shape[1] // size
    mine = gathered[:, index * rows : (index + 1) * rows]
    return mine.reshape((size * rows,) + tuple(gathered.shape[2:]))


def own_block(x: Tensor, index: int, size: int, axis: int = 0) -> Tensor:
    """Block `index` of `size` equal blocks of x along `axis`."""
    rows = x.shape[axis] // size
    return ops.split(x, rows, axis)[index] if axis else x[index * rows : (index + 1) * rows]


def sequence_gather_contribution(x: Tensor, index: int, size: int) -> Tensor:
    """[B, size * T_r, ...]: zeros, except sequence block `index`, which is x [B, T_r, ...]."""
    batch, rows, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    before, after = index * rows, (size - 1 - index) * rows
    parts = []
    if before:
        parts.append(ops.zeros((batch, before) + rest, x.dtype))
    parts.append(x)
    if after:
        parts.append(ops.zeros((batch, after) + rest, x.dtype))
    return ops.cat(parts, 1) if len(parts) > 1 else x


def own_sequence_block(x: Tensor, index: int, size: int) -> Tensor:
    """Block `index` of `size` equal blocks of x along axis 1."""
    rows = x.shape[1] // size
    return x[:, index * rows : (index + 1) * rows]


def sequence_blocks_stacked(x: Tensor, size: int) -> Tensor:
    """x [B, T, ...] as its `size` sequence blocks stacked along axis 0, [size * B, T / size, ...]: what an axis-0
    reduce-scatter takes to scatter along the sequence."""
    return ops.cat([own_sequence_block(x, index, size) for index in range(size)], 0)


def blocks_along_sequence(stacked: Tensor, size: int) -> Tensor:
    """The inverse of `sequence_blocks_stacked`: [size * B, T_r, ...] -> [B, size * T_r, ...]."""
    batch = stacked.shape[0] // size
    return ops.cat([stacked[index * batch : (index + 1) * batch] for index in range(size)], 1)


def broadcast_contribution(x: Tensor, is_root: Tensor) -> Tensor:
    """x where `is_root` (a scalar Tensor, 1 or 0) is 1, zeros elsewhere; inf and nan are not spread."""
    return mint.where(is_root == 1, x, ops.zeros_like(x))


def launched_by_msrun() -> bool:
    """True in a process msrun started: a worker, or the scheduler, which runs the same program and serves
    the job from inside `init()` until the workers finish."""
    return os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED")


def barrier() -> None:
    """Wait for every rank (a one-element all-reduce over the world)."""
    if world_size() > 1:
        ranks = tuple(range(world_size()))
        with heartbeat.collective("barrier", ranks):
            group(ranks).all_reduce(Tensor(np.zeros(1, np.float32))).asnumpy()
