"""A rank's shard of the model, built from the placement table without the whole model ever being held.

`build_shard(model_params, table, rank, ...)` is the one place a run's model is made for its layout, in this
order (torchtitan's: describe the whole model, cut it, then make only what is kept):
  1. describe    the single-device `Llama` built inside `deferred_weights()`: cells with placeholder weights;
  2. stage       under pipeline parallelism only this rank's stage is kept (`pipeline.prune_to_stage`);
  3. tensor      under tensor parallelism cells are swapped from outside (`tensor_parallel`);
  4. weights     every placeholder becomes this rank's block of the weight, as the table places it: read
                 from the initial weights on disk one block at a time (`storage.read_block`), or drawn from
                 the weight's own (seed, path) generator and cut (`model_core.model.init`).
A rank therefore holds its share plus, while one weight is being drawn, that one whole weight.

Tensor parallelism (step 3) swaps, following `placement.TENSOR_PARALLEL_PLAN`:
  q/k/v, gate/up          column-parallel: the weight is this rank's block of output rows, and the attention
                          cell computes heads / tp query and kv_heads / tp key/value heads;
  o_proj, down_proj       row-parallel (`RowParallelLinear`): a block of input columns, outputs summed;
  the two block norms     replicated; their output enters the tp region (`ThenCopyToTensorParallel`);
  embed_tokens, lm_head   vocab-parallel: a block of vocab rows (a tied head uses the embedding's block);
  the final norm's output enters the tp region in the head (`VocabParallelHead`).
Parameter paths do not move (`layers.0.mlp.down_proj.weight`), so checkpoints keep their names. The model
then returns the logits of this rank's vocab block; train it with `VocabParallelTokenLoss` and measure its
gradients with `gradient_norm.ParallelGradientNorm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from model_core.model.init import deferred, deferred_weights
from model_core.model.llama import Llama
from model_core.model.weights import WeightMismatchError
from model_core.parallel import comm
from model_core.parallel.layout import Layout, check_tensor_parallel
from model_core.parallel.pipeline import prune_to_stage
from model_core.parallel.placement import PlacementTable
from model_core.parallel.tensor import (
    RowParallelLinear,
    ThenCopyToTensorParallel,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from model_core.storage import WEIGHTS, read_block, tensor_shapes
from params.schema import ModelParams


@dataclass(frozen=True)
class TensorParallelism:
    """What `tensor_parallel` did: the tp group, and the first vocabulary id of this rank's block."""

    group: comm.Group
    vocab_start: int


def take_block(array: np.ndarray, axis: int | None, size: int, index: int) -> np.ndarray:
    """Block `index` of `size` equal blocks of `array` along `axis` (the whole array when axis is None)."""
    if axis is None or size == 1:
        return array
    return np.split(array, size, axis=axis)[index]


def build_shard(
    params: ModelParams,
    table: PlacementTable,
    rank: int,
    seed: int,
    compute_dtype: str = "float32",
    initial_weights: str | Path | None = None,
) -> tuple[Llama, TensorParallelism | None]:
    """Rank `rank`'s shard of the model (see the module docstring) and, under tp, what tensor parallelism did.
    `initial_weights`: a directory with model.safetensors to start from instead of the seeded initialisation."""
    layout = table.layout
    with deferred_weights():
        model = Llama(params, compute_dtype)
    at = layout.coordinates(rank)
    if layout.pp > 1:
        prune_to_stage(model, layout.stage_sizes(params.num_layers), at.pp, params.tie_embeddings)
    parallelism = tensor_parallel(model, layout, rank, params) if layout.tp > 1 else None
    source = Path(initial_weights) / WEIGHTS if initial_weights is not None else None
    if source is not None:
        check_weights_file(source, table)
    materialize(model, table, at.tp, seed, source)
    return model, parallelism


def materialize(model: nn.Cell, table: PlacementTable, tp_index: int, seed: int, source: Path | None) -> None:
    """Replace every placeholder weight of `model` by tp block `tp_index` of its values, one weight at a time:
    read from the safetensors file `source`, or drawn from the weight's seeded generator."""
    tp = table.layout.tp
    for path, cell in model.cells_and_names():
        # A cell's own parameters by attribute: the one way MindSpore exposes which attribute holds which.
        for attribute, placeholder in list(cell._params.items()):
            init = deferred(placeholder)
            if init is None:
                continue
            name = f"{path}.{attribute}" if path else attribute
            axis = table[name].tp_axis if tp > 1 else None
            if source is not None:
                values = read_block(source, name, axis, tp, tp_index)
            else:
                values = np.ascontiguousarray(take_block(init.values(seed, name), axis, tp, tp_index))
            expected = table[name].block_shape(tp)
            if values.shape != expected:
                raise ValueError(f"{name}: {source or 'initialisation'} gives shape {values.shape}, this rank holds {expected}")
            setattr(cell, attribute, Parameter(Tensor(values, ms.float32), name=name, requires_grad=placeholder.requires_grad))


def check_weights_file(path: Path, table: PlacementTable) -> None:
    """The file must hold exactly the table's weights, each of its whole shape (read from the header alone)."""
    shapes = tensor_shapes(path)
    names = {row.name for row in table}
    missing, unexpected = sorted(names - shapes.keys()), sorted(shapes.keys() - names)
    if missing or unexpected:
        raise WeightMismatchError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for row in table:
        if shapes[row.name] != row.shape:
            raise WeightMismatchError(f"{path}: {row.name} has shape {shapes[row.name]}, the model's is {row.shape}")


def tensor_parallel(model: Llama, layout: Layout, rank: int, params: ModelParams) -> TensorParallelism:
    """Swap `model`'s cells (in place, weights left as they are) for rank `rank`'s tensor-parallel ones."""
    check_tensor_parallel(layout.tp, params)
    group = comm.group(layout.tp_group(rank))
    size, index = group.size, group.index
    for layer in model.layers.cells():  # all layers, or a pipeline stage's
        attention, mlp = layer.self_attn, layer.mlp
        attention.o_proj = RowParallelLinear(attention.o_proj.weight, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, group)
        attention.num_heads //= size
        attention.num_kv_heads //= size
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.rms_norm = ThenCopyToTensorParallel(norm.rms_norm, group)
    block = params.vocab_size // size
    if hasattr(model, "embed_tokens"):
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, index * block, block, group)
    model.head = VocabParallelHead(group)
    return TensorParallelism(group, index * block)


class VocabParallelTokenLoss(nn.Cell):
    """`step.SummedTokenLoss` for a vocab-parallel model: (summed token loss x scale, summed token loss) of
    one micro-batch, from the local logit blocks. Labels are token ids; `loss_mask` picks the counted ones."""

    def __init__(self, model: nn.Cell, parallelism: TensorParallelism) -> None:
        super().__init__()
        self.model = model
        self.cross_entropy = VocabParallelCrossEntropy(parallelism.vocab_start, parallelism.group)

    def construct(self, tokens, labels, loss_mask, position_ids, segment_ids, scale):
        logits = self.model(tokens, position_ids, segment_ids)  # [B, T, vocab / tp]
        per_token = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))[0]
        summed = (per_token * (loss_mask.reshape(-1) != 0).astype(ms.float32)).sum()
        return summed * scale, summed
