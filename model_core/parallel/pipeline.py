"""Pipeline parallelism: the model's layers split into stages, micro-batches streamed through them.

Stage s holds a run of consecutive layers (pp equal runs, or the sizes of `parallel.pipeline_layers`: the
last stage also runs the head and the loss and may take fewer), the first stage also the token embedding,
the last the final norm, the head and the loss. `PipelineStage(model, ...)` prunes a built full model (in place, from
outside, like `parallelize`) to its stage: parameter paths do not move (`layers.4.mlp.down_proj.weight`
on stage 1 of an 8-layer pp2 model), so checkpoints and optimizer state keep their names. A tied head
needs the embedding table on the last stage too: both stages hold a copy, start equal, and their
gradients are summed over the two before every update, so the copies stay bit-identical (Megatron's
embedding group); the gradient norm counts the table once.

A stage runs the model's own forward: `prune_to_stage` removes the layers and ends it does not hold, and the
model then takes the previous stage's hidden states instead of tokens, or returns its hidden states instead
of logits. A step runs its micro-batches through a schedule, each stage's list of actions:
  gpipe  every forward, then every backward;
  1f1b   stage s first runs pp - 1 - s forwards (warm-up), then alternates one backward and one forward,
         so at most pp - s micro-batches are in flight on stage s, not all of them as in GPipe.
The last stage's forward is forward + loss + backward at once (nothing waits between them there).
Execution goes in ticks: in a tick each stage runs its next actions whose inputs have arrived, at most
one forward and one backward, then the messages they produced move (activations to the next stage, input
gradients to the previous one), link by link, each only between the two ranks of its link: by native
send/receive where the backend has it, and on MindSpore's CPU backend (no Send/Receive) by one all-reduce
over the link's 2-rank group, each end writing the messages it sends into zeros (exact). Every rank derives
the same ticks from the same schedule and takes its links in the same order, so nothing can deadlock.

Activations are not kept from a forward to its backward: a stage stores only its input for each
micro-batch in flight and the backward recomputes the stage's forward from it (graph-mode compiled
cells; PyNative's deferred vjp would keep them but runs far slower here). The arithmetic is that of one
process: the same layers in the same order on the same inputs, gradients summed over micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model_core.model import Llama, counted_tokens, token_cross_entropy
from model_core.optim.step import routing_loss
from model_core.parallel import comm
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES, sum_over
from model_core.parallel.expert import ExpertGradientShards
from model_core.parallel.layout import Layout
from model_core.parallel.tensor import VocabParallelCrossEntropy
from model_core.parallel.zero import GradientShards, flat_shards
from params.schema import ModelParams

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward (on the last stage: forward, loss and backward), "B" backward
    micro_batch: int


def stage_layers(sizes: Sequence[int], stage: int) -> range:
    """The layer indices of `stage`, given every stage's number of layers (`Layout.stage_sizes`)."""
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def schedule(kind: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """Each stage's actions, in order. The last stage has forwards only (each includes its backward)."""
    if kind not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule={kind!r} is not one of {SCHEDULES}")
    orders = []
    for stage in range(stages):
        forwards = [Action("F", m) for m in range(micro_batches)]
        backwards = [Action("B", m) for m in range(micro_batches)]
        if stage == stages - 1:
            orders.append(forwards)
        elif kind == "gpipe":
            orders.append(forwards + backwards)
        else:
            warmup = min(stages - 1 - stage, micro_batches)
            order = forwards[:warmup]
            for m in range(micro_batches - warmup):
                order += [forwards[warmup + m], backwards[m]]
            orders.append(order + backwards[micro_batches - warmup :])
    return orders


def forward_only(stages: int, micro_batches: int) -> list[list[Action]]:
    """Evaluation: forwards only (the last stage's computes the loss and no gradient)."""
    return [[Action("F", m) for m in range(micro_batches)] for _ in range(stages)]


@dataclass(frozen=True)
class Message:
    """What `sender` produced in a tick for its neighbour: an activation ("act", to sender + 1) or the
    gradient of its input ("grad", to sender - 1), of `micro_batch`."""

    sender: int
    kind: str
    micro_batch: int

    @property
    def receiver(self) -> int:
        return self.sender + (1 if self.kind == "act" else -1)


@dataclass(frozen=True)
class Tick:
    actions: tuple[tuple[Action, ...], ...]  # per stage, run in this order
    messages: tuple[Message, ...]  # exchanged after the actions, in this order


def ticks(orders: Sequence[Sequence[Action]], backward: bool = True) -> list[Tick]:
    """The lock-step execution of per-stage `orders`: in each tick every stage runs its next actions whose
    inputs arrived in earlier ticks (at most one forward and one backward), then the tick's messages move.
    `backward=False`: the last stage's forwards send no gradient (evaluation)."""
    stages = len(orders)
    arrived: set[tuple[int, str, int]] = set()  # (receiving stage, kind, micro-batch)
    position = [0] * stages
    result = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        actions, messages = [], []
        for stage, order in enumerate(orders):
            done: list[Action] = []
            while position[stage] < len(order):
                action = order[position[stage]]
                if any(a.kind == action.kind for a in done) or not _ready(action, stage, arrived):
                    break
                done.append(action)
                position[stage] += 1
                messages.extend(_sent(action, stage, stages, backward))
            actions.append(tuple(done))
        if not messages and not any(actions):
            raise RuntimeError(f"pipeline schedule is stuck at positions {position}")  # a bad order
        arrived |= {(m.receiver, m.kind, m.micro_batch) for m in messages}
        result.append(Tick(tuple(actions), tuple(messages)))
    return result


def _ready(action: Action, stage: int, arrived: set[tuple[int, str, int]]) -> bool:
    if action.kind == "F":
        return stage == 0 or (stage, "act", action.micro_batch) in arrived
    return (stage, "grad", action.micro_batch) in arrived


def _sent(action: Action, stage: int, stages: int, backward: bool) -> list[Message]:
    last = stage == stages - 1
    if action.kind == "F" and not last:
        return [Message(stage, "act", action.micro_batch)]
    if backward and stage > 0 and (action.kind == "B" or last):
        return [Message(stage, "grad", action.micro_batch)]
    return []


def idle_fraction(schedule_ticks: Sequence[Tick], forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
    """The modelled bubble of lock-step ticks: idle stage-time over all stage-time, where a tick lasts as long
    as its busiest stage. A backward recomputes its forward (forward + backward cost), and so does the last
    stage's forward, which includes its backward."""
    stages = len(schedule_ticks[0].actions)
    both = forward_cost + backward_cost
    busy_total, wall = 0.0, 0.0
    for tick in schedule_ticks:
        costs = [
            sum(both if a.kind == "B" or stage == stages - 1 else forward_cost for a in actions)
            for stage, actions in enumerate(tick.actions)
        ]
        busy_total += sum(costs)
        wall += max(costs)
    return 1.0 - busy_total / (wall * stages)


def most_in_flight(orders: Sequence[Sequence[Action]]) -> list[int]:
    """Per stage, the most micro-batch inputs held at once (forwarded, not yet backwarded)."""
    peaks = []
    for order in orders[:-1]:
        held = peak = 0
        for action in order:
            held += 1 if action.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks + [1]  # the last stage holds one input at a time


# ------------------------------------------------------------------------------------------- the stage


class _StageLayers(nn.CellList):
    """Some blocks of the model, named by their global indices (`layers.4`) so parameter paths do not move, and
    iterated like any CellList: `stage_layers[i]` is the i-th block the stage holds (how jit runs the loop)."""

    def __init__(self, blocks: dict[int, nn.Cell]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.insert_child_to_cell(str(index), block)

    def __getitem__(self, index):
        if isinstance(index, int):
            return list(self._cells.values())[index]
        return super().__getitem__(index)


def prune_to_stage(model: Llama, sizes: Sequence[int], stage: int, tie_embeddings: bool) -> None:
    """Keep only what `stage` holds, in place; the parameter paths of what stays do not change. A model pruned
    already is left as it is (ZeRO-3 shards the stage it is given, so it prunes before `PipelineStage`)."""
    if isinstance(model.layers, _StageLayers):
        return
    keep = stage_layers(sizes, stage)
    model.layers = _StageLayers({index: model.layers[index] for index in keep})
    model.has_moe = any(block.is_moe for block in model.layers)
    first, last = stage == 0, stage == len(sizes) - 1
    model.takes_tokens, model.returns_logits = first, last
    if not (first or (last and tie_embeddings)):
        del model.embed_tokens
    if not last:
        del model.norm
        if not tie_embeddings:
            del model.lm_head


class _StageBody(nn.Cell):
    """The stage's forward: the model's own (token ids on the first stage, the previous stage's activation after
    it), and on the last stage the summed token loss of the micro-batch from its logits. A stage holding MoE
    blocks (`routed`) also gives, in `with_routing`, count x its weighted routing losses and their statistics
    (`optim.step.routing_loss`): the part of one process's objective its blocks add."""

    def __init__(self, model: Llama, first: bool, last: bool, loss: nn.Cell, routing_coefficients=(0.0, 0.0)) -> None:
        super().__init__()
        self.model = model
        self.first, self.last = first, last
        self.loss = loss
        self.routed = bool(model.has_moe)
        self.aux_loss_coef, self.z_loss_coef = routing_coefficients

    def construct(self, x, position_ids, segment_ids, labels, loss_mask, router_noise=None):
        if self.routed:  # the activations a later stage receives are those its backward's recompute makes
            out = self.model.routed(x, position_ids, segment_ids, router_noise)[0]
        else:
            out = self.model(x, position_ids, segment_ids)
        if not self.last:
            return out
        return self.loss(out, labels, loss_mask)

    def with_routing(self, x, position_ids, segment_ids, labels, loss_mask, router_noise):
        """(`construct`'s output, count x the weighted routing losses, the routing statistics)."""
        out, routing = self.model.routed(x, position_ids, segment_ids, router_noise)
        if self.last:
            out = self.loss(out, labels, loss_mask)
        count = counted_tokens(labels, loss_mask).sum()
        weighted, statistics = routing_loss(count, routing, self.aux_loss_coef, self.z_loss_coef)
        return out, weighted, statistics


class SummedTokenLoss(nn.Cell):
    """Summed cross-entropy of the counted tokens, from full-vocabulary logits."""

    def construct(self, logits, labels, loss_mask):
        mean, count = token_cross_entropy(logits, labels, loss_mask)
        return mean * count


class SummedVocabParallelLoss(nn.Cell):
    """Summed cross-entropy of the counted tokens, from this tensor-parallel rank's logit block."""

    def __init__(self, vocab_start: int, group: comm.Group) -> None:
        super().__init__()
        self.cross_entropy = VocabParallelCrossEntropy(vocab_start, group)

    def construct(self, logits, labels, loss_mask):
        per_token = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))[0]
        return (per_token * (loss_mask.reshape(-1) != 0).astype(ms.float32)).sum()


class _Forward(nn.Cell):
    def __init__(self, body: _StageBody) -> None:
        super().__init__()
        self.body = body

    @ms.jit
    def construct(self, x, position_ids, segment_ids, labels, loss_mask, router_noise=None):
        return self.body(x, position_ids, segment_ids, labels, loss_mask, router_noise)


class _Backward(nn.Cell):
    """Recompute the stage's forward from its stored input and backpropagate: the objective is
    sum(output * gradient of the output) (on the last stage: summed loss x scale), plus on a stage with MoE
    blocks their weighted routing losses x scale, whose gradients are the stage's vector-Jacobian products.
    Weight gradients are added into `buffers`; returns the input's gradient (zeros on the first stage, whose
    input is token ids), on the last stage the summed loss, and on a routed stage its routing statistics."""

    def __init__(self, body: _StageBody, weights: ParameterTuple, buffers: ParameterTuple, shards=None) -> None:
        """`shards` (ZeRO-2's `GradientShards`, whose buffers `buffers` are) takes the weight gradients instead
        of adding them into full-size buffers."""
        super().__init__()
        self.body = body
        self.weights = weights
        self.buffers = buffers
        self.shards = shards
        self.first, self.routed = body.first, body.routed
        position = None if body.first else 0
        self.value_and_grad = ops.value_and_grad(self._objective, position, weights, has_aux=True)

    def _objective(self, x, position_ids, segment_ids, labels, loss_mask, output_grad, scale, router_noise):
        if self.routed:
            out, weighted, statistics = self.body.with_routing(x, position_ids, segment_ids, labels, loss_mask, router_noise)
            return self._output_term(out, output_grad) + weighted * scale, (self._loss(out), statistics)
        out = self.body(x, position_ids, segment_ids, labels, loss_mask)
        return self._output_term(out, output_grad), self._loss(out)

    def _output_term(self, out, output_grad):
        if self.body.last:
            return out * output_grad  # output_grad is the loss scale here
        return (out.astype(ms.float32) * output_grad).sum()

    def _loss(self, out):
        return out if self.body.last else out.sum()

    @ms.jit
    def construct(self, x, position_ids, segment_ids, labels, loss_mask, output_grad, scale, router_noise=None):
        (_, outputs), grads = self.value_and_grad(
            x, position_ids, segment_ids, labels, loss_mask, output_grad, scale, router_noise
        )
        if self.first:
            weight_grads, input_grad = grads, ops.zeros((1,), ms.float32)
        else:
            input_grad, weight_grads = grads
        if self.shards is not None:
            self.shards(weight_grads)
        else:
            for buffer, grad in zip(self.buffers, weight_grads):
                ops.assign_add(buffer, grad)
        if self.routed:
            return input_grad, outputs[0], outputs[1]
        return input_grad, outputs


class _Exchange(nn.Cell):
    def __init__(self, group: comm.Group) -> None:
        super().__init__()
        self.group = group

    @ms.jit
    def construct(self, x):
        return self.group.all_reduce(x)


class _PairSum(nn.Cell):
    """Sum gradient buffers over a group, in place (the tied embedding's two copies: its buffer, or under ZeRO-2 its
    pieces of this rank's shard, cut alike on both)."""

    def __init__(self, buffers: Sequence[Parameter], group: comm.Group) -> None:
        super().__init__()
        self.buffers = ParameterTuple(buffers)
        self.group = group

    @ms.jit
    def construct(self):
        done = ops.zeros((), ms.float32)
        for buffer in self.buffers:  # one after another, in the same order on both ends
            done = ops.assign(buffer, self.group.all_reduce(ops.depend(buffer, done)))
        return True


def _common_chunk(weights: Sequence[Parameter], group: comm.Group, ends: comm.Group | None, bucket_bytes: int) -> int:
    """ZeRO-2's shard block for this stage (`zero.flat_shards`), or on the two end stages of a tied pipeline the
    larger of their two, so the table (first on both) is cut alike."""
    chunk = flat_shards([int(np.prod(w.shape)) for w in weights], group.size, bucket_bytes).chunk
    if ends is None:
        return chunk
    chunks = sum_over(ends, [chunk if end == ends.index else 0 for end in range(ends.size)])  # each end's
    return round(max(chunks))


def _routing_rows(params: ModelParams, sizes: Sequence[int], stage: int) -> tuple[int, int, int] | None:
    """Where a stage's load rows go in the whole model's routing statistics (`optim.step.routing_loss`:
    3 scalars, then E loads per MoE block): (first, end, width of the whole); None without MoE blocks."""
    if not params.moe_layers:
        return None
    held = stage_layers(sizes, stage)
    before = sum(1 for layer in params.moe_layers if layer < held.start)
    mine = sum(1 for layer in params.moe_layers if layer in held)
    experts = params.moe.num_experts
    return 3 + before * experts, 3 + (before + mine) * experts, 3 + len(params.moe_layers) * experts


def _add_routing(routing: np.ndarray, statistics: np.ndarray, rows: tuple[int, int, int]) -> None:
    """Add a stage's statistics (its blocks' losses and dropped choices, then their loads) into the whole's."""
    routing[:3] += statistics[:3]
    routing[rows[0] : rows[1]] += statistics[3:]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's tensors; every stage of a pipeline reads the same rows. `router_noise`: the MoE blocks'
    router jitter factors in training (`model_core.model.moe.router_noise`), None without jitter."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor | None
    segment_ids: Tensor | None
    router_noise: Tensor | None = None

    def inputs(self) -> tuple:
        """The arguments of a loss cell or a gradient accumulation, in their order (before the scale)."""
        return self.tokens, self.labels, self.loss_mask, self.position_ids, self.segment_ids


@dataclass
class PassTiming:
    """Seconds of one pipeline pass on every stage: (computing, in all); the rest is waiting and exchange."""

    per_stage: list[tuple[float, float]] = field(default_factory=list)
    sent_bytes: int = 0  # what this stage sent its neighbours in the pass (activations, input gradients)

    def bubble(self) -> float:
        """1 - compute / wall over the pipeline's stages: time they spent not computing."""
        compute = sum(c for c, _ in self.per_stage)
        wall = sum(w for _, w in self.per_stage)
        return 1.0 - compute / wall if wall > 0 else 0.0


class PipelineStage:
    """This rank's stage of the pipeline through its (dp, tp) position: pruned model, compiled forward and
    backward, and the per-step driver. `weights` and `buffers` (fp32 gradient accumulators) are the
    stage's; `run` adds a step's gradients into `buffers` and returns the summed loss of its micro-batches.

    With `zero2_group` (ZeRO-2 over the dp group) every backward reduce-scatters its weight gradients over that
    group, `bucket_bytes` (`parallel.gradient_bucket_mb`) at a time, and `buffers` are the pieces of this rank's
    shard (`zero.GradientShards`: `piece_params`, `shard_chunks`). A tied table comes first among the end stages'
    weights and both ends cut their shards in blocks of one size, so its pieces are the same on both and are summed
    over the pair piece by piece. Under expert parallelism the expert shards among the stage's weights (`experts`: every expert stack's ep block) are
    reduce-scattered over `expert_dp_group` instead (`expert.ExpertGradientShards`: the dense pieces first, the
    table first among them, then the experts'; `shards` is then that pair).

    With mixture-of-experts blocks each stage adds the routing losses of the blocks it holds to its objective,
    weighted by `routing_coefficients` (aux, z) and the micro-batch's counted tokens as in one process, and `run`
    gathers every stage's routing statistics over the pipeline, so each stage can report the whole model's
    (`routing_statistics`).

    Under sequence parallelism (`sequence_slices` = tp) the hidden states between stages are this rank's slice of
    the sequence, and a later stage, which attends over the whole sequence, is given the whole sequence's positions
    where the batch has none (`Llama` takes the sequence's length from them).
    """

    def __init__(
        self,
        model: Llama,
        layout: Layout,
        rank: int,
        params: ModelParams,
        kind: str,
        loss: nn.Cell,
        zero2_group: comm.Group | None = None,
        routing_coefficients: tuple[float, float] = (0.0, 0.0),
        experts: Collection[Parameter] = (),
        expert_dp_group: comm.Group | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sequence_slices: int = 1,
    ) -> None:
        self.group = comm.group(layout.pp_group(rank))
        self.sequence_slices = sequence_slices
        self.stages, self.stage = layout.pp, self.group.index
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.kind = kind
        prune_to_stage(model, layout.stage_sizes(params.num_layers), self.stage, params.tie_embeddings)
        self.model = model
        self.routing_rows = _routing_rows(params, layout.stage_sizes(params.num_layers), self.stage)
        self._routing: np.ndarray | None = None
        self.hidden_size = params.hidden_size
        self.compute_dtype = model.compute_dtype
        # The tied table's copies on the first and last stages: gradients summed over the two (when it trains).
        trained = "embed_tokens" in model.name_cells() and model.embed_tokens.weight.requires_grad
        self.tied = params.tie_embeddings and self.stages > 1 and (self.first or self.last) and trained
        ends = comm.group((self.group.ranks[0], self.group.ranks[-1])) if self.tied else None
        weights = model.trainable_params()
        if self.tied:
            table = model.embed_tokens.weight
            weights = [table] + [w for w in weights if w is not table]
        self.weights = ParameterTuple(weights)
        self.shards = None
        expert_ids = {id(w) for w in experts}
        held_experts = {i for i, w in enumerate(self.weights) if id(w) in expert_ids}
        if zero2_group is not None:
            dense = [w for i, w in enumerate(self.weights) if i not in held_experts]
            chunk = _common_chunk(dense, zero2_group, ends, bucket_bytes)
            self.shards = (
                ExpertGradientShards(self.weights, held_experts, zero2_group, expert_dp_group, chunk, bucket_bytes)
                if held_experts else GradientShards(self.weights, zero2_group, chunk, bucket_bytes)
            )
            self.buffers = self.shards.buffers
            self.piece_params, self.shard_chunks = self.shards.piece_params, self.shards.shard_chunks
        else:
            self.buffers = ParameterTuple(
                Parameter(ops.zeros(w.shape, ms.float32), name=f"grad_accum.{w.name}", requires_grad=False)
                for w in self.weights
            )
        body = _StageBody(model, self.first, self.last, loss, routing_coefficients)
        self.forward = _Forward(body)
        self.backward = _Backward(body, self.weights, self.buffers, self.shards)
        self.exchange = _Exchange(self.group)
        # The two-rank group of each link to a neighbouring stage (keyed by the link's lower stage): messages
        # travel only between the two ranks that talk.
        self.links = {
            min(self.stage, other): _Exchange(comm.group(tuple(sorted((self.group.ranks[self.stage], self.group.ranks[other])))))
            for other in (self.stage - 1, self.stage + 1)
            if 0 <= other < self.stages
        }
        self.tied_sum = None
        if self.tied:  # the table is weight 0: its gradient buffer, or under ZeRO-2 its piece of this shard
            owners = self.piece_params if self.shards is not None else range(len(self.weights))
            table_buffers = [buffer for buffer, owner in zip(self.buffers, owners) if owner == 0]
            self.tied_sum = _PairSum(table_buffers, ends) if table_buffers else None
        self.last_timing = PassTiming()

    def counted_in_norm(self, weights: Sequence[Parameter]) -> list[bool]:
        """Whether each weight's gradient counts in the global norm: the last stage's copy of a tied table
        does not (the first stage's, equal to it, does)."""
        table = self.model.embed_tokens.weight if self.tied and self.last else None
        return [w is not table for w in weights]

    def run(self, micro_batches: Sequence[MicroBatch], scale: Tensor) -> float:
        """Forward and backward of a step's micro-batches through the schedule; gradients added into
        `buffers` (the tied table's summed over its two copies). Returns the summed token loss of all of
        them, on every stage."""
        orders = schedule(self.kind, self.stages, len(micro_batches))
        micro_batches = [self._with_positions(batch) for batch in micro_batches]
        routing = np.zeros(self.routing_rows[2], np.float32) if self.routing_rows is not None else None
        summed = self._execute(orders, micro_batches, scale, backward=True, routing=routing)
        if self.tied_sum is not None:
            self.tied_sum()
        if routing is not None:
            whole = self.exchange(Tensor(routing)).asnumpy()  # every stage's blocks, each in its own rows
            self._routing = whole if self._routing is None else self._routing + whole
        return summed

    def routing_statistics(self) -> np.ndarray | None:
        """The whole model's routing statistics (`optim.step.SummedTokenLoss`) summed over the micro-batches run
        since the last call, the same on every stage; None without MoE blocks."""
        routing, self._routing = self._routing, None
        return routing

    def loss(self, batch: MicroBatch) -> float:
        """The summed token loss of one batch, forward only, on every stage."""
        return self._execute(forward_only(self.stages, 1), [self._with_positions(batch)], None, backward=False)

    def _with_positions(self, batch: MicroBatch) -> MicroBatch:
        """`batch`, with the positions 0..T-1 of the whole sequence where a later stage under sequence parallelism
        would otherwise see only the length of its slice."""
        if self.first or self.sequence_slices == 1 or batch.position_ids is not None:
            return batch
        positions = np.broadcast_to(np.arange(batch.tokens.shape[1], dtype=np.int32), batch.tokens.shape)
        return replace(batch, position_ids=Tensor(np.ascontiguousarray(positions)))

    def _execute(self, orders, micro_batches, scale, backward: bool, routing: np.ndarray | None = None) -> float:
        """Runs the ticks of `orders`; a routed stage adds its blocks' statistics into `routing`, in their rows."""
        start = time.perf_counter()
        self.sent_bytes = 0
        compute = 0.0
        inputs: dict[int, Tensor] = {}  # micro-batch -> this stage's input, until its backward
        grads: dict[int, Tensor] = {}  # micro-batch -> gradient of this stage's output
        outbox: dict[tuple[str, int], np.ndarray] = {}
        summed = 0.0
        for tick in ticks(orders, backward):
            began = time.perf_counter()
            for action in tick.actions[self.stage]:
                batch = micro_batches[action.micro_batch]
                x = batch.tokens if self.first else inputs[action.micro_batch]
                inputs[action.micro_batch] = x
                if action.kind == "F" and not self.last:
                    out = self.forward(
                        x, batch.position_ids, batch.segment_ids, batch.labels, batch.loss_mask, batch.router_noise
                    )
                    outbox[("act", action.micro_batch)] = out.astype(ms.float32).asnumpy()
                    if not backward:
                        inputs.pop(action.micro_batch)
                    continue
                if not backward:  # the last stage, evaluating
                    loss = self.forward(x, batch.position_ids, batch.segment_ids, batch.labels, batch.loss_mask)
                    summed += float(loss.asnumpy())
                    inputs.pop(action.micro_batch)
                    continue
                output_grad = scale if self.last else grads.pop(action.micro_batch)
                input_grad, loss, *statistics = self.backward(
                    x, batch.position_ids, batch.segment_ids, batch.labels, batch.loss_mask, output_grad, scale,
                    batch.router_noise,
                )
                if statistics:
                    _add_routing(routing, statistics[0].asnumpy(), self.routing_rows)
                inputs.pop(action.micro_batch)
                if self.last:
                    summed += float(loss.asnumpy())
                if not self.first:
                    outbox[("grad", action.micro_batch)] = input_grad.astype(ms.float32).asnumpy()
                else:
                    input_grad.asnumpy()  # wait for the backward, so the timing counts it
            compute += time.perf_counter() - began
            if tick.messages:
                self._exchange(tick.messages, outbox, micro_batches, inputs, grads)
        summed, per_stage = self._share_over_stages([summed, compute, time.perf_counter() - start])
        self.last_timing = PassTiming(per_stage, self.sent_bytes)
        return summed

    def _exchange(self, messages, outbox, micro_batches, inputs, grads) -> None:
        """The tick's messages, link by link in the order every rank derives from the schedule, each link's
        between its two ranks only: by native send/receive where the backend has it, else in one 2-rank
        all-reduce of a buffer into which each end writes the messages it sends (zeros elsewhere: exact)."""
        shape = self._activation_shape(micro_batches[messages[0].micro_batch])
        for link in sorted({min(m.sender, m.receiver) for m in messages}):
            if link not in self.links:
                continue
            on_link = [m for m in messages if min(m.sender, m.receiver) == link]
            sent = [outbox.pop((m.kind, m.micro_batch)) if m.sender == self.stage else None for m in on_link]
            self.sent_bytes += sum(value.nbytes for value in sent if value is not None)
            exchange = self.links[link]
            if exchange.group.native_p2p:
                ranks = self.group.ranks
                received = [
                    comm.send_receive(Tensor(value if value is not None else np.zeros(shape, np.float32)),
                                      ranks[m.sender], ranks[m.receiver]).asnumpy()
                    for m, value in zip(on_link, sent)
                ]
            else:
                buffer = np.zeros((len(on_link), *shape), np.float32)
                for slot, value in enumerate(sent):
                    if value is not None:
                        buffer[slot] = value
                received = exchange(Tensor(buffer)).asnumpy()
            for message, value in zip(on_link, received):
                if message.receiver == self.stage:
                    self._deliver(message, Tensor(value), inputs, grads)

    def _deliver(self, message, value: Tensor, inputs, grads) -> None:
        if message.kind == "act":
            inputs[message.micro_batch] = value.astype(self.compute_dtype)
        else:
            grads[message.micro_batch] = value

    def _activation_shape(self, batch: MicroBatch) -> tuple[int, ...]:
        """[B, T, hidden], or under sequence parallelism this rank's slice of the sequence."""
        rows, seq = batch.tokens.shape
        return (rows, seq // self.sequence_slices, self.hidden_size)

    def _share_over_stages(self, values: list[float]) -> tuple[float, list[tuple[float, float]]]:
        """(the loss summed over stages, every stage's (compute, wall) seconds) from this stage's values."""
        table = np.zeros((self.stages, 3), np.float64)
        table[self.stage] = values
        table = self.exchange(Tensor(table.astype(np.float32))).asnumpy().astype(np.float64)
        return float(table[:, 0].sum()), [(float(c), float(w)) for _, c, w in table]
