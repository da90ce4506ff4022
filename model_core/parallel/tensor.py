"""Megatron-style tensor-parallel layers: each rank of a tp group holds a block of every large matrix.

A column-parallel projection keeps a block of output rows (`y_r = x W_r^T`, a block of y's features); a
row-parallel one keeps the matching block of input columns and sums the partial products over the group
(`y = sum_r x_r W_r^T`). A block half (attention, MLP) is column then row, so it costs one all-reduce in
forward (the row-parallel sum) and one in backward (before the column-parallel layers, whose input
gradients are partial sums). The two conjugate operators carry those all-reduces:
  `CopyToTensorParallel`      identity forward, all-reduce of the gradient backward;
  `ReduceFromTensorParallel`  all-reduce forward, identity backward.
The vocabulary is split too: each rank embeds the ids of its vocab block (zeros elsewhere, then an
all-reduce) and computes logits for its block only; `VocabParallelCrossEntropy` takes the loss from the local
logit blocks with all-reduces of per-token scalars, so full logits are never gathered.

Sequence parallelism (Megatron's, `parallel.sequence_parallel`) splits what lies between the tp regions too: the
residual stream, the norms and their activations hold T / tp of the sequence on each rank of the group, so those
activations shrink by tp. The all-reduces become all-gathers and reduce-scatters along the sequence:
  `SequenceGatheredLinear`            a column-parallel projection of the whole sequence from this rank's slice:
                                      all-gather along the sequence forward, reduce-scatter of the input gradient;
  `ReduceScatterToSequenceParallel`   reduce-scatter along the sequence forward, all-gather of the gradient.
A projection keeps only the slice for its backward and gathers it again there (Megatron's choice: the whole
sequence's input of q/k/v, gate/up and the head would otherwise be kept whole, as without sequence parallelism).
Each projection gathers its own input, so q, k and v gather the same slice three times and gate and up twice:
more traffic than tp's all-reduces (README, "Scaling out"), traded for activation memory. The
embedding's output is reduce-scattered and the final norm runs on the slice. A replicated norm weight then sees only
its rank's slice, so its gradient is a share summed over tp (`Placement.tp_partial`). Attention runs on the gathered
sequence, so RoPE positions and the causal and document masks are the whole sequence's, as without it; results
equal tp's up to summation order.

Every Cell here takes its `comm.Group`; a group of one rank makes each of them the single-device layer.

`tensor_parallel(model, layout, rank, params)` applies the plan (`placement.TENSOR_PARALLEL_PLAN`) to a built
single-device Llama from outside, by swapping cells; the weights themselves are this rank's blocks, made by
`parallelize.build_shard` as the placement table says:
  q/k/v, gate/up          column-parallel: plain `Linear`s holding a block of output rows, and the attention
                          cell computes heads / tp query and kv_heads / tp key/value heads;
  o_proj, down_proj       row-parallel (`RowParallelLinear`): a block of input columns, outputs summed;
  the two block norms     replicated; their output enters the tp region (`ThenCopyToTensorParallel`);
  embed_tokens, lm_head   vocab-parallel: a block of vocab rows (a tied head uses the embedding's block);
  the final norm's output enters the tp region in the head (`VocabParallelHead`).
Parameter paths do not move (`layers.0.mlp.down_proj.weight`), so checkpoints keep their names. The model
then returns the logits of this rank's vocab block; train it with `VocabParallelTokenLoss`. LoRA adapters on
the swapped projections come from `tensor_parallel_adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import Parameter, mint, nn, ops

from model_core.model.fused import LinearFunction, expand, expand_rows
from model_core.model.llama import Llama
from model_core.model.lora import LoraLinear
from model_core.optim.step import routed_objective
from model_core.parallel import comm
from model_core.parallel.comm import Group
from model_core.parallel.layout import Layout
from params.rules import check_sequence_parallel, check_tensor_parallel
from params.schema import ModelParams


class CopyToTensorParallel(nn.Cell):
    """Megatron's f: the input enters the tp region unchanged; its gradient is summed over the group."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.group.all_reduce(dout),)


class ReduceFromTensorParallel(nn.Cell):
    """Megatron's g: partial results summed over the group; the gradient passes to every rank unchanged."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def construct(self, x):
        return self.group.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


_matmul_tn = ops.MatMul(transpose_a=True)  # a^T @ b


class SequenceGatheredLinear(nn.Cell):
    """`LinearFunction` of the whole sequence from this rank's slice: y = gather(x) W^T for x [B, T / tp, in], W a
    column-parallel block [out / tp, in]. The backward gathers x again rather than keeping the whole input, and
    reduce-scatters the input gradient (a partial sum over the tp blocks) back to the slices."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group
        self.linear = LinearFunction()

    def construct(self, x, weight):
        return self.linear(self.group.all_gather_sequence(x), weight)

    def bprop(self, x, weight, out, dout):
        # depend() on dout: a gather identical to the forward's would be merged with it, keeping the whole input.
        whole = self.group.all_gather_sequence(ops.depend(x, dout))
        out_features, in_features = weight.shape
        dout_2d = dout.reshape(-1, out_features)
        dwhole = ops.matmul(dout_2d, weight).reshape(whole.shape)
        dweight = _matmul_tn(dout_2d, whole.reshape(-1, in_features))
        return self.group.reduce_scatter_sequence(dwhole), dweight


class ReduceScatterToSequenceParallel(nn.Cell):
    """Sequence parallelism's g: partial results [B, T, ...] summed over the group, each rank keeping its slice of
    the sequence; the gradient of the slices is all-gathered into the whole sequence's."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def construct(self, x):
        return self.group.reduce_scatter_sequence(x)

    def bprop(self, x, out, dout):
        return (self.group.all_gather_sequence(dout),)


class SlicedSumToSequenceParallel(nn.Cell):
    """`ReduceScatterToSequenceParallel` where the backend has no reduce-scatter for the group: this rank's slice of
    the group's all-reduce, differentiated automatically. The all-reduce-sum's own gradient is the all-reduce of
    dout and the slice's pads dout with zeros, which together are exactly the all-gather of the slices' gradients.
    A Cell with its own bprop here made the CPU step slower and its compiled graph larger (benchmarks/README.md)."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def construct(self, x):
        return self.group.reduce_scatter_sequence(x)


def leaving(group: Group, sequence_parallel: bool) -> nn.Cell:
    """The operator that sums a tp region's partial results (into sequence slices under sequence parallelism)."""
    if not sequence_parallel:
        return ReduceFromTensorParallel(group)
    if group.size > 1 and not group.native_reduce_scatter:
        return SlicedSumToSequenceParallel(group)
    return ReduceScatterToSequenceParallel(group)


class ThenCopyToTensorParallel(nn.Cell):
    """`inner(x, weight)` (a norm function) followed by `CopyToTensorParallel`: swapped in for the function
    inside a replicated norm whose output feeds column-parallel layers, so the norm's parameter path and its
    replicated weight stay as they were, and its gradient (from the summed input gradient) is equal on
    every tp rank."""

    def __init__(self, inner: nn.Cell, group: Group) -> None:
        super().__init__()
        self.inner = inner
        self.copy = CopyToTensorParallel(group)

    def construct(self, x, weight):
        return self.copy(self.inner(x, weight))


class RowParallelLinear(nn.Cell):
    """y = sum over the group of x_r W_r^T: `weight` is this rank's [out, in / tp] block of columns, x its
    matching block of input features (the output of column-parallel layers). Under sequence parallelism y is
    this rank's slice of the sequence of that sum."""

    def __init__(self, weight: Parameter, group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.linear = LinearFunction()
        self.reduce = leaving(group, sequence_parallel)

    def construct(self, x):
        return self.reduce(self.linear(x, self.weight.astype(x.dtype)))


class RowLookup(nn.Cell):
    """Rows of `table` at `ids`: the embedding lookup, a cell of its own so ZeRO-3 can swap in one that
    gathers the table from shards first."""

    def construct(self, ids, table):
        return ops.gather(table, ids, 0)


class VocabParallelEmbedding(nn.Cell):
    """Token id -> embedding row, `weight` holding rows [start, start + block) of the vocabulary.

    Ids outside the block look up row 0 and are zeroed; the all-reduce (under sequence parallelism the
    reduce-scatter into this rank's slice) adds the one rank that holds each id. The gradient reaches only the rows
    of ids inside the block, which is this rank's part of the full one."""

    def __init__(self, weight: Parameter, start: int, block: int, group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.block = block
        self.lookup = RowLookup()
        self.reduce = leaving(group, sequence_parallel)

    def construct(self, tokens):
        local = tokens - self.start
        inside = mint.logical_and(local >= 0, local < self.block)
        rows = self.lookup(mint.where(inside, local, ops.zeros_like(local)), self.weight)  # [B, T, hidden]
        kept = inside.astype(rows.dtype).unsqueeze(-1)
        return self.reduce(rows * expand(kept, rows))


class VocabParallelHead(nn.Cell):
    """Logits of this rank's vocab block: the replicated final hidden state enters the tp region (its gradient, a
    partial sum over the block's logits, is summed over the group), then x W_block^T. Under sequence parallelism
    the slices are gathered into the whole sequence instead (`SequenceGatheredLinear`)."""

    def __init__(self, group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.copy = nn.Identity() if sequence_parallel else CopyToTensorParallel(group)
        self.linear = SequenceGatheredLinear(group) if sequence_parallel else LinearFunction()

    def construct(self, x, weight):
        return self.linear(self.copy(x), weight)


class VocabParallelCrossEntropy(nn.Cell):
    """Per-row -log softmax(logits)[label], from this rank's logit block [N, V / tp] and global labels [N].

    Forward: the global row max (for range), then the global sum of exp and the target logit (held by one
    rank, zero elsewhere), both with one all-reduce of [2, N]. Returns [2, N]: row 0 the loss, row 1 the
    log-sum-exp, there for the backward, which then needs no communication: d logits = softmax - one_hot,
    both restricted to the block. (One tensor, not a pair: MindSpore cannot differentiate through the unused
    half of a pair returned by a Cell with its own bprop.)
    """

    def __init__(self, start: int, group: Group) -> None:
        super().__init__()
        self.start = start
        self.group = group

    def construct(self, logits, labels):
        block = logits.shape[1]
        row_max = self.group.all_reduce(logits.max(axis=-1), "max")  # [N]
        sum_exp = ops.exp(logits - expand_rows(row_max.reshape(-1, 1), logits)).sum(-1)  # [N]
        inside = self._inside(labels, block)
        local = self._local(labels, inside)
        picked = ops.gather_d(logits, 1, local.reshape(-1, 1)).reshape(-1) * inside.astype(ms.float32)
        totals = self.group.all_reduce(mint.cat((sum_exp.reshape(1, -1), picked.reshape(1, -1))))  # [2, N]
        log_sum_exp = ops.log(totals[0]) + row_max
        return mint.cat(((log_sum_exp - totals[1]).reshape(1, -1), log_sum_exp.reshape(1, -1)))

    def bprop(self, logits, labels, out, dout):
        block = logits.shape[1]
        log_sum_exp = out[1]
        probs = ops.exp(logits - expand_rows(log_sum_exp.reshape(-1, 1), logits))
        inside = self._inside(labels, block)
        one_hot = ops.one_hot(self._local(labels, inside), block, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
        one_hot = one_hot * expand_rows(inside.astype(ms.float32).reshape(-1, 1), one_hot)
        return (probs - one_hot) * expand_rows(dout[0].reshape(-1, 1), logits), ops.zeros_like(labels)

    def _inside(self, labels, block):
        """Whether each label falls in this rank's block."""
        return mint.logical_and(labels >= self.start, labels < self.start + block)

    def _local(self, labels, inside):
        """Labels as indices into the block; 0 for those outside it."""
        return (labels - self.start) * inside.astype(labels.dtype)


@dataclass(frozen=True)
class TensorParallelism:
    """What `tensor_parallel` did: the tp group, and the first vocabulary id of this rank's block."""

    group: Group
    vocab_start: int


def tensor_parallel(
    model: Llama, layout: Layout, rank: int, params: ModelParams, sequence_parallel: bool = False
) -> TensorParallelism:
    """Swap `model`'s cells (in place, weights left as they are) for rank `rank`'s tensor-parallel ones; with
    `sequence_parallel` the activations between the tp regions hold this rank's slice of the sequence."""
    check_tensor_parallel(layout.tp, params)
    if sequence_parallel:
        check_sequence_parallel(layout.tp, params)
    group = comm.group(layout.tp_group(rank))
    size, index = group.size, group.index
    for layer in model.layers.cells():  # all layers, or a pipeline stage's
        attention, mlp = layer.self_attn, layer.mlp
        attention.o_proj = RowParallelLinear(attention.o_proj.weight, group, sequence_parallel)
        attention.num_heads //= size
        attention.num_kv_heads //= size
        enter_attention(layer, group, sequence_parallel)
        if layer.is_moe:  # every tp rank runs the whole MoE block on the same input: its gradient is whole already
            continue
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, group, sequence_parallel)
        enter_mlp(layer, group, sequence_parallel)
    block = params.vocab_size // size
    if hasattr(model, "embed_tokens"):
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, index * block, block, group, sequence_parallel)
    model.head = VocabParallelHead(group, sequence_parallel)
    if model.vocab_mask is not None:
        model.vocab_mask = model.vocab_mask[index * block : (index + 1) * block]
    return TensorParallelism(group, index * block)


def enter_attention(layer: nn.Cell, group: Group, sequence_parallel: bool) -> None:
    """The input norm's output enters the tp region: copied, or under sequence parallelism gathered by each of q/k/v."""
    if sequence_parallel:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            projection.linear = SequenceGatheredLinear(group)
    else:
        layer.input_layernorm.rms_norm = ThenCopyToTensorParallel(layer.input_layernorm.rms_norm, group)


def enter_mlp(layer: nn.Cell, group: Group, sequence_parallel: bool) -> None:
    """The post-attention norm's output enters the tp region: copied, or under sequence parallelism gathered by gate
    and up."""
    if sequence_parallel:
        for projection in (layer.mlp.gate_proj, layer.mlp.up_proj):
            projection.linear = SequenceGatheredLinear(group)
    else:
        layer.post_attention_layernorm.rms_norm = ThenCopyToTensorParallel(layer.post_attention_layernorm.rms_norm, group)


class VocabParallelTokenLoss(nn.Cell):
    """`step.SummedTokenLoss` for a vocab-parallel model: (summed token loss x scale, summed token loss) of
    one micro-batch, from the local logit blocks. Labels are token ids; `loss_mask` picks the counted ones. A model
    with MoE blocks adds its routing losses and returns its routing statistics as `SummedTokenLoss` does."""

    def __init__(self, model: nn.Cell, parallelism: TensorParallelism, aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.cross_entropy = VocabParallelCrossEntropy(parallelism.vocab_start, parallelism.group)
        self.routed = bool(getattr(model, "has_moe", False))
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef

    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale, router_noise=None):
        if self.routed:
            logits, routing = self.model.routed(tokens, position_ids, segment_ids, router_noise)  # [B, T, vocab / tp]
        else:
            logits = self.model(tokens, position_ids, segment_ids)
        per_token = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))[0]
        counted = (loss_mask.reshape(-1) != 0).astype(ms.float32)
        summed = (per_token * counted).sum()
        if self.routed:
            objective, statistics = routed_objective(summed, counted.sum(), routing, self.aux_loss_coef, self.z_loss_coef)
            return objective * scale, summed, statistics
        return summed * scale, summed


class RowParallelLoraLinear(LoraLinear):
    """LoRA on a row-parallel projection: y = reduce(x_r W_r^T + (alpha / r) (dropout(x_r) A_r^T) B^T), with A
    [r, in / tp] this rank's block of input columns (cut like W) and B [out, r] whole. The adapter's output
    joins the projection's before its one all-reduce, so LoRA adds no communication; B's gradient on a rank is
    then that rank's share of the whole one, summed over tp once per step (`Placement.tp_partial`)."""

    def __init__(self, base: RowParallelLinear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__(base, rank, alpha, dropout)
        self.reduce = base.reduce

    def construct(self, x):
        update = self.linear_a(self.dropout(x), self.lora_a.astype(x.dtype)) * self.scale  # [..., r]
        local = self.linear(x, self.weight.astype(x.dtype)) + self.linear_b(update, self.lora_b.astype(x.dtype))
        return self.reduce(local)


def tensor_parallel_adapter(base: nn.Cell, rank: int, alpha: float, dropout: float) -> LoraLinear:
    """The LoRA wrapper of a projection after tensor parallelism: a column-parallel one is a plain `Linear` holding
    its block of rows (A whole, B cut like W; A's gradient is a share, `Placement.tp_partial`), a row-parallel one
    a `RowParallelLinear`. Under sequence parallelism a column-parallel projection's input is its rank's slice of the
    sequence: W and A each gather it (`SequenceGatheredLinear`); B reads A's output, already whole."""
    if isinstance(base, RowParallelLinear):
        return RowParallelLoraLinear(base, rank, alpha, dropout)
    adapter = LoraLinear(base, rank, alpha, dropout)
    if isinstance(base.linear, SequenceGatheredLinear):
        adapter.linear = SequenceGatheredLinear(base.linear.group)
        adapter.linear_a = SequenceGatheredLinear(base.linear.group)
    return adapter
