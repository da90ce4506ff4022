"""The one AdamW of every layout: each trainable weight's placement says what of its state this rank keeps.

A rank's optimizer state is read off the placement table (`PlacementTable.optimizer_state`, one `StatePlacement` a
weight), as torchtitan's FSDP2 and Megatron's distributed optimizer read sharding off the parameter; no class is
chosen per combination of ZeRO stage, expert parallelism, mixed precision and offload. For each weight:
  kept      WHOLE: all of it (the rank's tp or ep block), updated in place in the weight (or in its fp32 master);
            FLAT_SHARD (ZeRO-1/2): the weights of one group (dp, or expert-dp for the expert stacks), flattened and
            concatenated in order, are cut into buckets of group-size equal blocks (`zero.FlatShards`); the rank
            keeps the moments of its block of every bucket, which fall into pieces, one per weight and bucket.
            Where the group holds compute-dtype weights each piece is updated in its fp32 master, kept from step
            to step, and the updated shards are all-gathered back into every weight of the group bucket by bucket
            (`zero.ShardGather`: no buffer of the whole model). Where its weights are fp32 the rank's block of
            each bucket is copied into one scratch block, updated there and gathered before the next bucket:
            fp32 training keeps no second fp32 copy of the shard;
            PARAMETER_SHARD (ZeRO-3): the parameter is the flat shard, updated in place, decayed as the whole weight;
  master    apart (mixed precision): the model holds the compute-dtype weight, written (cast) from the updated
            master, the whole one right after its update, a shard's by the gather;
  gradient  one full buffer a weight (sliced for a piece), or under ZeRO-2 one buffer a piece of the shard;
  moments   in memory (Parameters `adam_m.<name>`, `adam_v.<name>`, a piece's with its start, a bucket's block
            `adam_m.<group>.block.<k>`) or in the rank's
            offload file (`model_core.optim.offload.OffloadedMoments`), which stages them through memory a bucket
            at a time; then the pieces are updated in place in the weights (or in the parameter offload file) and
            gathered the same way. Offload is where the moments live, not another optimizer.
Every piece goes through the same fused kernel with PyTorch's exact arithmetic (`model_core.optim.adamw`), its
gradient scaled in place by grad_scale (the loss scale's inverse times the clip factor) as it is taken, so the
update is the single-device one, element for element, whatever the layout.

Checkpoints stay layout-independent: `state_dict` speaks whole moments keyed `adam_m.<name>`/`adam_v.<name>` (a
shard's gathered over its group, an expert stack's over ep too), `load_state_dict` takes this rank's part of them,
and `master_weights`/`load_master_weights` do the same for the fp32 masters. Both readers are collectives where
the state is sharded: every rank calls them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.ops.primitive import constexpr

from model_core.optim.adamw import adamw_scalars, applies_weight_decay
from model_core.optim.offload import FileWeight, OffloadedMoments, Slot
from model_core.parallel.comm import Group
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from model_core.parallel.expert import expert_block, gather_experts
from model_core.parallel.placement import FLAT_SHARD, PARAMETER_SHARD, WHOLE, StatePlacement
from model_core.parallel.zero import FlatShards, ShardGather, flat_shards, shard_fill
from model_core.parallel.zero3 import gather_full, take_shard
from params.schema import OptimizerParams

PREFIXES = ("adam_m", "adam_v")


def _marker():
    return 0


@constexpr(check=False)
def _lost(function) -> bool:
    return function is None


def _compiled() -> bool:
    """Whether the calling code is being compiled (jit) rather than run eagerly: the graph compiler hands a constexpr a
    Python function as None (MindSpore's own `_run_in_jit` does the same)."""
    return _lost(_marker)


@dataclass(frozen=True)
class RankState:
    """A rank's view of its weights' optimizer state, for `AdamW`: one `StatePlacement` a weight, in the order of
    the weights, and what they refer to on this rank.

    `groups`: "dp" and "expert_dp", the groups the shards span, and "ep", over which the expert stacks (`experts`,
    by name) are whole. `gradient_owners`: the weight each gradient buffer belongs to, in buffer order (ZeRO-2: the
    pieces of the shard). `shard_chunks`: under ZeRO-2, the block of each group's shards that its gradient store
    cut (`zero.flat_shards`; a pipeline's tied table is cut alike on both end stages), by group. `masters`: the fp32
    master of every weight placed with its master apart, by name (read while the optimizer is built, which keeps
    only the state its pieces need).
    `full_shapes`: a ZeRO-3 shard's whole shape, by name. `weight_files`: under parameter offload, where each
    shard's values live. `bucket_bytes`: the most one all-gathered bucket of updated weights
    holds; `offload_bucket_elements`: the offload file's staging bucket (None: its default)."""

    placements: tuple[StatePlacement, ...]
    groups: Mapping[str, Group]
    gradient_owners: tuple[int, ...]
    shard_chunks: Mapping[str, int] = field(default_factory=dict)
    masters: Mapping[str, Parameter] = field(default_factory=dict)
    full_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    weight_files: Mapping[str, FileWeight] = field(default_factory=dict)
    experts: frozenset[str] = frozenset()
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    offload_bucket_elements: int | None = None


def single_device_state(parameters: Sequence[Parameter], names: Sequence[str]) -> RankState:
    """Every weight whole, in memory, its gradient one full buffer: the single-device layout."""
    placements = tuple(
        StatePlacement(name, WHOLE, None, False, False, "memory", applies_weight_decay(p))
        for name, p in zip(names, parameters)
    )
    return RankState(placements, {}, tuple(range(len(placements))))


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of weight `weight` (flattened): what one fused update handles. `gradient`: the buffer
    it reads, `gradient_slice`: the elements of that buffer (None: all of it)."""

    weight: int
    start: int
    end: int
    gradient: int
    gradient_slice: tuple[int, int] | None
    group: str | None  # the group whose gather writes it back (FLAT_SHARD), else None


class GatherUpdatedShards(nn.Cell):
    """With the moments offloaded: every group's weights from the ranks' updated pieces, which this rank updated in
    place in its weights (`local`: (weight, start, end) of each, in shard order), all-gathered by `gathers`."""

    def __init__(self, gathers: Sequence[ShardGather], local: Sequence[Sequence[tuple[int, int, int]]],
                 weights: Sequence[Parameter]) -> None:
        super().__init__()
        self.gathers = nn.CellList(gathers)
        self.local = tuple(tuple(pieces) for pieces in local)
        self.weights = ParameterTuple(weights)

    @ms.jit
    def construct(self):
        done = ops.zeros((), ms.float32)
        for g in range(len(self.gathers)):
            pieces = tuple(self.weights[i].reshape(-1)[start:end] for i, start, end in self.local[g])
            done = self.gathers[g](pieces, done)
        return done


class AdamW(nn.Cell):
    """PyTorch-exact AdamW for every layout (see the module docstring), over `parameters` (the weights the model
    trains, in the order of the gradient buffers) named `names`, as `state` places them (default: every weight
    whole, in memory: one device). Call it as `optimizer(grads, lr, step[, grad_scale])` with the gradient buffers
    (a tuple in buffer order); lr, step and grad_scale are scalar Tensors, so changing them never recompiles. step is
    the bias-correction count t, 1-based like torch's state["step"]. With grad_scale the grads must be Parameters:
    each is scaled in place just before its own update (no scaled copy is made) and holds the scaled values
    afterwards. The call returns a Tensor that exists once every update (and gather) is done, to order what comes
    after (zeroing the buffers). With moments in the offload file the update is `offloaded.step` instead, Python
    driving the file bucket by bucket (`Parallelized.apply` calls whichever the placement says)."""

    def __init__(
        self,
        parameters: Sequence[Parameter],
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        names: Sequence[str] | None = None,
        state: RankState | None = None,
    ) -> None:
        super().__init__()
        names = tuple(names) if names is not None else tuple(p.name for p in parameters)
        state = state if state is not None else single_device_state(parameters, names)
        if len(state.placements) != len(parameters):
            raise ValueError(f"{len(parameters)} weights but {len(state.placements)} placements of their state")
        self.param_names, self.placements, self.state = names, state.placements, state
        self.shapes = tuple(tuple(p.shape) for p in parameters)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self._beta1 = Tensor(self.beta1, ms.float32)
        self._beta2 = Tensor(self.beta2, ms.float32)
        self._fused_update = ops.Adam()
        self.in_place = ms.get_context("device_target") in ("CPU", "Ascend")  # InplaceMul kernels (`_scale`)
        self.shard_layouts: dict[str, FlatShards] = {}
        self.pieces = self._pieces([int(np.prod(shape)) for shape in self.shapes])
        # Groups whose pieces are kept from step to step (they hold masters of compute-dtype weights).
        self.kept_groups = {p.group for p in self.placements if p.kept == FLAT_SHARD and p.master_apart}
        self.offloaded = None
        if any(p.moments == "file" for p in self.placements):
            self._offload(parameters, state)
        else:
            self._in_memory(parameters, state)
        # The whole masters have been read: ZeRO-0's are now targets, which keep them; ZeRO-1/2 took their shard's
        # pieces. Kept here, the mapping would hold every whole master of ZeRO-1/2 alive beside those pieces.
        self.state = dataclasses.replace(state, masters={})

    @classmethod
    def from_params(cls, parameters: Sequence[Parameter], optimizer: OptimizerParams,
                    names: Sequence[str] | None = None, state: RankState | None = None) -> AdamW:
        """The AdamW an `OptimizerParams` describes (lr and clipping are the caller's, per step)."""
        return cls(parameters, (optimizer.beta1, optimizer.beta2), optimizer.eps, optimizer.weight_decay, names, state)

    # ----------------------------------------------------------------- what is updated, from the placements
    def _pieces(self, sizes: Sequence[int]) -> tuple[Piece, ...]:
        """Every piece this rank updates, in weight order: a whole weight or ZeRO-3 shard, or its piece of a
        group's flat shard; with the gradient buffer each reads."""
        owners = self.state.gradient_owners
        buffers: dict[int, list[int]] = {}
        for b, owner in enumerate(owners):
            buffers.setdefault(owner, []).append(b)
        spans: dict[int, list[tuple[int, int]]] = {}
        for group in ("dp", "expert_dp"):
            members = [i for i, p in enumerate(self.placements) if p.kept == FLAT_SHARD and p.group == group]
            if not members:
                continue
            communicator = self.state.groups[group]
            sharded = self.placements[members[0]].gradient_sharded
            wanted = self.state.shard_chunks.get(group) if sharded else None
            member_sizes = [sizes[i] for i in members]
            layout = flat_shards(member_sizes, communicator.size, self.state.bucket_bytes, wanted)
            self.shard_layouts[group] = layout
            found = layout.pieces(member_sizes, communicator.index)
            if not found:
                raise ValueError(f"{sum(sizes[i] for i in members)} parameters are too few to shard over "
                                 f"{communicator.size} ranks")
            for piece in found:
                spans.setdefault(members[piece.index], []).append((piece.start, piece.end))
        pieces = []
        for i, placement in enumerate(self.placements):
            mine, name = buffers.get(i, []), self.param_names[i]
            held = spans.get(i, []) if placement.kept == FLAT_SHARD else [(0, sizes[i])]
            if placement.gradient_sharded and len(mine) != len(held):  # ZeRO-2: one buffer a piece
                raise ValueError(f"{name}: {len(mine)} gradient shard buffers for {len(held)} pieces of this rank")
            if held and not mine:
                raise ValueError(f"{name}: this rank updates {held} of it but holds no gradient buffer for it")
            for k, (start, end) in enumerate(held):
                if placement.kept != FLAT_SHARD:
                    pieces.append(Piece(i, start, end, mine[0], None, None))
                elif placement.gradient_sharded:
                    pieces.append(Piece(i, start, end, mine[k], None, placement.group))
                else:  # cut from the weight's full (summed) gradient as it is used
                    pieces.append(Piece(i, start, end, mine[0], (start, end), placement.group))
        return tuple(pieces)

    def _gather_plans(self):
        """(group, its weights' indices, this rank's pieces as (member, start, end), the pieces' positions in
        `self.pieces`) of every group whose shards are gathered back into the weights."""
        plans = []
        for group in ("dp", "expert_dp"):
            members = [i for i, p in enumerate(self.placements) if p.kept == FLAT_SHARD and p.group == group]
            if not members:
                continue
            slots = [k for k, piece in enumerate(self.pieces) if piece.group == group]
            local = [(members.index(self.pieces[k].weight), self.pieces[k].start, self.pieces[k].end) for k in slots]
            plans.append((group, members, local, tuple(slots)))
        return plans

    def _in_memory(self, parameters: Sequence[Parameter], state: RankState) -> None:
        """The fp32 values each piece updates, the moments beside them, and where the updated values go.

        A whole weight is updated in itself or in its master, and a piece of a group that keeps masters in its own
        Parameter (the master's piece): one fused call a piece (`_update_piece`). The pieces of a group of fp32
        weights are updated a bucket at a time (`_update_block`): this rank's block of the bucket is copied from the
        weights into one scratch buffer of a block, updated there with the bucket's moments and all-gathered back,
        so fp32 training keeps one fp32 copy of its weights (a copy of every piece, kept from step to step, would
        hold 4 bytes a parameter over dp more)."""
        plans = self._gather_plans()
        blocked = [plan for plan in plans if plan[0] not in self.kept_groups]
        in_blocks = {k for plan in blocked for k in plan[3]}
        self.alone = tuple(k for k in range(len(self.pieces)) if k not in in_blocks)
        targets, working, writes, gradient_shapes = [], [], [], []
        for k in self.alone:
            piece = self.pieces[k]
            placement = self.placements[piece.weight]
            name, weight = self.param_names[piece.weight], parameters[piece.weight]
            write = -1
            if placement.kept == FLAT_SHARD:  # the master's piece, taken from it once
                whole = state.masters.get(name, weight)
                values = Tensor(whole.asnumpy().reshape(-1)[piece.start : piece.end].copy())
                targets.append(Parameter(values, name=f"zero.{name}.{piece.start}", requires_grad=False))
            elif placement.master_apart:
                targets.append(state.masters[name])
                write = len(working)
                working.append(weight)
            else:
                targets.append(weight)
            writes.append(write)
            # A whole weight whose gradient arrives flat (ZeRO-2 over a group of one) is read in the weight's shape.
            gradient_shapes.append(tuple(targets[-1].shape) if placement.kept == WHOLE else None)
        self.targets, self.working = ParameterTuple(targets), ParameterTuple(working)
        self.writes, self.gradient_shapes = tuple(writes), tuple(gradient_shapes)
        self.gradient_indices = tuple(piece.gradient for piece in self.pieces)
        first_reader = {}
        for k, piece in enumerate(self.pieces):
            first_reader.setdefault(piece.gradient, k)
        self.scales_buffer = tuple(first_reader[piece.gradient] == k for k, piece in enumerate(self.pieces))
        self.gradient_slices = tuple(piece.gradient_slice for piece in self.pieces)
        self.decays = tuple(self.placements[piece.weight].decays for piece in self.pieces)
        self.exp_avg, self.exp_avg_sq = (
            ParameterTuple(
                Parameter(ops.zeros(tuple(target.shape), ms.float32), name=f"{prefix}.{self._key(k)}",
                          requires_grad=False)
                for k, target in zip(self.alone, targets)
            )
            for prefix in PREFIXES
        )
        position = {k: i for i, k in enumerate(self.alone)}
        self.gathers = nn.CellList([
            ShardGather([parameters[i] for i in members], local, self.shard_layouts[group], state.groups[group])
            for group, members, local, _ in plans if group in self.kept_groups
        ])
        self.gathered = tuple(tuple(position[k] for k in slots) for group, _, _, slots in plans
                              if group in self.kept_groups)
        self._blocks(parameters, state, blocked)

    def _blocks(self, parameters: Sequence[Parameter], state: RankState, blocked) -> None:
        """For each group of fp32 weights (`blocked`: its gather plans): its scratch block, the moments of each of
        its buckets, and what fills each bucket's block (`block_parts`: per piece (weight source, start, end,
        gradient buffer, start, end in it, 1 if decayed), then the padding's length)."""
        sources, source_of = [], {}
        scratch, gathers, parts_of, padding_of, scales_of, firsts = [], [], [], [], [], [0]
        moments = {prefix: [] for prefix in PREFIXES}
        self.block_slots = []
        for group, members, local, slots in blocked:
            layout = self.shard_layouts[group]
            gathers.append(ShardGather([parameters[i] for i in members], local, layout, state.groups[group]))
            scratch.append(Parameter(ops.zeros((layout.chunk,), ms.float32), name=f"zero.{group}.block",
                                     requires_grad=False))
            lengths = [self.pieces[k].end - self.pieces[k].start for k in slots]
            group_parts, group_padding, group_scales = [], [], []
            for b, fill in enumerate(shard_fill(layout.bucket_ranges(), lengths)):
                bucket, scaled = [], []
                for j, start, end in fill:
                    if j < 0:
                        continue
                    k = slots[j]
                    piece = self.pieces[k]
                    if (start, end) != (0, piece.end - piece.start):
                        raise ValueError(f"{self.param_names[piece.weight]}: a piece crosses bucket {b}'s block")
                    weight = parameters[piece.weight]
                    if id(weight) not in source_of:
                        source_of[id(weight)] = len(sources)
                        sources.append(weight)
                    cut = piece.gradient_slice or (0, end - start)
                    bucket.append((source_of[id(weight)], piece.start, piece.end, piece.gradient, *cut,
                                   int(self.decays[k])))
                    if self.scales_buffer[k]:
                        scaled.append(piece.gradient)
                group_parts.append(tuple(bucket))
                group_padding.append(sum(end - start for j, start, end in fill if j < 0))
                group_scales.append(tuple(scaled))
                for prefix in PREFIXES:
                    moments[prefix].append(Parameter(ops.zeros((layout.chunk,), ms.float32),
                                                     name=f"{prefix}.{group}.block.{b}", requires_grad=False))
            parts_of.append(tuple(group_parts))
            padding_of.append(tuple(group_padding))
            scales_of.append(tuple(group_scales))
            firsts.append(firsts[-1] + len(group_parts))
            self.block_slots.append(tuple(slots))
        self.block_slots = tuple(self.block_slots)
        self.sources, self.scratch = ParameterTuple(sources), ParameterTuple(scratch)
        self.block_gathers = nn.CellList(gathers)
        self.block_parts, self.block_padding, self.block_scales = tuple(parts_of), tuple(padding_of), tuple(scales_of)
        self.block_first = tuple(firsts)
        self.block_m, self.block_v = (ParameterTuple(moments[prefix]) for prefix in PREFIXES)

    def _offload(self, parameters: Sequence[Parameter], state: RankState) -> None:
        """Moments in the offload file: every piece is updated in place in its weight (or in the parameter offload
        file), a bucket at a time, and the shards then gathered."""
        if any(p.master_apart for p in self.placements):
            raise ValueError("optimizer offload updates the weights in place: it keeps no masters apart")
        slots = []
        for k, piece in enumerate(self.pieces):
            weight = state.weight_files.get(self.param_names[piece.weight], parameters[piece.weight])
            start = piece.gradient_slice[0] if piece.gradient_slice is not None else 0
            slots.append(Slot(self._key(k), weight, piece.start, piece.end, piece.gradient, start,
                              self.placements[piece.weight].decays))
        self.offloaded = OffloadedMoments(slots, self.beta1, self.beta2, self.eps, self.weight_decay,
                                          state.offload_bucket_elements)
        plans = self._gather_plans()
        self.gather_weights = GatherUpdatedShards(
            [ShardGather([parameters[i] for i in members], local, self.shard_layouts[group], state.groups[group])
             for group, members, local, _ in plans],
            [[(members[j], start, end) for j, start, end in local] for _, members, local, _ in plans],
            parameters,
        ) if plans else None

    def update_offloaded(self, buffers: Sequence[Parameter], lr: Tensor, step: Tensor, grad_scale: Tensor) -> None:
        """The update with the moments in the offload file: bucket by bucket from `buffers` (the gradient
        buffers, scaled by grad_scale as they are staged), then the shards gathered into the weights."""
        self.offloaded.step(buffers, lr, step, grad_scale)
        if self.gather_weights is not None:
            self.gather_weights()

    def _key(self, k: int) -> str:
        piece = self.pieces[k]
        name = self.param_names[piece.weight]
        return f"{name}.{piece.start}" if self.placements[piece.weight].kept == FLAT_SHARD else name

    # ------------------------------------------------------------------------------------------ the update
    def construct(self, grads, lr, step, grad_scale=None):
        t, beta1_power, beta2_power, eps_t, keep = adamw_scalars(
            self._beta1, self._beta2, self.eps, self.weight_decay, lr, step)
        done = t
        # One call a piece keeps each piece's branches inside it: branches in the loop's own body would nest one
        # graph call per branch and piece, and a deep model's pieces would pass MindSpore's call depth limit.
        for i in range(len(self.alone)):
            done = self._update_piece(i, grads, lr, grad_scale, beta1_power, beta2_power, eps_t, keep, done)
        for g in range(len(self.gathers)):
            done = self.gathers[g](tuple(self.targets[i] for i in self.gathered[g]), done)
        for s in range(len(self.scratch)):
            for b in range(len(self.block_parts[s])):
                done = self._update_block(s, b, grads, lr, grad_scale, beta1_power, beta2_power, eps_t, keep, done)
                done = self.block_gathers[s].bucket(b, ops.depend(self.scratch[s], done), done)
        return ops.depend(t, done)

    def _update_piece(self, i, grads, lr, grad_scale, beta1_power, beta2_power, eps_t, keep, after):
        """The update of piece `alone[i]`, once `after` is done; returns what the next piece waits for."""
        k = self.alone[i]
        b = self.gradient_indices[k]
        grad = ops.depend(grads[b], after)
        if self.gradient_slices[k] is not None:
            # A ZeRO-1 piece, cut from its weight's whole buffer, is scaled as a cut: the rank scales the 1 / dp of
            # the gradients it updates, and holds a piece's cut and its product rather than the product of a whole
            # buffer (the CPU's in-place multiply writes a product and assigns it).
            start, end = self.gradient_slices[k]
            grad = grad.reshape(-1)[start:end]
            if grad_scale is not None:
                grad = grad * grad_scale
        elif grad_scale is not None and self.scales_buffer[k]:
            # A whole buffer is scaled in place (the caller zeroes it after the update anyway): the compiled graph
            # then keeps no scaled copy.
            grad = self._scale(grads[b], grad_scale, after)
        if self.gradient_shapes[i] is not None:
            grad = grad.reshape(self.gradient_shapes[i])
        if self.decays[k]:
            self._scale(self.targets[i], keep, grad)
        done = self._fused_update(
            self.targets[i], self.exp_avg[i], self.exp_avg_sq[i],
            beta1_power, beta2_power, lr, self._beta1, self._beta2, eps_t, grad,
        )[0]
        j = self.writes[i]
        if j >= 0:
            done = ops.assign(self.working[j], ops.depend(self.targets[i], done).astype(self.working[j].dtype))
        return done

    def _update_block(self, s, b, grads, lr, grad_scale, beta1_power, beta2_power, eps_t, keep, after):
        """This rank's block of bucket b of fp32 group s, updated in the group's scratch buffer once `after` (the
        previous bucket's gather) is done: the weights' pieces, decayed where they decay, copied in; the
        gradients' pieces, their buffers scaled in place first; then one fused update with the bucket's moments.
        Returns what the bucket's gather waits for."""
        if grad_scale is not None:
            # The buffers first read here (a ZeRO-1 weight's buffer can span buckets).
            for g in self.block_scales[s][b]:
                after = ops.depend(after, self._scale(grads[g], grad_scale, after))
        values, gradients = [], []
        for w, start, end, g, gradient_start, gradient_end, decayed in self.block_parts[s][b]:
            value = ops.depend(self.sources[w], after).reshape(-1)[start:end]
            values.append((value, value * keep)[decayed])  # the in-place decay's product, element for element
            gradients.append(ops.depend(grads[g], after).reshape(-1)[gradient_start:gradient_end])
        padding = self.block_padding[s][b]
        if padding:
            values.append(ops.zeros((padding,), ms.float32))
            gradients.append(ops.zeros((padding,), ms.float32))
        q = self.block_first[s] + b
        scratch = ops.assign(self.scratch[s], ops.cat(values))
        return self._fused_update(
            self.scratch[s], self.block_m[q], self.block_v[q],
            beta1_power, beta2_power, lr, self._beta1, self._beta2, eps_t, ops.depend(ops.cat(gradients), scratch),
        )[0]

    def _scale(self, parameter, factor, after):
        """parameter * factor, written into the parameter once `after` exists; returns the parameter.

        In place where the backend has the kernel. The other form, assign(p, p * factor), reads p through a Load,
        and the compiled graph copies every Load of a Parameter that it writes later (TensorMove) at once at its
        start, whatever `after` says: the copies of every buffer and every decayed weight, 4 bytes a parameter
        each, were alive together (benchmarks/README.md, "Model states against the ZeRO paper")."""
        if self.in_place and _compiled():  # PyNative's InplaceMul is unregistered, its mul_ a silent no-op
            parameter.mul_(ops.depend(factor, after))
            return parameter
        return ops.assign(parameter, ops.depend(parameter, after) * factor)

    # --------------------------------------------------------------------------- state, whole over layouts
    def moment_bytes(self) -> int:
        """Bytes of Adam moments this process holds in memory (read back from the arrays, not computed): with
        offload the staging bucket, not the file."""
        if self.offloaded is not None:
            return self.offloaded.resident_bytes()
        moments = (*self.exp_avg, *self.exp_avg_sq, *self.block_m, *self.block_v)
        return sum(moment.asnumpy().nbytes for moment in moments)

    def _local_moments(self) -> dict[str, list[np.ndarray]]:
        """Each piece's m and v, flat, by prefix."""
        if self.offloaded is not None:
            local = self.offloaded.local_state()
            return {prefix: [local[(prefix, k)] for k in range(len(self.pieces))] for prefix in PREFIXES}
        local = {}
        for prefix, alone, blocks in zip(PREFIXES, (self.exp_avg, self.exp_avg_sq), (self.block_m, self.block_v)):
            values = [None] * len(self.pieces)
            for i, k in enumerate(self.alone):
                values[k] = alone[i].asnumpy().reshape(-1)
            for s, slots in enumerate(self.block_slots):  # a group's pieces lie end to end in its buckets' blocks
                first, last = self.block_first[s], self.block_first[s + 1]
                shard = np.concatenate([blocks[q].asnumpy() for q in range(first, last)])
                offset = 0
                for k in slots:
                    size = self.pieces[k].end - self.pieces[k].start
                    values[k] = shard[offset : offset + size]
                    offset += size
            local[prefix] = values
        return local

    def _whole(self, values: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
        """Whole tensors by weight name from each piece's flat `values` (None: not asked for), gathered over the
        shards' groups and, for the expert stacks, over ep. Collective where the state is sharded."""
        whole: dict[str, np.ndarray] = {}
        for k, piece in enumerate(self.pieces):
            if values[k] is not None and self.placements[piece.weight].kept == WHOLE:
                whole[self.param_names[piece.weight]] = values[k].reshape(self.shapes[piece.weight]).copy()
        shards = [k for k, p in enumerate(self.pieces)
                  if values[k] is not None and self.placements[p.weight].kept == PARAMETER_SHARD]
        if shards:
            names = [self.param_names[self.pieces[k].weight] for k in shards]
            full = gather_full([Tensor(values[k]) for k in shards], [self.state.full_shapes[n] for n in names],
                               self.state.groups["dp"])
            whole.update(zip(names, full))
        for group, members, _, slots in self._gather_plans():
            if values[slots[0]] is None:
                continue
            layout = self.shard_layouts[group]
            flat = np.zeros(layout.length, np.float32)
            parts = np.concatenate([values[k] for k in slots])
            flat[: parts.size] = parts  # a shard's real elements come first
            gathered = layout.unshard(self.state.groups[group].all_gather(Tensor(flat)).asnumpy())
            offset = 0
            for i in members:
                size = int(np.prod(self.shapes[i]))
                whole[self.param_names[i]] = gathered[offset : offset + size].reshape(self.shapes[i]).copy()
                offset += size
        ordered = {name: whole[name] for name in self.param_names if name in whole}
        if not self.state.experts:
            return ordered
        return gather_experts(ordered, set(self.state.experts), self.state.groups["ep"])

    def state_dict(self) -> dict[str, np.ndarray]:
        """Whole moments keyed `adam_m.<name>` / `adam_v.<name>`, whatever the layout. Collective."""
        local = self._local_moments()
        state = {}
        for prefix in PREFIXES:
            state.update({f"{prefix}.{name}": value for name, value in self._whole(local[prefix]).items()})
        return state

    def _held_shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of a weight as checkpoints hold it on this rank (its tp block; an expert stack whole over
        ep after `expert_block` has cut it)."""
        i = self.param_names.index(name)
        if self.placements[i].kept == PARAMETER_SHARD:
            return tuple(self.state.full_shapes[name])
        return self.shapes[i]

    def _part(self, piece: Piece, whole: np.ndarray) -> np.ndarray:
        """This rank's part of a whole tensor for `piece`: all of it, its ZeRO-3 shard, or its flat piece."""
        kept = self.placements[piece.weight].kept
        if kept == PARAMETER_SHARD:
            group = self.state.groups["dp"]
            return take_shard(whole, group.size, group.index)
        flat = np.asarray(whole, np.float32).reshape(-1)
        return flat[piece.start : piece.end].copy() if kept == FLAT_SHARD else flat.copy()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Take this rank's part of whole moments, which must hold exactly this optimizer's keys and shapes."""
        expected = {f"{prefix}.{name}" for prefix in PREFIXES for name in self.param_names}
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise KeyError(f"optimizer state does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        moments = {f"{prefix}.{name}" for prefix in PREFIXES for name in self.state.experts}
        mine = expert_block(state, moments, self.state.groups["ep"]) if moments else state
        for key in sorted(expected):
            shape = self._held_shape(key.split(".", 1)[1])
            value = np.asarray(mine[key])
            if tuple(value.shape) != shape:
                raise ValueError(f"{key}: saved shape {tuple(value.shape)} differs from the parameter's {shape}")
        local = {}
        for k, piece in enumerate(self.pieces):
            for prefix in PREFIXES:
                local[(prefix, k)] = self._part(piece, mine[f"{prefix}.{self.param_names[piece.weight]}"])
        if self.offloaded is not None:
            self.offloaded.load_local_state(local)
            return
        for prefix, alone, blocks in zip(PREFIXES, (self.exp_avg, self.exp_avg_sq), (self.block_m, self.block_v)):
            for i, k in enumerate(self.alone):
                # in place: set_data would detach already-compiled graphs
                ops.assign(alone[i], Tensor(local[(prefix, k)].reshape(tuple(alone[i].shape))))
            for s, slots in enumerate(self.block_slots):
                first, last = self.block_first[s], self.block_first[s + 1]
                shard = np.zeros((last - first) * self.scratch[s].shape[0], np.float32)
                real = np.concatenate([local[(prefix, k)] for k in slots])
                shard[: real.size] = real
                for q, block in zip(range(first, last), np.split(shard, last - first)):
                    ops.assign(blocks[q], Tensor(block))

    def _keeps_master(self, piece: Piece) -> bool:
        placement = self.placements[piece.weight]
        return placement.group in self.kept_groups if placement.kept == FLAT_SHARD else placement.master_apart

    def master_weights(self) -> dict[str, np.ndarray]:
        """The whole fp32 masters by name of the weights the optimizer keeps apart from compute-dtype ones (under
        ZeRO-1/2, every weight of a group that holds such masters); empty when there are none. Collective."""
        if self.offloaded is not None:
            return {}
        values = [None] * len(self.pieces)
        for i, k in enumerate(self.alone):
            if self._keeps_master(self.pieces[k]):
                values[k] = self.targets[i].asnumpy().reshape(-1)
        return self._whole(values)

    def load_master_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Set this rank's part of the masters from whole fp32 `weights` by name (the compute-dtype weights are the
        caller's: `load_weights` casts them). Nothing to do where no masters are kept apart."""
        if self.offloaded is not None:
            return
        for i, k in enumerate(self.alone):
            piece = self.pieces[k]
            if self._keeps_master(piece):
                value = self._part(piece, np.asarray(weights[self.param_names[piece.weight]], np.float32))
                ops.assign(self.targets[i], Tensor(value.reshape(tuple(self.targets[i].shape))))
