"""The placement table: for every parameter of a run, where it lives under the parallel layout.

One row per parameter (LoRA adapters included), in the model's order: its path, its whole shape, the axis
tensor parallelism splits it along when tp > 1 (None: every tp rank holds all of it), the pipeline stages that hold it,
whether ZeRO shards it over the data-parallel group, and its dtype. The table is computed from the model
params, the layout and the ZeRO stage alone, so the same answer reaches everyone who needs it: building a
rank's shard, the gradient norm (a split gradient is summed over tp, a replicated one counted once), the
checkpoint writer and `llmflow ckpt reshard` (which blocks join along which axis), ZeRO, and the planner's
per-rank parameter count. Nothing else decides where a parameter lives, and nobody parses a parameter's name to find
out.

Tensor parallelism follows Megatron's plan for a Llama block, written below as `TENSOR_PARALLEL_PLAN`:
  column   q/k/v, gate/up: the weight [out, in] keeps a block of output rows (LoRA: B [out, r] split
           alike, A [r, in] whole);
  row      o_proj, down_proj: a block of input columns (LoRA: A [r, in] split alike, B [out, r] whole);
A whole LoRA matrix next to a split one is used by this rank's block alone, so its gradient on a tp rank is
a share of the whole one (`tp_partial`), summed over tp once per step; the forward needs no extra
communication. With LoRA only the adapters are trainable: the rest has no gradients and no moments.
  vocab    the token embedding and the untied head: a block of vocabulary rows.
Norm weights are replicated; under sequence parallelism (`sequence_parallel`) a norm runs on the rank's slice of the
sequence, so its weight's gradient is a share too (`tp_partial`). A mixture-of-experts block's stacked expert weights [E, ...] are not split by tp
(tp splits attention and dense feed-forwards; every tp rank runs the same expert work on the same tokens): under
expert parallelism (`expert`) rank ep_index of an ep group holds block ep_index of their E experts, and their
ZeRO shards span the expert-data-parallel group (dp / ep ranks) instead of dp. Pipeline stage s holds its run
of layers (`Layout.stage_sizes`); the first stage also the embedding, the last the final norm and the head,
and with tied embeddings the last stage holds a copy of the embedding table too.

A row's AdamW moments live where the row's ZeRO sharding puts them (every rank, or this rank's 1/dp), in memory
or, with `optimizer_offload`, in the rank's offload file on local disk (`model_core/optim/offload.py`), which
holds all of them or none. Under ZeRO-3 with `param_offload` the rows' parameter shards live in a second file of
the rank (`model_core/parallel/param_offload.py`), all of them.

Two questions about a trainable weight are answered here for the step to read, as torchtitan reads sharding off the
parameter: `optimizer_state` (what of its fp32 master and moments a rank keeps, and where: the one
`model_core.parallel.optimizer.AdamW` of every layout reads it) and `gradient_reduction` (which groups its
gradient is summed over, or reduce-scattered over). A new way to place a weight is a new answer here, not a class.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from model_core.model.lora import TARGETS as LORA_TARGETS
from model_core.parallel.layout import Layout
from params.schema import LoraParams, ModelParams

COLUMN, ROW, VOCAB = "column", "row", "vocab"

# A block's projections (path inside `layers.<i>`) -> how tensor parallelism splits them.
TENSOR_PARALLEL_PLAN = {
    "self_attn.q_proj": COLUMN,
    "self_attn.k_proj": COLUMN,
    "self_attn.v_proj": COLUMN,
    "self_attn.o_proj": ROW,
    "mlp.gate_proj": COLUMN,
    "mlp.up_proj": COLUMN,
    "mlp.down_proj": ROW,
}
# A block's parameters (a norm's weight or a projection), in the order the model holds them.
BLOCK_PARAMETERS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
DENSE_FFN = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # replaced by experts in an MoE block
EXPERT_STACKS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")  # [E, ...], split over ep
# (weight, LoRA A, LoRA B): the axis each is split along under a style.
_AXES = {COLUMN: (0, None, 0), ROW: (1, 1, None)}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives. `shape` is the whole (single-device) shape."""

    name: str
    shape: tuple[int, ...]
    tp_axis: int | None
    stages: tuple[int, ...]
    zero_sharded: bool
    trainable: bool = True
    adapter: bool = False  # a LoRA matrix: made by the adapter step, never read from the base weights
    tp_partial: bool = False  # held whole, but a tp rank's gradient is its share of the whole (summed over tp)
    dtype: str = "float32"
    expert: bool = False  # a stack of experts [E, ...], split along axis 0 over the ep group

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def block_shape(self, tp: int, ep: int = 1) -> tuple[int, ...]:
        """The shape one of `tp` tensor-parallel ranks (and of `ep` expert-parallel ranks) holds."""
        if self.expert and ep > 1:
            return (self.shape[0] // ep,) + self.shape[1:]
        if self.tp_axis is None or tp == 1:
            return self.shape
        return tuple(-(-n // tp) if axis == self.tp_axis else n for axis, n in enumerate(self.shape))  # padded if tp does not divide


# What a rank keeps of a trainable weight's fp32 master and AdamW moments (`StatePlacement.kept`).
WHOLE, FLAT_SHARD, PARAMETER_SHARD = "whole", "flat shard", "parameter shard"


@dataclass(frozen=True)
class StatePlacement:
    """What one rank keeps of a trainable weight's optimizer state, and where (`PlacementTable.optimizer_state`).

    `kept`: WHOLE (all of the weight as the rank holds it: its tp or ep block), FLAT_SHARD (this rank's piece of the
    flat, concatenated weights of its `group` cut into equal shards: ZeRO-1/2) or PARAMETER_SHARD (ZeRO-3: the
    parameter is the shard). `group`: the group a shard spans, "dp" or "expert_dp" (None for WHOLE).
    `gradient_sharded`: the rank's gradient of a FLAT_SHARD weight arrives as its shard's pieces (ZeRO-2), not whole.
    `master_apart`: the model holds the weight in the compute dtype and the optimizer its fp32 master. `moments`:
    "memory" or "file" (the rank's optimizer offload file). `decays`: AdamW decays it (two or more dimensions)."""

    name: str
    kept: str
    group: str | None
    gradient_sharded: bool
    master_apart: bool
    moments: str
    decays: bool


@dataclass(frozen=True)
class GradientReduction:
    """How a trainable weight's gradient is reduced on a rank (`PlacementTable.gradient_reduction`).

    `all_reduced`: the groups its buffer is summed over once a step's micro-batches are done (or inside a step's one
    backward, overlapped), in this order: "tp" where a rank's gradient is a share (`tp_partial`), then "dp" or, for
    an expert stack under ep, "expert_dp" (a group of one is left out). `scattered`: the group its gradient is
    reduce-scattered over inside every backward (ZeRO-2 into the rank's flat shard, ZeRO-3 by the parameter's
    gather), else None."""

    all_reduced: tuple[str, ...]
    scattered: str | None


@dataclass(frozen=True)
class PlacementTable:
    """Every parameter's `Placement` under one layout; see the module docstring."""

    layout: Layout
    zero_stage: int
    rows: tuple[Placement, ...]
    lora: LoraParams | None = None
    optimizer_offload: bool = False  # every trainable row's moments in the offload file, not in memory
    param_offload: bool = False  # ZeRO-3: every row's parameter shard in the parameter offload file, not in memory
    sequence_parallel: bool = False  # tp > 1: between the tp regions a rank holds its slice of the sequence

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {row.name: row for row in self.rows})

    def __getitem__(self, name: str) -> Placement:
        """The placement of a parameter, or of its optimizer moment (`adam_m.<name>`, `adam_v.<name>`)."""
        found = self._by_name.get(name.removeprefix("adam_m.").removeprefix("adam_v."))  # type: ignore[attr-defined]
        if found is None:
            raise KeyError(f"{name} is not a parameter of this model")
        return found

    def __contains__(self, name: str) -> bool:
        return name.removeprefix("adam_m.").removeprefix("adam_v.") in self._by_name  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Placement]:
        return iter(self.rows)

    def _replicas(self, row: Placement) -> tuple[str, int]:
        """The group of ranks holding the same values of `row` and its size: dp, or an expert stack's expert-dp."""
        if row.expert and self.layout.ep > 1:
            return "expert_dp", self.layout.dp // self.layout.ep
        return "dp", self.layout.dp

    def optimizer_state(self, name: str, master_apart: bool = False) -> StatePlacement:
        """Where a trainable weight's master and moments live on a rank: sharded as its row's ZeRO sharding says,
        over dp, or an expert stack's over expert-dp (a group of one keeps all of it), in memory or the offload file.
        `master_apart`: whether the model holds this weight in the compute dtype (the caller's swap decides)."""
        row = self[name]
        if not row.trainable:
            raise ValueError(f"{name} is frozen: it has no optimizer state")
        group, size = self._replicas(row)
        if self.zero_stage == 3 and row.zero_sharded:  # ZeRO-3 cuts every weight over dp, experts' blocks too
            kept, group = PARAMETER_SHARD, "dp"
        elif self.zero_stage in (1, 2) and row.zero_sharded and size > 1:
            kept = FLAT_SHARD
        else:
            kept, group = WHOLE, None
        return StatePlacement(
            name, kept, group, kept == FLAT_SHARD and self.zero_stage == 2, master_apart,
            "file" if self.optimizer_offload else "memory", len(row.shape) >= 2,
        )

    def gradient_reduction(self, name: str) -> GradientReduction:
        """How a trainable weight's gradient is reduced: over tp where it is a share, and over the ranks holding the
        same weight (dp, or an expert stack's expert-dp), summed once a step or, from ZeRO-2 on, reduce-scattered."""
        row = self[name]
        if not row.trainable:
            raise ValueError(f"{name} is frozen: it has no gradient")
        group, size = self._replicas(row)
        shares = ("tp",) if row.tp_partial else ()
        if self.zero_stage >= 2 and row.zero_sharded:
            return GradientReduction(shares, group)
        return GradientReduction(shares + ((group,) if size > 1 else ()), None)

    def on_stage(self, stage: int) -> list[Placement]:
        """What pipeline stage `stage` holds, in model order."""
        return [row for row in self.rows if stage in row.stages]

    def rank_bytes(self, rank: int) -> dict[str, int]:
        """Bytes rank `rank` holds of parameters, fp32 gradient buffers of the trainable ones and their two fp32
        Adam moments, from the table alone; with optimizer offload the moments count as `offloaded` (on disk),
        not `optimizer` (the update's fixed staging bucket is not counted), and with parameter offload the ZeRO-3
        parameter shards too, not `parameters` (the shard fetched for a gather is not counted)."""
        at = self.layout.coordinates(rank)
        layout = self.layout
        moments = "offloaded" if self.optimizer_offload else "optimizer"
        held = {"parameters": 0, "gradients": 0, "optimizer": 0, "offloaded": 0}
        for row in self.on_stage(at.pp):
            elements = math.prod(row.block_shape(layout.tp, layout.ep))
            shard = math.ceil(elements / (layout.dp // layout.ep if row.expert else layout.dp))
            parameters = "offloaded" if self.param_offload and row.zero_sharded else "parameters"
            held[parameters] += (shard if self.zero_stage == 3 and row.zero_sharded else elements) * _BYTES[row.dtype]
            if row.trainable:
                held["gradients"] += 4 * (shard if self.zero_stage >= 2 else elements)
                held[moments] += 2 * 4 * (shard if self.zero_stage >= 1 else elements)
        return held


def placement_table(
    model: ModelParams, layout: Layout, zero_stage: int = 0, lora: LoraParams | None = None,
    optimizer_offload: bool = False, param_offload: bool = False, sequence_parallel: bool = False,
) -> PlacementTable:
    """The table of a model with these params under `layout`; `lora` adds its adapters when enabled;
    `optimizer_offload` puts the moments in the offload file, `param_offload` (ZeRO-3) the parameter shards;
    `sequence_parallel` makes the norms' gradients shares over tp."""
    sizes = layout.stage_sizes(model.num_layers)
    last = len(sizes) - 1
    zero = zero_stage > 0 and layout.dp > 1
    lora = lora if lora is not None and lora.enabled else None
    adapted = {LORA_TARGETS[t] for t in lora.target_modules} if lora is not None else set()
    head_dim, hidden = model.head_dim, model.hidden_size
    projection_shapes = {
        "self_attn.q_proj": (model.num_heads * head_dim, hidden),
        "self_attn.k_proj": (model.num_kv_heads * head_dim, hidden),
        "self_attn.v_proj": (model.num_kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, model.num_heads * head_dim),
        "mlp.gate_proj": (model.ffn_hidden_size, hidden),
        "mlp.up_proj": (model.ffn_hidden_size, hidden),
        "mlp.down_proj": (hidden, model.ffn_hidden_size),
    }

    def row(name: str, shape: Sequence[int], axis: int | None, stages: Sequence[int], adapter: bool = False,
            partial: bool = False, expert: bool = False) -> Placement:
        trainable = adapter if lora is not None else True
        return Placement(
            name, tuple(shape), axis, tuple(stages), zero, trainable, adapter, partial and layout.tp > 1, expert=expert
        )

    embedding_stages = (0, last) if model.tie_embeddings and last > 0 else (0,)
    rows = [row("embed_tokens.weight", (model.vocab_size, hidden), 0, embedding_stages)]
    moe_layers = set(model.moe_layers)
    start = 0
    for stage, count in enumerate(sizes):
        for index in range(start, start + count):
            experts = _expert_shapes(model) if index in moe_layers else None
            rows += _layer_rows(row, f"layers.{index}", stage, hidden, projection_shapes, adapted, lora, experts,
                                sequence_parallel)
        start += count
    rows.append(row("norm.weight", (hidden,), None, (last,), partial=sequence_parallel))
    if not model.tie_embeddings:
        rows.append(row("lm_head.weight", (model.vocab_size, hidden), 0, (last,)))
    zero_stage = zero_stage if layout.dp > 1 else 0
    if param_offload and zero_stage != 3:
        raise ValueError(f"param_offload places ZeRO-3 shards in a file; zero_stage={zero_stage}, dp={layout.dp}")
    return PlacementTable(
        layout, zero_stage, tuple(rows), lora, optimizer_offload, param_offload, sequence_parallel and layout.tp > 1
    )


def _expert_shapes(model: ModelParams) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts block's feed-forward parameters in model order (`model_core.model.moe`), in place of
    the dense `DENSE_FFN`. Tensor parallelism does not split them; expert parallelism splits the stacks in
    `EXPERT_STACKS` (the router and a shared expert stay whole on every rank). LoRA leaves them alone."""
    experts, hidden, inner = model.moe.num_experts, model.hidden_size, model.expert_ffn_hidden_size
    shapes = {
        "mlp.router.weight": (experts, hidden),
        "mlp.experts.gate_proj": (experts, inner, hidden),
        "mlp.experts.up_proj": (experts, inner, hidden),
        "mlp.experts.down_proj": (experts, hidden, inner),
    }
    shared = model.moe.shared_expert_ffn_hidden_size
    if shared is not None:
        shapes["mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_expert.down_proj.weight"] = (hidden, shared)
        if model.moe.shared_expert_gate:
            shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _layer_rows(
    row, prefix: str, stage: int, hidden: int, shapes: dict, adapted: set[str], lora, experts: dict | None = None,
    sequence_parallel: bool = False,
) -> list[Placement]:
    """The rows of one transformer block, in the model's order (`BLOCK_PARAMETERS`; an MoE block's `experts`
    in place of its dense feed-forward)."""
    rows = []
    for path in BLOCK_PARAMETERS:
        if experts is not None and path in DENSE_FFN:
            continue
        if path not in TENSOR_PARALLEL_PLAN:  # a norm: on a slice of the sequence under sequence parallelism
            rows.append(row(f"{prefix}.{path}.weight", (hidden,), None, (stage,), partial=sequence_parallel))
            continue
        weight_axis, a_axis, b_axis = _AXES[TENSOR_PARALLEL_PLAN[path]]
        out_features, in_features = shapes[path]
        rows.append(row(f"{prefix}.{path}.weight", (out_features, in_features), weight_axis, (stage,)))
        if path in adapted:  # the adapter that is not split is used by the rank's block alone: a partial gradient
            rows.append(row(f"{prefix}.{path}.lora_a", (lora.rank, in_features), a_axis, (stage,), True, a_axis is None))
            rows.append(row(f"{prefix}.{path}.lora_b", (out_features, lora.rank), b_axis, (stage,), True, b_axis is None))
    for name, shape in (experts or {}).items():
        rows.append(row(f"{prefix}.{name}", shape, None, (stage,), expert=name in EXPERT_STACKS))
    return rows
