"""ZeRO-3: every trainable parameter sharded over the data-parallel group and gathered only where it is used.

`shard_parameters(model, group)` turns the model into this rank's shard in place, from outside, as `parallelize`
does for tensor parallelism: a built model's weights are cut at once, a described one's placeholders become
placeholders of their shards, made later as shards alone (`parallelize.build_shard`). Under
tensor parallelism it shards each tp block as it would a whole weight; under pipeline parallelism it shards
what the stage kept (the tied table's copies on the two end stages are cut alike, being the same size, so
the pipeline sums their gradient shards over the pair as it sums whole gradients). Each
trainable weight becomes a flat fp32 Parameter of L = ceil(size / dp) elements under the same path
(`layers.0.mlp.down_proj.weight`): elements [index * L, (index + 1) * L) of the flattened weight, zero-padded
to dp * L. Every function that uses a weight takes the shard instead and, with a hand-written bprop:
  forward   all-gathers the shards, cut to the weight's size and reshaped, and uses the full weight;
  backward  gathers it again where the backward needs it (a matmul's input gradient, a norm's), rather than
            keep the forward's copy from forward to backward, and reduce-scatters the flat, padded weight
            gradient: the gradient wrt this rank's shard, summed over dp.
The swaps: a Linear's (and a row-parallel one's) and the head's matmul function and RMSNorm's function
become `WithGatheredWeight` (inside the tp copy that follows a norm or precedes a vocab-parallel head); the
token embedding, which indexes its table directly, becomes a `GatheredEmbedding`, or a vocab-parallel one
gets a `GatheredLookup`; neither lookup's backward needs the table. In a low-precision compute dtype the shard is cast before it is gathered, so gathers and
reduce-scatters move compute-dtype values. Counted in the compiled step of the 2-layer test model: 20
all-gathers in the forward and 20 in the backward. (A gather cell marked for recomputation, the simpler
design, did not regather: MindSpore 2.10's jit on CPU kept only the forward's 20.)

Gradients arrive summed over dp and shard-sized, so the plain `AccumulateGradients` keeps shard-sized fp32
buffers, `ParallelGradientNorm` sums their squares over dp, and the optimizer
(`model_core.parallel.optimizer.AdamW`, where the placement says the parameter is the shard) updates the shards
with weight decay decided by each full parameter's ndim. Checkpoints stay layout-independent: `full_weights` and
the optimizer's `state_dict` gather whole tensors under the usual names (collectives: every rank calls them), and
`load_full_weights` and its `load_state_dict` take this rank's shards of whole tensors, whatever layout wrote them.
Parameter offload (`model_core.parallel.param_offload`) keeps the shards' values in a file instead and has each
gather fetch its shard from there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from model_core.model.init import deferred, placeholder, shape_of
from model_core.model.llama import Embedding, Linear, Llama, RMSNorm
from model_core.model.lora import LoraLinear
from model_core.optim.adamw import applies_weight_decay
from model_core.parallel.comm import Group
from model_core.parallel.tensor import (
    RowParallelLinear,
    ThenCopyToTensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)

if TYPE_CHECKING:
    from model_core.parallel.param_offload import ShardFile


def shard_length(size: int, shards: int) -> int:
    """Elements per shard of a `size`-element parameter split into `shards` (the last one padded)."""
    return -(-size // shards)


def take_shard(array: np.ndarray, shards: int, index: int) -> np.ndarray:
    """Shard `index` of `shards` of `array`, flattened and zero-padded to a multiple of `shards`, as fp32."""
    flat = np.asarray(array, dtype=np.float32).reshape(-1)
    length = shard_length(flat.size, shards)
    padded = np.zeros(length * shards, np.float32)
    padded[: flat.size] = flat
    return padded[index * length : (index + 1) * length].copy()


def join_shards(shards: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """The full parameter from every rank's shard concatenated in group order (the padding dropped)."""
    return shards[: int(np.prod(shape))].reshape(shape)


class ParameterShards(nn.Cell):
    """Between one parameter (its `path`) of `shape` and this rank's shard of it over `group`: the gather of the full value
    and the reduce-scatter of its gradient. With parameter offload `fetch` reads the shard's values from the offload
    file (`model_core.parallel.param_offload`) and the shard passed in is its gradient buffer, which only orders it."""

    def __init__(self, shape: Sequence[int], group: Group, path: str) -> None:
        super().__init__()
        self.path = path
        self.fetch = None
        self.shape = tuple(shape)
        self.size = int(np.prod(self.shape))
        self.padding = shard_length(self.size, group.size) * group.size - self.size
        self.group = group

    def gather(self, shard):
        """The full parameter from every rank's shard."""
        if self.fetch is not None:
            shard = self.fetch(shard[:1]).astype(shard.dtype)
        return self.group.all_gather(shard)[: self.size].reshape(self.shape)

    def scatter_gradient(self, gradient):
        """This rank's shard of the gradient (of the full parameter's shape) summed over the group."""
        flat = gradient.reshape(-1)
        if self.padding:
            flat = ops.cat((flat, ops.zeros((self.padding,), flat.dtype)))
        return self.group.reduce_scatter(flat)


class WithGatheredWeight(nn.Cell):
    """`inner(x, weight)`, a function with a hand-written bprop (a matmul, a norm), called with the full weight
    gathered from a shard. The backward gathers the weight again rather than keep the forward's copy (the
    gather waits for dout, which also keeps jit from merging it with the forward's) and reduce-scatters the
    weight's gradient to the shard."""

    def __init__(self, inner: nn.Cell, shape: Sequence[int], group: Group, path: str) -> None:
        super().__init__()
        self.inner = inner
        self.shards = ParameterShards(shape, group, path)

    def construct(self, x, shard):
        return self.inner(x, self.shards.gather(shard))

    def bprop(self, x, shard, out, dout):
        weight = self.shards.gather(ops.depend(shard, dout))
        dx, dweight = self.inner.bprop(x, weight, out, dout)
        return dx, self.shards.scatter_gradient(dweight)


class GatheredLookup(nn.Cell):
    """Token id -> row of the [vocab, hidden] table gathered from a shard. The backward needs no table: the
    rows' gradients are added into a table-shaped gradient and reduce-scattered to the shard."""

    def __init__(self, shape: Sequence[int], group: Group, path: str) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = shape
        self.shards = ParameterShards(shape, group, path)

    def construct(self, tokens, shard):
        return ops.gather(self.shards.gather(shard), tokens, 0)

    def bprop(self, tokens, shard, out, dout):
        rows = dout.reshape(-1, self.hidden_size)
        table = ops.unsorted_segment_sum(rows, tokens.reshape(-1), self.vocab_size)
        return ops.zeros_like(tokens), self.shards.scatter_gradient(table)


class GatheredEmbedding(nn.Cell):
    """Token id -> row of the table; `weight` is this rank's shard of it."""

    def __init__(self, weight: Parameter, shape: Sequence[int], group: Group, path: str) -> None:
        super().__init__()
        self.weight = weight
        self.lookup = GatheredLookup(shape, group, path)

    def construct(self, tokens):
        return self.lookup(tokens, self.weight)


@dataclass(frozen=True)
class ShardedParameters:
    """What `shard_parameters` did: this rank's shard of every weight by path, the full shapes, and whether
    each full weight is decayed (decided before it was flattened). With parameter offload the shards' values are
    in `offloaded` (`model_core.parallel.param_offload`) and `shards` are their gradient buffers."""

    group: Group
    shards: dict[str, Parameter]
    shapes: dict[str, tuple[int, ...]]
    decays: dict[str, bool]
    offloaded: ShardFile | None = None

    def full_weights(self) -> dict[str, np.ndarray]:
        """Every full weight by path, gathered from the shards. A collective: every rank of the group calls it."""
        if self.offloaded is not None:
            values = [Tensor(self.offloaded.weights[name].read()) for name in self.shards]
        else:
            values = [shard.value() for shard in self.shards.values()]
        full = gather_full(values, [self.shapes[name] for name in self.shards], self.group)
        return dict(zip(self.shards, full))

    def load_full_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Take this rank's shard of every full weight (in place, so compiled graphs keep seeing them)."""
        _check_full(weights, self.shapes, "checkpoint weights")
        for name, shard in self.shards.items():
            values = take_shard(weights[name], self.group.size, self.group.index)
            if self.offloaded is not None:
                self.offloaded.weights[name].write(0, values)
            else:
                ops.assign(shard, Tensor(values))


def shard_parameters(model: Llama, group: Group) -> ShardedParameters:
    """Make `model` (in place) keep only its `group.index` shard of every weight it holds: the full
    single-device model, its tensor-parallel blocks (`parallelize` applied first: a block is sharded like a
    whole weight) or its pipeline stage (`pipeline.prune_to_stage` applied first). A placeholder weight (a
    model described but not made, `model_core.model.init`) becomes a placeholder of its shard's shape, so
    the rank that makes it never holds more than the shard."""
    shards, shapes, decays = {}, {}, {}

    def own_shard(name: str, cell: nn.Cell, attribute: str = "weight") -> Parameter:
        full = getattr(cell, attribute)
        shapes[name] = shape_of(full)
        decays[name] = applies_weight_decay(full)  # read before the weight is flattened
        described = deferred(full)
        if described is None:
            shard = Parameter(Tensor(take_shard(full.asnumpy(), group.size, group.index)), name=full.name)
        else:  # made later, by whoever made the model, as this shard
            shard = placeholder(described, (shard_length(math.prod(shapes[name]), group.size),))
        shard.requires_grad = full.requires_grad  # frozen stays frozen
        shards[name] = shard
        return shard

    for name, cell in list(model.cells_and_names()):
        path = f"{name}.weight"
        if isinstance(cell, LoraLinear):  # the frozen projection and both adapters, each gathered where used
            for attribute, function in (("weight", "linear"), ("lora_a", "linear_a"), ("lora_b", "linear_b")):
                setattr(cell, attribute, own_shard(f"{name}.{attribute}", cell, attribute))
                shard = f"{name}.{attribute}"
                setattr(cell, function, WithGatheredWeight(getattr(cell, function), shapes[shard], group, shard))
        elif isinstance(cell, (Linear, RowParallelLinear)):
            cell.weight = own_shard(path, cell)
            cell.linear = WithGatheredWeight(cell.linear, shapes[path], group, path)
        elif isinstance(cell, RMSNorm):
            cell.weight = own_shard(path, cell)
            function = cell.rms_norm
            if isinstance(function, ThenCopyToTensorParallel):  # the gather goes inside, the tp copy after it
                function.inner = WithGatheredWeight(function.inner, shapes[path], group, path)
            else:
                cell.rms_norm = WithGatheredWeight(function, shapes[path], group, path)
    if _holds(model, "embed_tokens"):  # the first stage, or the last holding a tied table
        embedding = model.embed_tokens
        shard = own_shard("embed_tokens.weight", embedding)
        if isinstance(embedding, VocabParallelEmbedding):
            embedding.weight = shard
            embedding.lookup = GatheredLookup(shapes["embed_tokens.weight"], group, "embed_tokens.weight")
        elif isinstance(embedding, Embedding):
            model.embed_tokens = GatheredEmbedding(shard, shapes["embed_tokens.weight"], group, "embed_tokens.weight")
        else:
            raise TypeError(f"ZeRO-3 shards an Embedding or VocabParallelEmbedding, not {type(embedding).__name__}")
    if _holds(model, "norm"):  # the stage with the head
        head = "embed_tokens.weight" if model.tie_embeddings else "lm_head.weight"
        if isinstance(model.head, VocabParallelHead):  # the tp copy of its input stays outside the gather
            model.head.linear = WithGatheredWeight(model.head.linear, shapes[head], group, head)
        else:
            model.head = WithGatheredWeight(model.head, shapes[head], group, head)
    return ShardedParameters(group, shards, shapes, decays)


def _holds(model: nn.Cell, child: str) -> bool:
    """Whether `model` still has the cell `child` (a pipeline stage drops what it does not run)."""
    return child in model.name_cells()


def gather_full(shards: Sequence[Tensor], shapes: Sequence[tuple[int, ...]], group: Group) -> list[np.ndarray]:
    """The full arrays of `shards` (one per parameter, this rank's), with one all-gather for all of them."""
    lengths = [int(shard.shape[0]) for shard in shards]
    gathered = group.all_gather(ops.cat([shard.reshape(1, -1) for shard in shards], axis=1)).asnumpy()
    offsets = np.cumsum([0, *lengths])
    return [
        join_shards(gathered[:, start:end].reshape(-1), shape).copy()
        for start, end, shape in zip(offsets[:-1], offsets[1:], shapes)
    ]


def _check_full(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """`tensors` must hold exactly the names of `shapes`, each with its full shape."""
    missing, unexpected = sorted(shapes.keys() - tensors.keys()), sorted(tensors.keys() - shapes.keys())
    if missing or unexpected:
        raise KeyError(f"{what} does not fit the ZeRO-3 shards: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{what}: {name} has shape {tuple(tensors[name].shape)}, the model's is {shape}")
