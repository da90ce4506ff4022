"""The memory planner behind `llmflow plan`: per-rank bytes of every valid parallel layout, and the one to use.

For a model (params.model), a micro-batch (params.train.micro_batch_size sequences of model.seq_len tokens
per data-parallel rank) and `devices` of `device_memory_bytes` each, `plan` lists every layout (dp, cp, tp, pp,
ZeRO stage, recompute none/all) with dp * cp * tp * pp == devices that the model allows, estimates the bytes of
its busiest rank, and recommends one. It counts from the params alone and runs nothing on a device, so it plans
for machines this process does not run on. docs/planner.md has a worked example and the CPU measurements.

The counts follow how llmflow's trainer holds memory. P is the parameters one rank of a pipeline stage holds
(attention and MLP matrices and the vocabulary split 1/tp, norm weights replicated; the embedding on the
first stage, the final norm and LM head on the last, where a tied head keeps a copy of the embedding when
pp > 1); c the bytes of compute_dtype; B T tokens per micro-batch; H hidden, F ffn_hidden_size, V vocabulary:

    parameters     fp32 training: 4P. Mixed precision (c != 4) under ZeRO-0/1/2 without pipeline, expert
                   parallelism or offload: the matmul weights Pm in the compute dtype, cPm, the rest (embedding,
                   norms) fp32; ZeRO-0 adds the optimizer's fp32 masters of the matmul weights, 4Pm (ZeRO-1/2 keep
                   only their shard's, counted under optimizer). Other mixed layouts: 4P fp32 + cP compute-dtype
                   copies the matmuls keep for the backward. ZeRO-3: 4P/dp
    gradients      4P accumulation buffer (ZeRO-2 and 3: 4P/dp) + in the backward the fresh gradients alive at once:
                   two layers' (`FRESH_GRADIENT_LAYERS`; every layer's where a step of one micro-batch sums them
                   inside its backward, `overlap_gradient_reduction`) and those of the weights outside the layers
                   (the final norm, the head, the embedding: a tied table's the head's, and where its lookup's
                   gradient is a dense table, tp or pp > 1, ZeRO-2 or a sum inside the backward, also the lookup's;
                   added into the buffer by rows it is B T H), in
                   the weights' dtypes and of the compute-dtype ones also their fp32 casts (ZeRO-2: the cast is its
                   bucket's input; ZeRO-3: none beside the shards). What only a CPU rank's peak RSS holds, the CPU
                   kind adds: the heap ZeRO-2's chain of bucket reduce-scatters leaves, 3.15P (fitted); ZeRO-3's
                   fresh gradient shards, 4P/dp; what ZeRO-1's first update adds (its compile and the pieces it cuts
                   from the gradient buffers, which the memory pool does not hold together), 4P/dp.
    optimizer      8P AdamW moments m and v; ZeRO-1 and up: 8P/dp (1/dp of the moments), and under ZeRO-1/2 with
                   compute-dtype weights 4P/dp more, the fp32 master weights of the shard; fp32 weights are updated
                   a bucket at a time in one scratch block of a bucket (parallel.gradient_bucket_mb / dp)
    activations    per layer and micro-batch, what the hand-written backwards of model_core.model.fused keep:
                   2 BTH fp32 (RMSNorm inputs) + 2 BTH c (the normed inputs of q/k/v and of gate/up)
                   + (4 BTH + 3 BTF) c / tp (q, k, v at all heads, the o_proj input; gate, up, the down input);
                   with sequence parallelism (tp > 1) the first two terms / tp (slices of the sequence);
                   with recompute=all, BTH c per layer (its input) + one layer's full set. With pp > 1 a
                   stage keeps only its input for each micro-batch in flight (BTH c; token ids on the first
                   stage) and recomputes its forward in the backward, so it holds one micro-batch's set on top;
                   in flight: pp - stage under 1F1B, micro_batches under GPipe.
                   The last stage adds the head's inputs, BTH (4 + c) (sequence parallelism: / tp),
                   and `logits_buffers` fp32 [B, T, V/tp]. Without a fused attention kernel (CPU):
                   `attention_score_buffers` fp32 tensors of one query block's scores [B, heads/tp, rows, T]
                   (`fused.query_block_rows`) for the layer whose attention runs, and
                   `attention_score_buffers_per_layer` [B, heads/tp, T/cp, T] ones for each layer (measured;
                   the backward recomputes the probabilities, so no layer should need to keep them).
    communication  dp > 1: two gradient buckets (the flat input and the summed output); ZeRO-3: two layers'
                   gathered parameters; tp > 1: two BTH c activations (sent and received; sequence parallelism
                   adds the BTH c / tp slice); pp > 1: a tick's
                   exchange, two fp32 BTH messages three times over (host buffer, its tensor, the sum);
                   ZeRO-1/2 in the update: one all-gathered bucket (parallel.gradient_bucket_mb), the slice of
                   it being written into a weight and that slice cast to the compute dtype
    runtime        the device kind's process baseline and its compiled graph's cost per layer (and per
                   recomputed layer; a pipeline stage's forward-only graph is charged like one); a rank of
                   a job of several ranks adds what its collectives hold (`collective_graph_bytes`)

Model states per parameter of a rank at its peak, many layers (one layer's and the table's fresh gradients a few
percent of P), on an accelerator, against the ZeRO paper's (Rajbhandari et al. 2020, Fig. 1: mixed precision with
Adam; fp32 training keeps no separate master):

    stage   fp32, llmflow   fp32, paper    mixed (c = 2), llmflow   mixed, paper
    0       16              16             18                       16
    1       8 + 8/dp        8 + 8/dp       6 + 12/dp                4 + 12/dp
    2       4 + 12/dp       4 + 12/dp      2 + 16/dp                2 + 14/dp
    3       16/dp           16/dp          16/dp                    16/dp

(mixed: every parameter a matmul weight; the fp32 embedding and norms count 4 where the table counts c.) What is
left over the paper: a full fp32 gradient buffer under ZeRO-1 where the paper reduce-scatters, and fp32 gradients
(4) where its mixed precision counts 2; mixed ZeRO-0 the fp32 masters beside the compute-dtype weights. On CPU peak
RSS also holds the heap ZeRO-2's bucket chain leaves (3.15, fitted), ZeRO-3's fresh gradient shards (4/dp), what
ZeRO-1's first update adds (4/dp) and a fixed graph cost per layer (ZeRO-3: more), none of them in MindSpore's
memory pool.
benchmarks/README.md ("Model states against the ZeRO paper") measures them.

Optimizer offload (`parallel.optimizer_offload`, `model_core/optim/offload.py`) is one more candidate for
layouts with ZeRO-2 or 3: the moments leave the device for host memory (on the CPU backend a memory-mapped
file on local disk), and the update streams them through 3 staging buckets of 4 MiB. Each step reads and
writes them, 2 x 8P/dp bytes, timed at the stated offload bandwidth. Offload comes after every layout that fits
without it, and is recommended only when the same layout without it needs at most `OFFLOAD_GAP` (20%) more
than the device has: a larger gap means the layout is wrong (more tensor or pipeline parallelism, more devices),
which is what the plan then says. Under ZeRO-3
without pipeline stages parameter offload (`parallel.param_offload`, `model_core/parallel/param_offload.py`) comes
after it: the rank's fp32 parameter shards (4P/dp) leave the device too, each read back for the forward's and
the backward's gather of every micro-batch and read and written by the update: 4P/dp x (2 x micro-batches + 2)
more bytes a step.

A rank peaks either in the backward (activations, fresh gradients, gradient buckets) or in the update (no
activations, but ZeRO's all-gather); the estimate is the larger of the two, on the busiest stage. A device
kind scales the counted activations by what it was measured to hold: the CPU constants are fitted to peak
RSS of real training steps (how closely: benchmarks/README.md, "Rank memory"; tests/test_planner.py
re-measures); accelerators are counted, and their runtime's own reserve is the caller's `runtime_bytes`.

Mixture-of-experts models add expert parallelism (ep, carved out of dp: `model_core.parallel.expert`): the
expert stacks' parameters, gradients and moments count 1/ep on a rank (and their ZeRO-1 shard 1/(dp/ep) of
that), every ep dividing both dp and the number of experts, with the ep group (ep x tp consecutive ranks) inside
a node. Each MoE block sends its [E, C, hidden] dispatch buffer through two all-to-alls in the forward and two
in the backward per micro-batch, (ep - 1)/ep of it leaving the rank each time: 4 E C H c (ep - 1)/ep bytes, which
is f k B T H c x 4 (ep - 1)/ep at capacity factor f (dropless: C = B T). `Estimate.all_to_all_bytes_per_step`
sums them over the MoE blocks and a step's micro-batches. ep is added only where the experts do not fit under
dp alone: it comes after tp and pp in the order below, so the plan prefers ep1, then the smallest ep that fits.

Context parallelism (cp, `model_core.parallel.context`) cuts every sequence over cp ranks: each holds B T / cp
tokens of every micro-batch, so every activation above is divided by cp, except what attention gathers: each layer
keeps the whole sequence's keys and values for its backward, 2 B T (kv_heads x head_dim) c / tp, of which a
(cp - 1) / cp share comes from the other ranks, and the mask of its queries against every key with its fp32 bias,
B (T / cp) T x 5 bytes (alive once, shared by the layers). The weights are replicated over cp as over dp: ZeRO
shards over dp x cp. Each layer's forward all-gathers its keys and values and its backward reduce-scatters their
gradients (a recomputed layer gathers again): `context_bytes_per_step` counts what a rank receives, and the
communication column one layer's gathered K and V. cp ranks sit next to tp inside a node (cp x tp <= devices per
node). cp is the last resort: the plan adds layouts with cp > 1 only when no layout without it fits (or when asked
for them), and prefers any layout without cp that fits, so it recommends cp when a sequence's activations do not
fit otherwise.

Preference among layouts that fit follows how the field fits a model into device memory: data parallel first,
ZeRO stages 1, 2, 3 to shard what data parallel replicates, then recompute, and only then tensor parallelism inside
a node, pipeline stages, expert parallelism and, last, offload. So the plan takes the fewest pipeline stages, then
the smallest tensor-parallel degree, then the smallest ep; within those degrees ZeRO-1 (ZeRO-0 only where ZeRO-1's
gather of the updated parameters does not fit), ZeRO-2, ZeRO-3, each without recompute before any with it. ZeRO-2
and 3 repeat collectives every accumulated micro-batch (ZeRO-3 gathers every weight in each forward and backward),
but that costs less than the activation traffic of tensor parallelism or a pipeline's bubble; the trainer runs
ZeRO-2 with pp = 1 and ZeRO-3 with tp = pp = 1. When nothing fits the plan says so and names the smallest layout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from model_core.model.fused import query_block_rows
from model_core.parallel.layout import Layout
from model_core.parallel.placement import placement_table
from params import rules
from params.schema import ModelParams, ParallelParams, PipelineParams

GIB = 2**30
_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE_MODES = ("none", "all")
ZERO_ORDER = (1, 0, 2, 3)  # with dp > 1: ZeRO-1 shards the moments for free; 2 and 3 add collectives per micro-batch
# Layers whose fresh gradients a backward holds at once: the one whose backward runs and the one whose gradients
# are being added into their buffers (benchmarks/README.md, "Model states against the ZeRO paper").
FRESH_GRADIENT_LAYERS = 2
OFFLOAD_GAP = 0.20  # offload is advised only when the layout without it is at most this much over the device
OFFLOAD_STAGING_BYTES = 3 * 4 * 2**20  # model_core/optim/offload.py: three 4 MiB staging buckets
# Stated bandwidths the offload traffic is timed at: host <-> device over PCIe 4.0 x16 (~25 GB/s of its 32), and
# a local NVMe drive (~2 GB/s) where host memory is the device (the CPU backend offloads to disk).
OFFLOAD_BANDWIDTH = {"accelerator": 25e9, "cpu": 2e9}


def parse_bytes(text: str) -> int:
    """"64GiB" -> 68719476736, "80GB" -> 80000000000, "512MiB", "1.5TiB", "4096" (plain bytes)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: give a number and one of B, KB, MB, GB, TB (powers of 1000) "
            "or KiB, MiB, GiB, TiB (powers of 1024), e.g. 64GiB"
        )
    size = float(match.group(1)) * _UNITS[unit]
    if size < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return int(size)


@dataclass(frozen=True)
class DeviceKind:
    """What a device adds to the counted tensors: its runtime's memory, and how its kernels hold activations."""

    name: str
    runtime_bytes: int  # the process or runtime before any model tensor
    runtime_bytes_per_layer: int  # the compiled train step's own memory per transformer block
    recompute_bytes_per_layer: int  # what marking a block for recompute adds to the compiled graph
    activation_factor: float  # bytes held per counted activation byte of the blocks
    logits_buffers: float  # fp32 logits-sized tensors alive at the loss's backward
    recompute_saves_memory: bool  # False where recompute was measured to keep the activations anyway
    source: str  # where the numbers come from
    # Attention without a fused kernel (`fused.SoftmaxAttentionFunction`): fp32 tensors of one query block's scores
    # ([B, heads / tp, rows, T]) alive while one layer's attention runs, and fp32 [B, heads / tp, T / cp, T] score-sized
    # ones each layer holds until its backward (measured, not explained: see docs/planner.md); 0 where a fused kernel
    # keeps none.
    attention_score_buffers: float = 0.0
    attention_score_buffers_per_layer: float = 0.0
    collective_runtime_bytes: int = 0  # what a rank of a job of several ranks holds over one process
    # What a layer's collectives add to the compiled step: tensor parallelism's all-reduces, sequence parallelism's
    # gathers and reduce-scatters (over tp's), context parallelism's key/value gathers.
    tensor_parallel_bytes_per_layer: int = 0
    sequence_parallel_bytes_per_layer: int = 0
    context_parallel_bytes_per_layer: int = 0
    zero3_bytes_per_layer: int = 0  # what a layer's ZeRO-3 gathers and reduce-scatters add to the compiled step
    # What peak RSS on CPU holds of the reduce-scatters' host memory beyond the counted tensors, bytes a parameter of
    # the stage (ZeRO-2: the heap its bucket chain's flat fp32 inputs and sums leave behind the backward, on which the
    # update's first compile then sits; fitted) or of its shard (ZeRO-3: the fresh gradient shards). MindSpore's
    # memory pool, what a device would hold, does not hold them (benchmarks/rank_memory.py --states, `acc plan`).
    zero2_bucket_chain_bytes: float = 0
    zero3_fresh_shard_bytes: int = 0
    # What a CPU rank's peak RSS grows by in ZeRO-1's first update beyond the counted tensors, bytes a parameter of
    # the shard: its compile and the pieces it cuts from the gradient buffers, which the memory pool does not hold
    # together (benchmarks/rank_memory.py --states).
    zero1_update_piece_bytes: int = 0


# Fitted (least squares on relative error) to the peak RSS of single-process training steps (model_core.optim.step
# with AdamW under jit, fp32) on MindSpore 2.10, 2-core x86: 0.25M-29.4M parameters, micro-batches 1-32, 1-8
# layers, vocabularies 512-16384, with and without recompute; docs/planner.md lists them with their errors.
# recompute=all under jit was measured to *raise* peak memory: the blocks keep their activations and the
# recomputed forward adds graph, so the CPU kind keeps the full activations and charges that graph per layer.
CPU = DeviceKind(
    name="cpu",
    runtime_bytes=530 * 2**20,
    runtime_bytes_per_layer=53 * 2**20,
    recompute_bytes_per_layer=42 * 2**20,
    activation_factor=1.96,
    logits_buffers=4.8,
    recompute_saves_memory=False,
    source="fitted to measured peak RSS of MindSpore 2.10 CPU training steps, docs/planner.md",
    # Fitted to benchmarks/long_context.py (8 layers, sequences of 256 and 2048, cp1, cp2, tp2, tp2 with sp) with
    # attention computed in query blocks; the collective terms below to its earlier runs (also 2 layers).
    attention_score_buffers=1.5,
    attention_score_buffers_per_layer=0.30,
    collective_runtime_bytes=30 * 2**20,
    tensor_parallel_bytes_per_layer=8 * 2**20,
    sequence_parallel_bytes_per_layer=24 * 2**20,
    context_parallel_bytes_per_layer=34 * 2**20,
    # Fitted to benchmarks/rank_memory.py --states at two layer shapes and two depths each, then to its 8-layer model
    # (benchmarks/README.md, "Model states against the ZeRO paper"): what the peak grows by per ZeRO-3 layer beyond
    # ZeRO-0's.
    zero3_bytes_per_layer=56 * 2**20,
    # Fitted to the same model's ZeRO-2 ranks (benchmarks/README.md, the same section).
    zero2_bucket_chain_bytes=3.15,
    zero3_fresh_shard_bytes=4,
    zero1_update_piece_bytes=4,
)
# Accelerators are counted, not measured: exactly the tensors the module docstring lists, and the four
# logits-sized fp32 tensors TokenNLLFunction's backward holds at once (logits, probabilities, one-hot, their
# difference). The runtime's own reserve is the caller's `runtime_bytes`: none is measured here.
ACCELERATOR = DeviceKind(
    name="accelerator",
    runtime_bytes=0,
    runtime_bytes_per_layer=0,
    recompute_bytes_per_layer=0,
    activation_factor=1.0,
    logits_buffers=4.0,
    recompute_saves_memory=True,
    source="counted tensors; the runtime's own reserve only as given",
)
DEVICE_KINDS = {kind.name: kind for kind in (CPU, ACCELERATOR)}


@dataclass(frozen=True)
class Candidate:
    """One way to run: the three degrees, the ZeRO stage over dp, and recompute."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    recompute: str
    offload: bool = False  # the optimizer's moments off the device
    ep: int = 1  # expert-parallel ranks, out of dp
    param_offload: bool = False  # ZeRO-3: the parameter shards off the device too (with `offload`)
    cp: int = 1  # context-parallel ranks: each holds 1 / cp of every sequence

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights (dp x cp), over which ZeRO shards them."""
        return self.dp * self.cp

    def preference(self) -> tuple[int, ...]:
        """Smaller is preferred, in the order the field fits a model: less context parallelism (cp only where
        nothing without it fits), offload last (optimizer offload before parameter offload), then fewer pipeline
        stages, then less tensor parallelism, then less expert parallelism; within those degrees, data parallel
        sharded by ZeRO 1 -> 2 -> 3 (ZeRO-0 only after ZeRO-1), and only then recompute."""
        return (
            self.cp, int(self.offload) + int(self.param_offload), self.pp, self.tp, self.ep,
            RECOMPUTE_MODES.index(self.recompute), ZERO_ORDER.index(self.zero_stage),
        )

    def __str__(self) -> str:
        offload = " offload=optimizer" if self.offload else ""
        offload += "+parameters" if self.param_offload else ""
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        return (f"dp{self.dp}{context} tp{self.tp} pp{self.pp}{experts} zero{self.zero_stage} "
                f"recompute={self.recompute}{offload}")


CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "runtime")


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at one moment, by category; `phase` says which moment (backward or update)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    communication: int
    runtime: int
    phase: str

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)


@dataclass(frozen=True)
class Estimate:
    """A candidate's busiest rank: its pipeline stage and bytes, and whether they fit one device."""

    candidate: Candidate
    stage: int
    memory: Memory
    fits: bool
    offload_bytes_per_step: int = 0  # moments (and parameter shards) read and written per step (offload candidates)
    without_offload: int = 0  # bytes the same layout needs without offload (offload candidates)
    all_to_all_bytes_per_step: int = 0  # sent by one rank through expert parallelism's all-to-alls
    context_bytes_per_step: int = 0  # received by one rank through context parallelism's K/V gathers and scatters

    def offload_gap(self, device_memory_bytes: int) -> float:
        """How far over the device the layout is without offload, as a fraction of the device (0 when it fits)."""
        return max(self.without_offload / device_memory_bytes - 1.0, 0.0)


@dataclass(frozen=True)
class Excluded:
    """Degrees that cannot run this model, and why."""

    dp: int
    tp: int
    pp: int
    reason: str
    cp: int = 1


@dataclass(frozen=True)
class Plan:
    devices: int
    device_memory_bytes: int
    devices_per_node: int
    device_kind: DeviceKind
    runtime_bytes: int
    estimates: tuple[Estimate, ...]  # in order of preference
    excluded: tuple[Excluded, ...]

    offload_bandwidth: float = OFFLOAD_BANDWIDTH["accelerator"]

    def advisable(self, e: Estimate) -> bool:
        """It fits, and if it offloads, the layout without offload is within `OFFLOAD_GAP` of the device."""
        return e.fits and (not e.candidate.offload or e.offload_gap(self.device_memory_bytes) <= OFFLOAD_GAP)

    @property
    def recommended(self) -> Estimate | None:
        """The most preferred estimate that fits (offload only within the gap rule)."""
        return next((e for e in self.estimates if self.advisable(e)), None)

    @property
    def offload_note(self) -> str | None:
        """What offload costs when it is recommended, or why it is not when it alone would fit."""
        chosen = self.recommended
        if chosen is not None and chosen.candidate.offload:
            seconds = chosen.offload_bytes_per_step / self.offload_bandwidth
            return (
                f"offload moves {_gib(chosen.offload_bytes_per_step)} GiB of optimizer state"
                f"{' and parameters' if chosen.candidate.param_offload else ''} per step "
                f"({seconds:.2f} s at {self.offload_bandwidth / 1e9:.0f} GB/s); without it this layout needs "
                f"{_gib(chosen.without_offload)} GiB, {chosen.offload_gap(self.device_memory_bytes):.0%} over"
            )
        fitting = [e for e in self.estimates if e.fits and e.candidate.offload]
        if chosen is None and fitting:
            closest = min(fitting, key=lambda e: e.without_offload)
            return (
                f"{closest.candidate} would fit, but without offload it needs {_gib(closest.without_offload)} GiB, "
                f"{closest.offload_gap(self.device_memory_bytes):.0%} over the device (offload pays off within "
                f"{OFFLOAD_GAP:.0%}): change the layout instead (more tensor or pipeline parallelism, more devices)"
            )
        return None

    @property
    def smallest(self) -> Estimate | None:
        """The lowest total, fitting or not."""
        return min(self.estimates, key=lambda e: e.memory.total, default=None)

    @property
    def summary(self) -> str:
        memory = f"{self.devices} x {_gib(self.device_memory_bytes)} GiB"
        chosen, smallest = self.recommended, self.smallest
        if smallest is None:
            return f"no layout of {self.devices} devices is valid for this model (see the excluded list)"
        if chosen is None:
            return (
                f"nothing fits {memory}: the smallest is {smallest.candidate}, "
                f"{_gib(smallest.memory.total)} GiB on its busiest rank (stage {smallest.stage})"
            )
        return (
            f"recommended for {memory}: {chosen.candidate}, "
            f"{_gib(chosen.memory.total)} GiB on its busiest rank (stage {chosen.stage})"
        )


# ------------------------------------------------------------------------------------------ validity


def layout_problems(params: PipelineParams, dp: int, tp: int, pp: int, devices_per_node: int, cp: int = 1) -> list[str]:
    """Why these degrees cannot run this model (empty when they can): the rule book's reasons, and a tp group
    (with cp: cp x tp ranks) that would not fit in one node."""
    parallel = params.parallel.model_copy(update={
        "data_parallel": dp, "tensor_parallel": tp, "pipeline_parallel": pp, "pipeline_layers": None,
        "expert_parallel": 1, "zero_stage": 0, "optimizer_offload": False, "param_offload": False,
        "context_parallel": cp,
    })
    problems = rules.parallel_problems(parallel) + rules.layout_problems(params.model, parallel)
    if cp * tp > devices_per_node:
        group = f"context_parallel={cp} x tensor_parallel={tp}" if cp > 1 else f"tensor_parallel={tp}"
        problems.append(f"{group} is more than the {devices_per_node} devices of one node")
    return problems


def degrees(devices: int, context: bool = False) -> list[tuple[int, int, int, int]]:
    """Every (dp, tp, pp, cp) with dp * cp * tp * pp == devices; cp = 1 unless `context`."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    return [
        (devices // (cp * tp * pp), tp, pp, cp)
        for cp in (divisors if context else [1]) for pp in divisors for tp in divisors
        if devices % (cp * tp * pp) == 0
    ]


def candidates(dp: int, tp: int, pp: int, model: ModelParams | None = None, devices_per_node: int = 8,
               cp: int = 1) -> list[Candidate]:
    """ZeRO stages 0-3 where there is a dp group to shard over (only 0 for dp=1), each with and without recompute,
    for a model with MoE blocks under every expert-parallel degree that divides dp and the experts and keeps the
    ep group (ep x tp ranks) inside a node; with ZeRO-2/3 each also with optimizer offload, with ZeRO-3 also with
    parameter offload: those of them the rule book (params/rules.py) lets run together."""
    stages = range(4) if dp * cp > 1 else (0,)
    expert_degrees = [1]
    if model is not None and model.moe_layers:
        experts = model.moe.num_experts
        expert_degrees = [ep for ep in range(1, dp + 1) if dp % ep == 0 and experts % ep == 0 and ep * tp <= devices_per_node]
    plain = [Candidate(dp, tp, pp, stage, mode, ep=ep, cp=cp)
             for ep in expert_degrees for stage in stages for mode in RECOMPUTE_MODES]
    offloaded = [replace(c, offload=True) for c in plain if c.zero_stage >= 2]
    every = plain + offloaded + [replace(c, param_offload=True) for c in offloaded if c.zero_stage == 3]
    return [c for c in every if runs_together(c, model)]


def runs_together(candidate: Candidate, model: ModelParams | None) -> bool:
    """Whether the rule book lets the candidate's features run together (`layout_problems` judged its degrees)."""
    c = candidate
    parallel = ParallelParams.model_construct(  # unvalidated: judging it is the rule book's job
        data_parallel=c.dp, tensor_parallel=c.tp, pipeline_parallel=c.pp, micro_batches=c.pp, expert_parallel=c.ep,
        zero_stage=c.zero_stage, optimizer_offload=c.offload, param_offload=c.param_offload, context_parallel=c.cp,
    )
    problems = rules.parallel_problems(parallel)
    if model is not None:
        problems += rules.expert_problems(c.ep, c.zero_stage, model)
    return not problems


# ----------------------------------------------------------------------------------------- estimates


def stage_parameters(model: ModelParams, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameter elements on one rank of pipeline stage `stage` (equal stages), read from the placement table."""
    return sum(stage_parameter_split(model, tp, pp, stage, ep))


def stage_parameter_split(model: ModelParams, tp: int, pp: int, stage: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameter elements on one rank of stage `stage`: expert stacks are this rank's 1/ep."""
    table = placement_table(model, Layout(dp=ep, tp=tp, pp=pp, ep=ep))
    held = [(row.expert, math.prod(row.block_shape(tp, ep))) for row in table.on_stage(stage)]
    return sum(n for expert, n in held if not expert), sum(n for expert, n in held if expert)


def masters_apart(params: PipelineParams, candidate: Candidate) -> bool:
    """Whether the layout keeps compute-dtype matmul weights and their fp32 masters in the optimizer
    (`parallelize.keeps_masters_apart`, which the planner cannot call: it builds no model)."""
    return (
        params.precision.compute_dtype != "float32" and candidate.zero_stage < 3 and candidate.pp == 1
        and candidate.ep == 1 and not candidate.offload and not candidate.param_offload
    )


def stage_matmul_parameters(model: ModelParams, tp: int, stage: int, zero_stage: int = 0) -> int:
    """Elements of the weights `parallelize.to_compute_dtype` keeps in the compute dtype on one rank of a
    single-stage layout: the dense matmul weights (the attention and MLP projections, an untied LM head) and, where
    the step takes its gradient by rows (`rows_gradient`), the embedding table."""
    table = placement_table(model, Layout(tp=tp))
    by_rows = rows_gradient(tp, 1, zero_stage)
    return sum(math.prod(row.block_shape(tp, 1)) for row in table.on_stage(stage)
               if not row.expert and (row.name.endswith("_proj.weight") or row.name == "lm_head.weight"
                                      or (by_rows and row.name == "embed_tokens.weight")))


def rows_gradient(tp: int, pp: int, zero_stage: int) -> bool:
    """Whether the step takes the embedding's gradient by rows (`model_core.optim.step.rows_table`): where the
    model looks its tokens up in a whole table of its own, so not under tensor parallelism (vocab-parallel), a
    pipeline (the stage's own backward) or ZeRO-3 (a gathered table)."""
    return tp == 1 and pp == 1 and zero_stage < 3


def expert_parameters(model: ModelParams) -> int:
    """Elements of every MoE block's expert stacks (what expert parallelism shares out)."""
    return sum(row.size for row in placement_table(model, Layout()) if row.expert)


def all_to_all_bytes_per_step(params: PipelineParams, ep: int, pp: int = 1, stage: int = 0) -> int:
    """Bytes one rank of pipeline stage `stage` sends per optimizer step through expert parallelism's all-to-alls
    (module docstring): its stage's MoE blocks only, and under pp six exchanges per block and micro-batch, not
    four, as a stage's backward recomputes its forward."""
    model = params.model
    if ep == 1 or not model.moe_layers:
        return 0
    tokens = params.train.micro_batch_size * model.seq_len
    buffer = model.moe.num_experts * model.moe.capacity(tokens) * model.hidden_size * _DTYPE_BYTES[params.precision.compute_dtype]
    micro_batches = params.parallel.micro_batches * params.train.grad_accum_steps
    per_stage = model.num_layers // pp
    blocks = sum(1 for layer in model.moe_layers if stage * per_stage <= layer < (stage + 1) * per_stage)
    exchanges = 6 if pp > 1 else 4
    return exchanges * blocks * micro_batches * buffer * (ep - 1) // ep


def layer_activation_bytes(params: PipelineParams, tp: int, cp: int = 1) -> int:
    """Bytes one layer's backward keeps for one micro-batch, without recompute (module docstring); under cp, of
    this rank's 1 / cp of the sequence, and the keys and values gathered from the other cp ranks."""
    model, c = params.model, _DTYPE_BYTES[params.precision.compute_dtype]
    tokens = params.train.micro_batch_size * model.seq_len // cp
    hidden, ffn = model.hidden_size, model.ffn_hidden_size
    replicated = 2 * tokens * hidden * 4 + 2 * tokens * hidden * c - sequence_parallel_saving(params, tp)
    split = (4 * tokens * hidden + 3 * tokens * ffn) * c // tp + gathered_kv_bytes(params, tp, cp) * (cp - 1) // cp
    if not model.moe_layers:
        return replicated + split
    # An MoE block keeps, in place of the dense 3 BTF: its expert slots' inputs and outputs (2 S H) and the
    # experts' gate, up and down inputs (3 S F), S = E x capacity slots, plus the router's fp32 logits and
    # probabilities (2 BT E x 4), and a shared expert's. Averaged over the model's blocks, dense and MoE.
    experts, inner = model.moe.num_experts, model.expert_ffn_hidden_size
    slots = experts * model.moe.capacity(tokens)
    moe = replicated + 4 * tokens * hidden * c + (2 * slots * hidden + 3 * slots * inner) * c + 2 * tokens * experts * 4
    moe += 3 * tokens * (model.moe.shared_expert_ffn_hidden_size or 0) * c  # a shared expert's gate, up, down inputs
    blocks = len(model.moe_layers)
    return ((model.num_layers - blocks) * (replicated + split) + blocks * moe) // model.num_layers



def gathered_kv_bytes(params: PipelineParams, tp: int, cp: int) -> int:
    """One layer's keys and values of the whole sequence of a micro-batch (1 / tp of the kv heads), as a cp rank
    gathers them; 0 without cp."""
    if cp == 1:
        return 0
    model, c = params.model, _DTYPE_BYTES[params.precision.compute_dtype]
    return 2 * params.train.micro_batch_size * model.seq_len * model.num_kv_heads * model.head_dim * c // tp


def context_mask_bytes(params: PipelineParams, cp: int) -> int:
    """The cp attention mask of a rank's queries against every key (bool) and its fp32 additive bias."""
    if cp == 1:
        return 0
    seq = params.model.seq_len
    return params.train.micro_batch_size * (seq // cp) * seq * (1 + 4)


def context_bytes_per_step(params: PipelineParams, candidate: Candidate, stage: int = 0) -> int:
    """Bytes one rank receives per optimizer step through cp: every layer of its stage gathers the other ranks'
    keys and values in the forward (again when recomputed, and under pp, whose backward recomputes the forward)
    and receives their share of its keys' and values' gradients in the backward."""
    cp = candidate.cp
    if cp == 1:
        return 0
    layers = params.model.num_layers // candidate.pp
    micro_batches = params.parallel.micro_batches * params.train.grad_accum_steps
    passes = 2 + int(candidate.recompute == "all" or candidate.pp > 1)
    return passes * layers * micro_batches * gathered_kv_bytes(params, candidate.tp, cp) * (cp - 1) // cp


# ---- sequence parallelism: what lies between the tp regions (the residual stream, the norms) held as 1/tp slices


def sequence_slices(params: PipelineParams, tp: int) -> int:
    """Into how many slices of the sequence a rank's residual stream is cut: tp under sequence parallelism, else 1."""
    return tp if params.parallel.sequence_parallel else 1


def sequence_parallel_saving(params: PipelineParams, tp: int) -> int:
    """Bytes of one layer's kept activations that sequence parallelism takes off a rank (module docstring): what
    lies between the tp regions, the two RMSNorms' fp32 inputs (2 BTH x 4) and the normed inputs of q/k/v and
    gate/up (2 BTH c, which the projections keep as slices and gather again in the backward), held as 1/tp
    slices of the sequence."""
    c = _DTYPE_BYTES[params.precision.compute_dtype]
    between = 2 * params.train.micro_batch_size * params.model.seq_len * params.model.hidden_size * (4 + c)
    return between - between // sequence_slices(params, tp)


def sequence_parallel_buffer_bytes(params: PipelineParams, tp: int) -> int:
    """What sequence parallelism adds to tp's communication buffers: the slice sent into an all-gather or kept from
    a reduce-scatter, BTH c / tp, beside the whole-sequence buffer tp's all-reduce already counts."""
    if sequence_slices(params, tp) == 1:
        return 0
    tokens = params.train.micro_batch_size * params.model.seq_len
    return tokens * params.model.hidden_size * _DTYPE_BYTES[params.precision.compute_dtype] // tp


def activation_bytes(params: PipelineParams, candidate: Candidate, stage: int, kind: DeviceKind) -> int:
    """Bytes the backward of pipeline stage `stage` keeps: its blocks' for one micro-batch (pp = 1: for each
    accumulated one in turn), the inputs of the micro-batches in flight (pp > 1), and on the last stage the
    head's inputs and the logits (module docstring)."""
    model, parallel = params.model, params.parallel
    c = _DTYPE_BYTES[params.precision.compute_dtype]
    tokens = params.train.micro_batch_size * model.seq_len // candidate.cp
    layers = model.num_layers // candidate.pp
    per_layer = layer_activation_bytes(params, candidate.tp, candidate.cp)
    slices = sequence_slices(params, candidate.tp)  # a layer's input, a stage's messages: slices under sp
    if candidate.recompute == "all" and kind.recompute_saves_memory:
        per_micro_batch = layers * tokens * model.hidden_size * c // slices + per_layer
    else:
        per_micro_batch = layers * per_layer
    blocks = per_micro_batch + context_mask_bytes(params, candidate.cp)
    scores = (kind.attention_score_buffers * attention_block_score_bytes(params, candidate)
              + kind.attention_score_buffers_per_layer * layers * attention_score_bytes(params, candidate))
    if candidate.pp > 1:
        in_flight = parallel.micro_batches if parallel.pipeline_schedule == "gpipe" else candidate.pp - stage
        stored_input = tokens * 4 if stage == 0 else tokens * model.hidden_size * c // slices
        blocks += in_flight * stored_input
    if stage < candidate.pp - 1:
        return int(kind.activation_factor * blocks + scores)
    # The final norm's fp32 input and the head's input (slices of the sequence under sequence parallelism).
    head_inputs = tokens * model.hidden_size * (4 + c) // slices
    logits = tokens * math.ceil(model.vocab_size / candidate.tp) * 4
    return int(kind.activation_factor * (blocks + head_inputs) + scores + kind.logits_buffers * logits)


def attention_score_bytes(params: PipelineParams, candidate: Candidate) -> int:
    """One fp32 tensor of attention scores of a micro-batch on a rank: [B, heads / tp, T / cp, T] (the local
    queries against every key)."""
    model = params.model
    heads = model.num_heads // candidate.tp
    return params.train.micro_batch_size * heads * (model.seq_len // candidate.cp) * model.seq_len * 4


def attention_block_score_bytes(params: PipelineParams, candidate: Candidate) -> int:
    """The fp32 scores of one query block of `fused.SoftmaxAttentionFunction` on a rank: [B, heads / tp, rows, T],
    rows as `fused.query_block_rows` picks them (all T / cp where they fit its budget)."""
    model, batch = params.model, params.train.micro_batch_size
    heads = model.num_heads // candidate.tp
    rows = query_block_rows(batch, heads, model.seq_len, model.seq_len // candidate.cp)
    return batch * heads * rows * model.seq_len * 4


def stage_memory(params: PipelineParams, candidate: Candidate, stage: int, kind: DeviceKind, runtime: int) -> Memory:
    """Bytes of one rank of `stage` under `candidate` at the larger of its two peaks (`stage_phases`)."""
    return max(stage_phases(params, candidate, stage, kind, runtime), key=lambda memory: memory.total)


def stage_phases(
    params: PipelineParams, candidate: Candidate, stage: int, kind: DeviceKind, runtime: int
) -> tuple[Memory, Memory]:
    """Bytes of one rank of `stage` under `candidate` at its two peaks: the backward (activations, fresh gradients,
    gradient buckets) and the update (ZeRO-1's scaled gradient pieces, ZeRO-1/2's bucketed gather of the updated
    shards)."""
    c = _DTYPE_BYTES[params.precision.compute_dtype]
    dp, zero = candidate.replicas, candidate.zero_stage  # ZeRO shards over dp x cp
    dense, experts = stage_parameter_split(params.model, candidate.tp, candidate.pp, stage, candidate.ep)
    held = dense + experts
    shard = math.ceil(dense / dp) + math.ceil(experts / (dp // candidate.ep))  # expert shards over expert-dp
    apart = masters_apart(params, candidate)
    if apart:
        # The model holds its matmul weights (and a table taken by rows) in the compute dtype and the rest in fp32;
        # their fp32 masters are the optimizer's: ZeRO-0 all of them, ZeRO-1/2 their shard's, under "optimizer".
        matmul = stage_matmul_parameters(params.model, candidate.tp, stage, candidate.zero_stage)
        working = c * matmul + 4 * (held - matmul)
        masters = working + (4 * matmul if zero == 0 else 0)
        compute_copies = 0
    else:
        masters = 0 if candidate.param_offload else 4 * (shard if zero == 3 else held)  # a fetched shard: communication
        compute_copies = c * held if c != 4 and zero < 3 else 0
    layers = params.model.num_layers // candidate.pp
    recompute_graph = kind.recompute_bytes_per_layer * layers if candidate.recompute == "all" else 0
    if candidate.pp > 1:  # a stage compiles a forward-only graph too (its backward recomputes the forward)
        recompute_graph += kind.recompute_bytes_per_layer * layers
    accumulated = 4 * (shard if zero >= 2 else held)  # the fp32 buffers the micro-batches add into
    bucket_chain = int(kind.zero2_bucket_chain_bytes * held) if zero == 2 else 0  # scales with P
    # Summed inside the backward (`parallel.overlap_gradient_reduction`), a bucket's gradients wait for the end of
    # the backward (`data_parallel`): counted as every layer's, the bound they approach with depth.
    summed_inside = (params.parallel.overlap_gradient_reduction and zero < 2 and candidate.pp == 1
                     and params.parallel.micro_batches == 1 and dp * candidate.tp > 1)
    fresh = (kind.zero3_fresh_shard_bytes * shard if zero == 3
             else fresh_gradient_bytes(params, candidate, stage, apart, every_layer=summed_inside))
    fresh += bucket_chain
    state = {
        # AdamW's two moments of what this rank updates; ZeRO-1/2 also keep the fp32 masters of their shard where
        # the weights are in the compute dtype, and otherwise update their fp32 weights' shard a bucket at a time
        # in one scratch block; under ZeRO-3 the shard is the weight itself.
        "optimizer": OFFLOAD_STAGING_BYTES if candidate.offload
        else 8 * shard + ((4 * shard if apart else update_block_bytes(params, dp, shard)) if zero in (1, 2) else 0)
        if zero >= 1 else 8 * held,
        "runtime": runtime + kind.runtime_bytes_per_layer * layers + recompute_graph
        + collective_graph_bytes(params, candidate, kind, layers)
        + (kind.zero3_bytes_per_layer * layers if zero == 3 else 0),
    }
    backward = Memory(
        parameters=masters + compute_copies,
        gradients=accumulated + fresh,
        activations=activation_bytes(params, candidate, stage, kind),
        communication=backward_communication_bytes(params, candidate, held),
        phase="backward",
        **state,
    )
    # ZeRO-1/2 gather the updated shards back in buckets.
    gathered = shard_gather_bytes(held, dp, bucket_bytes(params), c) if dp > 1 and zero in (1, 2) else 0
    pieces = kind.zero1_update_piece_bytes * shard if dp > 1 and zero == 1 and not candidate.offload else 0
    update = Memory(parameters=masters, gradients=accumulated + pieces, activations=0, communication=gathered,
                    phase="update", **state)
    return backward, update


def fresh_gradient_bytes(params: PipelineParams, candidate: Candidate, stage: int, apart: bool,
                         every_layer: bool = False) -> int:
    """What a ZeRO-0/1/2 backward holds of fresh gradients beside the fp32 buffers: the backward adds each gradient
    into its buffer (ZeRO-2: into its bucket) last weight first, as it makes them, and frees it, so what is alive
    at once is `FRESH_GRADIENT_LAYERS` layers' gradients and those of the weights outside the layers (the
    embedding, the final norm, the head; a tied table has two, the head's and the lookup's), not a set for the
    whole model (benchmarks/README.md, "Model states against the ZeRO paper": the backward's memory grows with
    the layers by a fixed graph cost, not by their gradients). Each is in its weight's dtype and, where
    `apart`, a compute-dtype one also as its fp32 cast, except under ZeRO-2, where the cast is its bucket's input
    (counted as communication, and on CPU in the bucket chain's host memory, `stage_phases`). Where the rows are
    added into the table's buffer, a tied table's head gradient is added first, before the layers' exist
    (`step.backward_order`): it counts against them, not beside them; a dense table gradient waits for the lookup's.
    So does an untied head's wherever `AccumulateGradients` adds the gradients (ZeRO-0/1, one stage, not summed in
    the backward): the head is the last weight, and its gradient the backward's first. Under ZeRO-2 a tied table's
    head gradient is reduced ahead of the chain and the rows' table gradient after the layers': neither beside them.
    `every_layer`: every layer's gradients, where the backward also sums them (`overlap_gradient_reduction`)."""
    c = _DTYPE_BYTES[params.precision.compute_dtype]
    table = placement_table(params.model, Layout(dp=candidate.ep, tp=candidate.tp, pp=candidate.pp, ep=candidate.ep))
    rows = [row for row in table.on_stage(stage) if row.trainable]
    layer_rows = {}
    for row in rows:
        if row.name.startswith("layers."):
            layer_rows.setdefault(row.name.split(".")[1], []).append(row)
    kept = [row for row in rows if not row.name.startswith("layers.")]
    held_layers = sorted(layer_rows, key=int)
    for index in held_layers if every_layer else held_layers[-FRESH_GRADIENT_LAYERS:]:  # the backward starts last
        kept += layer_rows[index]
    # Where the rows are added into the table's buffer in place; a gradient that travels densely (ZeRO-2's
    # reduce-scatter, a sum inside the backward) is a table-sized sum of them and the head's, as a dense lookup's is.
    rows_taken = rows_gradient(candidate.tp, candidate.pp, candidate.zero_stage)
    by_rows = rows_taken and candidate.zero_stage != 2 and not every_layer
    # A table taken by rows is held in the compute dtype (`stage_matmul_parameters`), and so is its head gradient.
    compute_table = apart and rows_taken
    added_in_order = candidate.zero_stage < 2 and candidate.pp == 1 and not every_layer
    # ZeRO-2 reduces a tied table's head gradient ahead of its bucket chain (`zero.GradientShards.early`) and the rows'
    # dense table gradient once the backward has made it: each at a different time from the layers'.
    apart_in_time = rows_taken and candidate.zero_stage == 2 and candidate.ep == 1 and params.model.tie_embeddings
    total = head = first = rows = 0
    for row in kept:
        n = math.prod(row.block_shape(candidate.tp, candidate.ep))  # an expert stack: this rank's 1/ep
        table = row.name == "embed_tokens.weight"
        matmul = apart and not row.expert and (row.name.endswith("_proj.weight") or row.name == "lm_head.weight")
        per_element = c + (4 if candidate.zero_stage != 2 else 0) if matmul else 4
        if row.name == "lm_head.weight" and added_in_order:
            first = per_element * n  # added and freed before the layers' gradients exist
        elif table and apart_in_time:
            rows = 4 * n
        elif not table or not by_rows:  # taken by rows, the lookup's gradient is B T H, no table
            total += per_element * n
        if table and params.model.tie_embeddings:
            # The tied head's gradient of the same table, in the table's dtype; a compute-dtype one is cast into its
            # buffer when added, or under ZeRO-2 into its bucket's input.
            head = (c + (4 if by_rows else 0) if compute_table else 4) * n
    if by_rows:
        held = max(total, head)
    elif apart_in_time:
        held = max(total, head, rows)
    else:
        held = total + head
    return max(held, first)


def collective_graph_bytes(params: PipelineParams, candidate: Candidate, kind: DeviceKind, layers: int) -> int:
    """What collectives add to a rank's runtime: the job's (several ranks), and each of its `layers`' under tp,
    sequence parallelism and cp."""
    if candidate.replicas * candidate.tp * candidate.pp == 1:
        return 0
    per_layer = 0
    if candidate.tp > 1:
        per_layer += kind.tensor_parallel_bytes_per_layer
        per_layer += kind.sequence_parallel_bytes_per_layer if params.parallel.sequence_parallel else 0
    if candidate.cp > 1:
        per_layer += kind.context_parallel_bytes_per_layer
    return kind.collective_runtime_bytes + per_layer * layers


def bucket_bytes(params: PipelineParams) -> int:
    return int(params.parallel.gradient_bucket_mb * 2**20)


def update_block_bytes(params: PipelineParams, dp: int, shard: int) -> int:
    """The scratch buffer in which ZeRO-1/2 update a shard of fp32 weights, a bucket at a time: a rank's block of
    one bucket (`zero.flat_shards`), at most its whole shard."""
    return min(math.ceil(bucket_bytes(params) / dp), 4 * shard)


def shard_gather_bytes(parameters: int, dp: int, bucket: int, c: int) -> int:
    """What `zero.ShardGather` holds while it writes the updated shards back: one gathered bucket (fp32, at most the
    whole model's), the slice of it being written into a weight and, for a compute-dtype weight, that slice cast.
    It writes each bucket into the weights it meets before the next is gathered, a weight that crosses a bucket's
    edge in parts, so no weight is rebuilt whole."""
    gathered = min(bucket, 4 * math.ceil(parameters / dp) * dp)
    return 2 * gathered + (gathered * c // 4 if c != 4 else 0)


def backward_communication_bytes(params: PipelineParams, candidate: Candidate, parameters: int) -> int:
    """Gradient buckets over dp (ZeRO-3: also two layers of gathered parameters), activations over tp and pp."""
    model, c = params.model, _DTYPE_BYTES[params.precision.compute_dtype]
    total = 0
    if candidate.replicas > 1:
        total += 2 * min(bucket_bytes(params), 4 * parameters)
        if candidate.zero_stage == 3:
            total += 2 * 4 * parameters // (model.num_layers // candidate.pp)
    tokens = params.train.micro_batch_size * model.seq_len // candidate.cp
    total += gathered_kv_bytes(params, candidate.tp, candidate.cp)  # one layer's gather (or scatter) buffer
    if candidate.tp > 1:
        total += 2 * tokens * model.hidden_size * c + sequence_parallel_buffer_bytes(params, candidate.tp)
    if candidate.ep > 1:  # the all-to-all's send and receive buffers
        total += 2 * model.moe.num_experts * model.moe.capacity(tokens) * model.hidden_size * c
    if candidate.pp > 1:
        total += 3 * 2 * tokens * model.hidden_size * 4 // sequence_slices(params, candidate.tp)
    return total


def estimate(
    params: PipelineParams, candidate: Candidate, device_memory_bytes: int, kind: DeviceKind = ACCELERATOR,
    runtime_bytes: int | None = None,
) -> Estimate:
    """The busiest stage of `candidate`. runtime_bytes: the device's own reserve; None takes the kind's."""
    runtime = kind.runtime_bytes if runtime_bytes is None else runtime_bytes
    per_stage = [stage_memory(params, candidate, stage, kind, runtime) for stage in range(candidate.pp)]
    stage = max(range(candidate.pp), key=lambda s: per_stage[s].total)
    memory = per_stage[stage]
    exchanged = all_to_all_bytes_per_step(params, candidate.ep, candidate.pp, stage)
    context = context_bytes_per_step(params, candidate, stage)
    if not candidate.offload:
        return Estimate(candidate, stage, memory, memory.total <= device_memory_bytes, all_to_all_bytes_per_step=exchanged,
                        context_bytes_per_step=context)
    held = stage_parameters(params.model, candidate.tp, candidate.pp, stage)
    without = estimate(params, replace(candidate, offload=False, param_offload=False), device_memory_bytes, kind, runtime)
    shard = math.ceil(held / candidate.replicas)
    traffic = 2 * 8 * shard  # the moments of this rank's shard, read and written back
    if candidate.param_offload:  # the shard, read for each micro-batch's forward and backward and by the update
        micro_batches = math.ceil(params.global_batch_size / (params.train.micro_batch_size * candidate.dp))
        traffic += 4 * shard * (2 * micro_batches + 2)
    return Estimate(candidate, stage, memory, memory.total <= device_memory_bytes, traffic, without.memory.total,
                    context_bytes_per_step=context)


# -------------------------------------------------------------------------------------------- plan


def plan(
    params: PipelineParams,
    devices: int,
    device_memory_bytes: int,
    devices_per_node: int = 8,
    device_kind: str = "accelerator",
    runtime_bytes: int | None = None,
    offload_bandwidth: float | None = None,
    context_parallel: bool | None = None,
) -> Plan:
    """Every valid layout of `devices` for this model, estimated, in order of preference, and the first that
    fits; layouts with cp > 1 too where `context_parallel` is True, or is None and no layout without cp fits. device_kind: "accelerator" (counted tensors) or "cpu" (fitted to measured RSS); runtime_bytes: the
    device runtime's own reserve, None for the kind's (0 for accelerators, the measured baseline on CPU);
    offload_bandwidth: bytes/s the offloaded optimizer state moves at, None for the kind's stated one."""
    if devices < 1 or device_memory_bytes < 1 or devices_per_node < 1:
        raise ValueError(
            f"devices={devices}, device_memory_bytes={device_memory_bytes} and devices_per_node={devices_per_node} "
            "must all be positive"
        )
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind={device_kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    kind = DEVICE_KINDS[device_kind]
    runtime = kind.runtime_bytes if runtime_bytes is None else runtime_bytes
    bandwidth = OFFLOAD_BANDWIDTH[kind.name] if offload_bandwidth is None else offload_bandwidth
    estimates, excluded = [], []

    def add(layouts: list[tuple[int, int, int, int]]) -> Plan:
        for dp, tp, pp, cp in layouts:
            problems = layout_problems(params, dp, tp, pp, devices_per_node, cp)
            if problems:
                excluded.append(Excluded(dp, tp, pp, "; ".join(problems), cp))
                continue
            found = candidates(dp, tp, pp, params.model, devices_per_node, cp)
            estimates.extend(estimate(params, c, device_memory_bytes, kind, runtime) for c in found)
        estimates.sort(key=lambda e: e.candidate.preference())
        return Plan(devices, device_memory_bytes, devices_per_node, kind, runtime, tuple(estimates), tuple(excluded),
                    bandwidth)

    without_cp = add(degrees(devices))
    if context_parallel is False or (context_parallel is None and without_cp.recommended is not None):
        return without_cp
    return add([layout for layout in degrees(devices, context=True) if layout[3] > 1])


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def format_plan_table(plan: Plan) -> str:
    """A fixed-width table: one row per layout in order of preference, GiB per category, the recommended row
    marked with `*`; then the excluded degrees with their reasons, and the summary line."""
    header = ["", "layout", "stage", "peak at", *CATEGORIES, "total", "fits"]
    chosen = plan.recommended
    rows = [
        [
            "*" if e is chosen else "",
            str(e.candidate),
            str(e.stage),
            e.memory.phase,
            *(_gib(getattr(e.memory, name)) for name in CATEGORIES),
            _gib(e.memory.total),
            "yes" if e.fits else "no",
        ]
        for e in plan.estimates
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    left_aligned = {0, 1, 3}

    def line(cells: list[str]) -> str:
        padded = zip(cells, widths)
        return "  ".join(c.ljust(w) if i in left_aligned else c.rjust(w) for i, (c, w) in enumerate(padded))

    kind = plan.device_kind
    title = f"per-rank memory in GiB on {kind.name} devices ({kind.source}); runtime reserve {_gib(plan.runtime_bytes)}"
    lines = [
        title,
        line(header),
        line(["-" * w for w in widths]),
        *(line(row) for row in rows),
    ]
    lines += [f"excluded dp{e.dp}{f' cp{e.cp}' if e.cp > 1 else ''} tp{e.tp} pp{e.pp}: {e.reason}" for e in plan.excluded]
    lines.append(plan.summary)
    if chosen is not None and expert_parallel_note(chosen):
        lines.append(expert_parallel_note(chosen))
    if chosen is not None and chosen.candidate.cp > 1:
        lines.append(
            f"context parallelism: each rank receives {_gib(chosen.context_bytes_per_step)} GiB per step through the "
            f"key/value gathers of cp{chosen.candidate.cp} (every layer's forward, and its gradients' reduce-scatter "
            "in the backward); without cp no layout fits, nor comes within the offload rule's reach"
        )
    if plan.offload_note is not None:
        lines.append(plan.offload_note)
    return "\n".join(lines)


def expert_parallel_note(chosen: Estimate) -> str | None:
    """What expert parallelism moves per step, when the recommended layout uses it."""
    if chosen.candidate.ep == 1:
        return None
    return (
        f"expert parallelism: each rank sends {_gib(chosen.all_to_all_bytes_per_step)} GiB per step through the "
        f"all-to-alls of ep{chosen.candidate.ep} (2 per MoE block forward, 2 backward, per micro-batch)"
    )
