"""A rank's shard of the model, built from the placement table without the whole model ever being held.

`build_shard(model_params, table, rank, ...)` is the one place a run's model is made for its layout, in this
order (torchtitan's: describe the whole model, cut it, then make only what is kept):
  1. describe    the single-device `Llama` built inside `deferred_weights()`: cells with placeholder weights,
                 each then told the shape this rank holds of it (its tp block, from the table);
  2. stage       under pipeline parallelism only this rank's stage is kept (`pipeline.prune_to_stage`);
  3. tensor      under tensor parallelism cells are swapped from outside (`tensor_parallel`, with sequence
                 parallelism where the table says), under expert parallelism every MoE block's experts
                 (`expert.expert_parallel`), and under context parallelism the attention cells and mask
                 (`context.context_parallel`);
  4. adapters    LoRA wraps the targeted projections, its A and B placeholders too, the rest frozen;
  5. ZeRO-3      every weight's cells swapped for ones that gather it from a flat shard over dp;
  6. weights     every placeholder becomes what this rank holds of the weight, as the table places it: its
                 tp block, or of an expert stack its ep block (then, under ZeRO-3, its dp shard of that block),
                 read from the initial weights on disk one block at a time (`storage.read_block`), or drawn from the weight's own (seed, path)
                 generator and cut (`model_core.model.init`).
                 With parameter offload (ZeRO-3) the shards then move to the rank's parameter offload file and
                 gradient buffers take their place (`param_offload.offload_parameters`).
A rank therefore holds its share plus, while one weight is being drawn or read, that one whole weight.

`parallelize(params, layout, rank, ...)` then composes the whole training step on that shard in one fixed
order (see its docstring) and returns a `Parallelized`: the one object the trainer drives, whatever the layout.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model_core.host_memory import release_free_heap
from model_core.model.init import deferred, deferred_weights, shape_of
from model_core.model.llama import Embedding, Linear, Llama
from model_core.model.lora import LoraSummary, apply_lora
from model_core.model.weights import WeightMismatchError, load_weights, model_weights, named_weights
from model_core.optim.step import (
    AccumulateGradients,
    ApplyGradients,
    SummedTokenLoss,
    ZeroGradients,
    looked_up_table,
    rows_table,
)
from model_core.parallel import comm
from model_core.parallel.context import context_parallel
from model_core.parallel.data_parallel import AccumulateAndSumGradients, GradientAllReduce
from model_core.parallel.expert import ExpertGradientShards, expert_block, expert_parallel, gather_experts
from model_core.parallel.gradient_norm import ParallelGradientNorm
from model_core.parallel.layout import Layout
from model_core.parallel.optimizer import AdamW, RankState
from model_core.parallel.param_offload import offload_parameters
from model_core.parallel.pipeline import MicroBatch, PipelineStage, SummedVocabParallelLoss, prune_to_stage
from model_core.parallel.pipeline import SummedTokenLoss as StageTokenLoss
from model_core.parallel.placement import PlacementTable, placement_table
from model_core.parallel.tensor import (
    RowParallelLinear,
    TensorParallelism,
    VocabParallelTokenLoss,
    tensor_parallel,
    tensor_parallel_adapter,
)
from model_core.parallel.zero import GradientShards, ShardedAccumulateGradients
from model_core.parallel.zero3 import ShardedParameters, shard_parameters, take_shard
from model_core.storage import WEIGHTS, read_block, tensor_shapes
from params.rules import check_run
from params.schema import LoraParams, ModelParams, PipelineParams

GRAPH_CALLS_PER_WEIGHT = 4  # twice what an unrolled loop takes: some loops carry branches


def take_block(array: np.ndarray, axis: int | None, size: int, index: int) -> np.ndarray:
    """Block `index` of `size` equal blocks of `array` along `axis` (the whole array when axis is None)."""
    if axis is None or size == 1:
        return array
    return np.split(array, size, axis=axis)[index]


@dataclass(frozen=True)
class Shard:
    """What `build_shard` made: the rank's model and what each step of it did (None where it did not run)."""

    model: Llama
    tensor_parallelism: TensorParallelism | None
    adaptation: LoraSummary | None
    zero3: ShardedParameters | None


def build_shard(
    params: ModelParams,
    table: PlacementTable,
    rank: int,
    seed: int,
    compute_dtype: str = "float32",
    initial_weights: str | Path | None = None,
    dp_group: comm.Group | None = None,
    cp_group: comm.Group | None = None,
) -> Shard:
    """Rank `rank`'s shard of the model (see the module docstring): LoRA adapters where the table has them, ZeRO-3
    over `dp_group` where its ZeRO stage is 3, attention over the whole sequence across `cp_group` when it has
    several ranks. `initial_weights`: a directory with model.safetensors to start from
    instead of the seeded initialisation (adapters always start from the seed)."""
    layout = table.layout
    with deferred_weights():
        model = Llama(params, compute_dtype)
    at = layout.coordinates(rank)
    if layout.pp > 1:
        prune_to_stage(model, layout.stage_sizes(params.num_layers), at.pp, params.tie_embeddings)
    parallelism = tensor_parallel(model, layout, rank, params, table.sequence_parallel) if layout.tp > 1 else None
    if layout.ep > 1:
        expert_parallel(model, comm.group(layout.ep_group(rank)))
    if cp_group is not None:
        context_parallel(model, cp_group)
    hold_blocks(model, table)
    adaptation = None
    if table.lora is not None:
        adaptation = apply_lora(model, table.lora, tensor_parallel_adapter if parallelism is not None else None)
    zero3 = shard_parameters(model, dp_group) if table.zero_stage == 3 else None
    source = Path(initial_weights) / WEIGHTS if initial_weights is not None else None
    if source is not None:
        check_weights_file(source, table)
    materialize(model, table, rank, seed, source)
    if zero3 is not None:  # the shards are now the Parameters `materialize` made
        zero3 = replace(zero3, shards={name: weight for name, weight in named_weights(model).items() if name in zero3.shards})
        if table.param_offload:
            zero3 = offload_parameters(model, zero3)
    return Shard(model, parallelism, adaptation, zero3)


def hold_blocks(model: nn.Cell, table: PlacementTable) -> None:
    """Tell every placeholder of `model` the shape this rank holds of it: its tp or ep block, as the table places it."""
    for name, _, _, weight in placeholders(model):
        weight.held_shape = table[name].block_shape(table.layout.tp, table.layout.ep)


def placeholders(model: nn.Cell) -> Iterator[tuple[str, nn.Cell, str, Parameter]]:
    """(path, cell, attribute, placeholder) of every weight of `model` not made yet, in model order."""
    for path, cell in list(model.cells_and_names()):
        # A cell's own parameters by attribute: the one way MindSpore exposes which attribute holds which.
        for attribute, weight in list(cell._params.items()):
            if deferred(weight) is not None:
                yield (f"{path}.{attribute}" if path else attribute), cell, attribute, weight


def materialize(model: nn.Cell, table: PlacementTable, rank: int, seed: int, source: Path | None) -> None:
    """Replace every placeholder weight of `model` by what rank `rank` holds of its values, one weight at a time:
    read from the safetensors file `source` (LoRA adapters excepted), or drawn from the weight's seeded
    generator; cut to the rank's tp block (an expert stack to its ep block), then under ZeRO-3 to its flat dp shard
    of that block."""
    layout = table.layout
    at = layout.coordinates(rank)
    for name, cell, attribute, placeholder in placeholders(model):
        row = table[name]
        if row.expert and layout.ep > 1:
            axis, blocks, index = 0, layout.ep, layout.ep_index(rank)
        else:
            axis, blocks, index = (row.tp_axis if layout.tp > 1 else None), layout.tp, at.tp
        if source is not None and not row.adapter:
            values = read_block(source, name, axis, blocks, index)
        else:
            values = np.ascontiguousarray(take_block(deferred(placeholder).values(seed, name), axis, blocks, index))
        held = row.block_shape(layout.tp, layout.ep)
        if values.shape != held:
            raise ValueError(f"{name}: {source or 'initialisation'} gives shape {values.shape}, this rank holds {held}")
        if table.zero_stage == 3 and row.zero_sharded:
            values = take_shard(values, layout.dp, at.dp)
        if values.shape != shape_of(placeholder):
            raise ValueError(f"{name}: the model holds shape {shape_of(placeholder)} of it, the table places {values.shape}")
        weight = Parameter(Tensor(values, ms.float32), name=name, requires_grad=placeholder.requires_grad)
        setattr(cell, attribute, weight)


def check_weights_file(path: Path, table: PlacementTable) -> None:
    """The file must hold exactly the table's base weights (not adapters), each of its whole shape (read from the
    header alone)."""
    shapes = tensor_shapes(path)
    names = {row.name for row in table if not row.adapter}
    missing, unexpected = sorted(names - shapes.keys()), sorted(shapes.keys() - names)
    if missing or unexpected:
        raise WeightMismatchError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for row in (row for row in table if not row.adapter):
        if shapes[row.name] != row.shape:
            raise WeightMismatchError(f"{path}: {row.name} has shape {shapes[row.name]}, the model's is {row.shape}")


def parallelize(
    params: PipelineParams,
    layout: Layout,
    rank: int,
    initial_weights: str | Path | None = None,
    lora: LoraParams | None = None,
) -> Parallelized:
    """Rank `rank`'s model under `layout`, wired for training, composed in this fixed order:
      1-6. `build_shard`: the model described, its stage kept, tensor parallelism swapped in, LoRA adapters
           (`lora`) with every other weight frozen, ZeRO-3's gathers from dp shards, and then what this rank
           holds of every weight made (drawn from the seed or read from `initial_weights`);
      7.   recompute marked on the chosen blocks this rank holds;
      8.   the step: the loss for this rank's logits, gradient accumulation (through the pipeline schedule
           under pp; reduce-scattered per micro-batch under ZeRO-2, expert shards' over expert-dp), the one AdamW
           of every layout reading each weight's `StatePlacement` (whole, a flat ZeRO-1/2 shard over dp or, for
           the expert stacks, over expert-dp, or ZeRO-3's parameter shard; in memory or in the optimizer offload
           file; its fp32 master apart or not), the dp gradient sum (expert shards': over expert-dp) and the
           global gradient norm, each read from the placement table.
    Not every feature runs under every layout: params/rules.py says which combinations are refused, and the
    entry points have asked it before anything was prepared or launched.

    Under context parallelism the cp ranks of a dp replica read the same rows (`data_group` is the dp group) and
    hold the same weights: from here on the layout is `Layout.folded()`, where they are dp ranks like the others,
    so gradients are summed, and ZeRO shards cut, over dp x cp together (as Megatron does). Sharding over dp alone
    would keep cp copies of every shard and its moments; over dp x cp a rank keeps 1 / (dp x cp)."""
    cp_group, data_group = comm.group(layout.cp_group(rank)), comm.group(layout.dp_group(rank))
    layout = layout.folded()
    dp_group, tp_group = comm.group(layout.dp_group(rank)), comm.group(layout.tp_group(rank))
    ep_group, expert_dp_group = comm.group(layout.ep_group(rank)), comm.group(layout.expert_dp_group(rank))
    check_run(params, finetunes=lora is not None)  # for callers that skip the CLI
    zero_stage = params.parallel.zero_stage if dp_group.size > 1 else 0
    table = placement_table(
        params.model, layout, zero_stage, lora, params.parallel.optimizer_offload, params.parallel.param_offload,
        params.parallel.sequence_parallel,
    )
    # A compiled graph unrolls each loop over the weights (the update, the norm, the gradient sums) as a chain of
    # about two calls a weight; MindSpore's default limit of 1000 calls stops a model of some 400 weights.
    ms.set_recursion_limit(1000 + GRAPH_CALLS_PER_WEIGHT * len(list(table)))
    shard = build_shard(
        params.model, table, rank, params.train.seed, params.precision.compute_dtype, initial_weights, dp_group, cp_group
    )
    model, tensor_parallelism, adaptation, zero3 = shard.model, shard.tensor_parallelism, shard.adaptation, shard.zero3
    apply_recompute(model, params)
    model.set_train(True)  # training-only layers (LoRA's dropout) act in the step, not in evaluation
    masters = {}
    if keeps_masters_apart(params, layout, zero_stage, table):
        masters = to_compute_dtype(model, model.compute_dtype)

    pipeline = None
    bucket_bytes = int(params.parallel.gradient_bucket_mb * 2**20)
    moe = params.model.moe
    routing_coefficients = (moe.aux_loss_coef, moe.z_loss_coef) if moe is not None else (0.0, 0.0)
    if tensor_parallelism is not None:
        loss = VocabParallelTokenLoss(model, tensor_parallelism, *routing_coefficients)
    else:
        loss = SummedTokenLoss(model, *routing_coefficients)
    if layout.pp > 1:
        stage_loss = (SummedVocabParallelLoss(tensor_parallelism.vocab_start, tensor_parallelism.group)
                      if tensor_parallelism is not None else StageTokenLoss())
        pipeline = accumulate = PipelineStage(
            model, layout, rank, params.model, params.parallel.pipeline_schedule, stage_loss,
            zero2_group=dp_group if zero_stage == 2 else None, routing_coefficients=routing_coefficients,
            experts=expert_weights(model, table) if ep_group.size > 1 else (),
            expert_dp_group=expert_dp_group, bucket_bytes=bucket_bytes,
            sequence_slices=layout.tp if table.sequence_parallel else 1,
        )
    elif zero_stage == 2:  # each gradient reduce-scattered per micro-batch over the group its placement names
        weights = model.trainable_params()
        paths = {id(param): name for name, param in named_weights(model).items()}
        over_experts = {i for i, weight in enumerate(weights)
                        if table.gradient_reduction(paths[id(weight)]).scattered == "expert_dp"}
        # A tied table taken by rows: its head's gradient is reduced ahead of the chain (`GradientShards.early`).
        early = looked_up_table(model, ParameterTuple(weights)) if getattr(model, "tie_embeddings", False) else -1
        shards = (ExpertGradientShards(weights, over_experts, dp_group, expert_dp_group, bucket_bytes=bucket_bytes)
                  if over_experts else GradientShards(weights, dp_group, bucket_bytes=bucket_bytes, early=early))
        accumulate = ShardedAccumulateGradients(model, shards, loss)
    elif table.param_offload:  # the model's shard Parameters are the gradient buffers (`param_offload`)
        accumulate = AccumulateGradients(model, ParameterTuple(model.trainable_params()), loss)
    else:
        accumulate = AccumulateGradients(model, loss=loss)
    names = {id(param): name for name, param in named_weights(model).items()}
    weight_names = [names[id(param)] for param in accumulate.weights]
    # Under ep the expert shards differ between the ranks of a dp group: their own optimizer state and gradient sum.
    experts = {i for i, name in enumerate(weight_names) if table[name].expert} if ep_group.size > 1 else set()
    groups = RankGroups(dp_group, data_group, cp_group, ep_group, expert_dp_group)
    optimizer = AdamW.from_params(
        accumulate.weights, params.optimizer, weight_names,
        rank_state(table, weight_names, groups, accumulate, masters, zero3, bucket_bytes),
    )
    if masters:  # the optimizer holds them (ZeRO-1/2 only its shard's pieces)
        del masters
        # A MindSpore Parameter and its ParamInfo refer to each other, so only the collector frees the whole masters
        # ZeRO-1/2 drop; glibc would then keep their pages, and the first step's peak land on top of them.
        gc.collect()
        release_free_heap()
    # The weight each gradient buffer belongs to: under ZeRO-2 the buffers are pieces of this rank's shard.
    owners = accumulate.piece_params if zero_stage == 2 else range(len(weight_names))
    counted = pipeline.counted_in_norm(accumulate.weights) if pipeline is not None else [True] * len(weight_names)
    norm = ParallelGradientNorm(
        accumulate.buffers,
        split=[tp_group.size > 1 and table[weight_names[i]].tp_axis is not None for i in owners],
        counted=[counted[i] for i in owners],
        expert=[i in experts for i in owners],
        tp_group=tp_group,
        shard_group=dp_group if zero_stage >= 2 else None,  # ZeRO-3's buffers are shards too
        pp_group=pipeline.group if pipeline is not None else None,
        ep_group=ep_group,
        expert_shard_group=expert_dp_group if zero_stage >= 2 else None,
    )
    # Each buffer is summed over the groups its weight's placement names, after the backward or inside it.
    over = {"tp": tp_group, "dp": dp_group, "expert_dp": expert_dp_group}
    reductions = [table.gradient_reduction(weight_names[i]).all_reduced for i in owners]
    sums = [[over[name] for name in groups] for groups in reductions]

    def summed_over(name: str) -> GradientAllReduce | None:
        buffers = [buffer for buffer, groups in zip(accumulate.buffers, reductions) if name in groups]
        return GradientAllReduce(ParameterTuple(buffers), over[name], bucket_bytes) if buffers else None

    # ZeRO-2 reduce-scatters every micro-batch inside its own graph already; a pipeline sums after its schedule. The
    # sums after the backward are kept beside the overlapped one for steps of several micro-batches (`gradients`).
    overlapped = params.parallel.overlap_gradient_reduction and pipeline is None and zero_stage != 2 and any(sums)
    return Parallelized(
        shard=shard,
        table=table,
        rank=rank,
        groups=groups,
        pipeline=pipeline,
        accumulate=accumulate,
        loss=loss,
        optimizer=optimizer,
        norm=norm,
        sums=GradientSums(
            accumulate_and_sum=AccumulateAndSumGradients(accumulate, sums, bucket_bytes) if overlapped else None,
            dense=summed_over("dp"),
            experts=summed_over("expert_dp"),
            partial=summed_over("tp"),
        ),
        micro_batches_per_pass=params.parallel.micro_batches,
    )


def rank_state(table: PlacementTable, names: Sequence[str], groups: RankGroups, accumulate,
               masters: Mapping[str, Parameter], zero3: ShardedParameters | None, bucket_bytes: int) -> RankState:
    """This rank's view of its weights' optimizer state (`optimizer.RankState`): each weight's placement from the
    table, and what it refers to here: the groups, the weight of each of `accumulate`'s gradient buffers (ZeRO-2:
    pieces of the shard), the fp32 `masters` of compute-dtype weights, ZeRO-3's shapes and parameter offload file."""
    zero2 = table.zero_stage == 2
    return RankState(
        placements=tuple(table.optimizer_state(name, name in masters) for name in names),
        groups={"dp": groups.dp, "expert_dp": groups.expert_dp, "ep": groups.ep},
        gradient_owners=tuple(accumulate.piece_params) if zero2 else tuple(range(len(names))),
        shard_chunks=dict(accumulate.shard_chunks) if zero2 else {},
        masters=dict(masters),
        full_shapes=dict(zero3.shapes) if zero3 is not None else {},
        weight_files=dict(zero3.offloaded.weights) if zero3 is not None and zero3.offloaded is not None else {},
        experts=frozenset(name for name in names if table[name].expert) if groups.ep.size > 1 else frozenset(),
        bucket_bytes=bucket_bytes,
    )


def keeps_masters_apart(params: PipelineParams, layout: Layout, zero_stage: int, table: PlacementTable) -> bool:
    """Whether the model holds its matmul weights in the compute dtype and the optimizer their fp32 masters (ZeRO-0:
    all of them, ZeRO-1/2: its shard), as Megatron's and DeepSpeed's mixed precision do. Built for the layouts
    whose weights' state is whole or a flat ZeRO-1/2 shard in memory; the others (ZeRO-3, pipeline, expert
    parallelism, offload, LoRA) keep fp32 weights that every matmul casts."""
    return (
        params.precision.compute_dtype != "float32" and zero_stage < 3 and layout.pp == 1 and layout.ep == 1
        and table.lora is None and not table.optimizer_offload and not table.param_offload
    )


def to_compute_dtype(model: nn.Cell, dtype) -> dict[str, Parameter]:
    """Swap every trainable `Linear` (and tensor parallelism's `RowParallelLinear`) weight of `model` for a copy in
    `dtype`, the one the matmul reads anyway (so the forward and its gradient are the same numbers); returns the
    fp32 weights it replaced, by path, for the optimizer to keep as masters. The embedding table too where the step
    takes its gradient by rows (`step.rows_table`): the head reads it in `dtype` anyway, and the looked-up rows'
    gradients are added into its fp32 buffer in fp32, repeated tokens' one after another. Elsewhere a dense lookup's
    gradient would sum repeated tokens' rows in the table's dtype, so the table stays fp32, as do the norms, which
    compute in fp32."""
    replaced = {}
    by_rows = rows_table(model)
    for path, cell in list(model.cells_and_names()):
        held = isinstance(cell, (Linear, RowParallelLinear)) or (isinstance(cell, Embedding) and cell.weight is by_rows)
        if held and cell.weight.requires_grad and cell.weight.dtype != dtype:
            name = f"{path}.weight" if path else "weight"
            master = replaced[name] = cell.weight
            cell.weight = Parameter(master.astype(dtype), name=name)
            master.name = f"master.{name}"  # a compiled graph needs its Parameters' names unique
    return replaced


@dataclass(frozen=True)
class RankGroups:
    """The groups a rank's step talks over. `dp`: the ranks holding the same weights (dp x cp), over which token
    counts and losses are summed and ZeRO shards cut; `data`: the dp replicas, which read different rows; `cp`: the
    ranks sharing this rank's rows, each taking its part of them (`loader.context_shard`); `ep`: the ranks sharing
    out the experts; `expert_dp`: the ranks holding the same experts (the expert stacks' dp)."""

    dp: comm.Group
    data: comm.Group
    cp: comm.Group
    ep: comm.Group
    expert_dp: comm.Group


@dataclass(frozen=True)
class GradientSums:
    """How a step's gradients are summed once the micro-batches are done (None: not needed by the layout):
    `accumulate_and_sum` runs a step of one micro-batch with the sums in its backward (overlapped); otherwise `dense`
    sums over dp, `experts` the expert shards' over expert-dp and `partial` the tp shares (`tp_partial`) over tp."""

    accumulate_and_sum: nn.Cell | None = None
    dense: nn.Cell | None = None
    experts: nn.Cell | None = None
    partial: nn.Cell | None = None


class Parallelized:
    """What `parallelize` made: a rank's model and step under its layout, used the same way for every layout.

    `gradients` runs a step's micro-batches forward and backward into the gradient buffers (through the pipeline
    schedule, per micro-batch otherwise) and sums them over dp where the layout needs it; `gradient_norm`,
    `apply` and `discard_gradients` finish the step; `summed_loss` scores a batch forward only; `full_weights`
    and `load_weights` speak whole tensors by path (this rank's tp block and stage), as checkpoints do.
    `shard`: what `build_shard` made; `groups`: see `RankGroups`; `sums`: see `GradientSums`."""

    def __init__(self, *, shard: Shard, table: PlacementTable, rank: int, groups: RankGroups, pipeline, accumulate,
                 loss, optimizer: AdamW, norm, sums: GradientSums, micro_batches_per_pass: int) -> None:
        self.model, self.adaptation, self.zero3 = shard.model, shard.adaptation, shard.zero3
        self.table, self.layout, self.rank = table, table.layout, rank
        self.groups = groups
        self.dp_group, self.ep_group = groups.dp, groups.ep
        self.data_group, self.cp_group = groups.data, groups.cp
        self.experts = {row.name for row in table if row.expert} if groups.ep.size > 1 else set()  # held as ep blocks
        self.pipeline = pipeline
        self.accumulate, self.loss, self.optimizer, self.norm = accumulate, loss, optimizer, norm
        self.sums = sums
        self.micro_batches_per_pass = micro_batches_per_pass
        self.stage = self.layout.coordinates(rank).pp
        self.offload = optimizer.offloaded  # the moments' offload file, where the placement puts them there
        self._apply = ApplyGradients(accumulate.buffers, optimizer) if self.offload is None else None
        # One compiled zeroing graph: the update's own where it has one (it zeroes after every update).
        self._zero = self._apply.zero if self._apply is not None else ZeroGradients(accumulate.buffers)
        self._routing: Tensor | None = None  # summed on the device, read once a step

    @property
    def weights(self):
        """The trainable weights, in the order of the gradient buffers' owners."""
        return self.accumulate.weights

    def gradients(self, micro_batches: Sequence[MicroBatch], scale: Tensor) -> float:
        """Forward and backward of a step's micro-batches, gradients added into the buffers and summed over dp
        where the layout sums once per step (and over tp where a rank's gradient is a share: `tp_partial`); the
        summed token loss of this replica's micro-batches."""
        if self.zero3 is not None and self.zero3.offloaded is not None:  # count this step's parameter fetches
            self.zero3.offloaded.fetched_bytes = 0
        if self.pipeline is not None:
            per_pass = self.micro_batches_per_pass
            passes = [micro_batches[i : i + per_pass] for i in range(0, len(micro_batches), per_pass)]
            summed = sum(self.pipeline.run(one, scale) for one in passes)
        else:
            # The sums go inside the backward only where it is the step's one backward graph: beside the plain
            # accumulation's, a second compiled backward would keep memory of its own, as large as the first's
            # (benchmarks/README.md, "Model states against the ZeRO paper"). Either way gives the same bits.
            overlapped = self.sums.accumulate_and_sum is not None and len(micro_batches) == 1
            steps = [self.sums.accumulate_and_sum if overlapped else self.accumulate] * len(micro_batches)
            losses = []
            for step, batch in zip(steps, micro_batches):
                out = step(*batch.inputs(), scale, batch.router_noise)
                if getattr(self.accumulate, "routed", False):  # an MoE model also returns its routing statistics
                    out, routing = out
                    self._routing = routing if self._routing is None else self._routing + routing
                losses.append(out)
            # The losses stay on the device until the step is done: one read, not one per micro-batch.
            summed = 0.0
            for loss in ops.stack(losses).asnumpy().tolist():
                summed += loss
            if overlapped:
                return summed
        for summed_over in (self.sums.partial, self.sums.dense, self.sums.experts):
            if summed_over is not None:
                summed_over()
        return summed

    def gradient_norm(self, grad_scale: Tensor) -> float:
        return float(self.norm(grad_scale).asnumpy())

    def apply(self, lr: Tensor, step: Tensor, grad_scale: Tensor) -> None:
        """One AdamW update from the buffers times `grad_scale`; the buffers are zeroed for the next step."""
        if self.offload is None:
            self._apply(lr, step, grad_scale)
            return
        self.optimizer.update_offloaded(self.accumulate.buffers, lr, step, grad_scale)
        self._zero()

    def close(self) -> None:
        """Release the offload files, if there are any (no step can run after this)."""
        if self.offload is not None:
            self.offload.close()
        if self.zero3 is not None and self.zero3.offloaded is not None:
            self.zero3.offloaded.close()

    def offload_bytes(self) -> int:
        """Bytes the last step moved between the offload files and memory: its update's, and its forwards' and
        backwards' parameter fetches."""
        moved = self.offload.last_bytes if self.offload is not None else 0
        if self.zero3 is not None and self.zero3.offloaded is not None:
            moved += self.zero3.offloaded.fetched_bytes
        return moved

    def discard_gradients(self) -> None:
        self._zero()

    def summed_loss(self, batch: MicroBatch) -> float:
        """The summed token loss of one batch, forward only (through every stage of a pipeline). Under ZeRO-3
        and pipeline parallelism a collective: every rank of the group calls it."""
        if self.pipeline is not None:
            return self.pipeline.loss(batch)
        summed = self.loss(*batch.inputs(), Tensor(1.0, ms.float32))[1]
        return float(summed.asnumpy())

    def routing_statistics(self) -> np.ndarray | None:
        """This rank's MoE routing statistics summed over the micro-batches since the last call (see
        `SummedTokenLoss`; a pipeline stage's cover every stage's blocks); None for a model without MoE blocks."""
        if self.pipeline is not None:
            return self.pipeline.routing_statistics()
        routing, self._routing = self._routing, None
        return routing.asnumpy() if routing is not None else None

    def full_weights(self) -> dict[str, np.ndarray]:
        """This rank's weights (its tp block of its stage) whole over dp and ep, by path. Collective under ZeRO-3
        and expert parallelism."""
        if self.zero3 is not None:
            return self.zero3.full_weights()
        weights = model_weights(self.model)
        weights.update(self.optimizer.master_weights())  # checkpoints hold fp32 masters, not compute-dtype casts
        return gather_experts(weights, self.experts, self.ep_group)

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Take this rank's weights from tp blocks of whole tensors by path (extra stages' tensors ignored)."""
        owned = {name: weights[name] for name in (row.name for row in self.table.on_stage(self.stage)) if name in weights}
        owned = expert_block(owned, self.experts, self.ep_group)
        if self.zero3 is not None:
            self.zero3.load_full_weights(owned)
        else:
            load_weights(self.model, owned)
            self.optimizer.load_master_weights(owned)


def expert_positions(model: nn.Cell, table: PlacementTable) -> set[int]:
    """The positions of the expert shards among `model`'s trainable weights."""
    names = {id(param): name for name, param in named_weights(model).items()}
    return {i for i, param in enumerate(model.trainable_params()) if table[names[id(param)]].expert}


def expert_weights(model: nn.Cell, table: PlacementTable) -> list[Parameter]:
    """The expert shards among `model`'s trainable weights, in their order."""
    weights = model.trainable_params()
    return [weights[i] for i in sorted(expert_positions(model, table))]


def apply_recompute(model: Llama, params: PipelineParams) -> list[int]:
    """Mark the chosen blocks this rank holds for activation recomputation; returns their indices."""
    choice = params.recompute
    layers = range(params.model.num_layers)
    if choice.mode == "all":
        chosen = list(layers)
    elif choice.mode == "selected":
        chosen = list(choice.layers) if choice.layers else [i for i in layers if i % choice.every_k == 0]
    else:
        chosen = []
    held = {int(name): block for name, block in model.layers.name_cells().items()}  # a stage's, by global index
    for index in chosen:
        if index in held:
            held[index].recompute()
    return chosen
