"""Tensor parallelism applied to a built single-device Llama from outside, by swapping cells and parameters.

`parallelize(model, layout, rank, params)` turns the full model (built from the seed, initial weights
loaded) into this rank's tensor-parallel shard, so tp ranks start from exactly the single-process weights:
  q/k/v, gate/up          column-parallel: the weight keeps this rank's block of output rows, and the
                          attention cell computes heads / tp query and kv_heads / tp key/value heads;
  o_proj, down_proj       row-parallel (`RowParallelLinear`): a block of input columns, outputs summed;
  the two block norms     replicated; their output enters the tp region (`ThenCopyToTensorParallel`);
  embed_tokens, lm_head   vocab-parallel: a block of vocab rows (a tied head uses the embedding's block);
  the final norm's output enters the tp region in the head (`VocabParallelHead`).
Parameter paths do not move (`layers.0.mlp.down_proj.weight`), so checkpoints keep their names;
`split_axis(name)` says which axis a parameter is split along (None: replicated), for the gradient norm,
checkpoints and `reshard`. The model then returns the logits of this rank's vocab block; train it with
`VocabParallelTokenLoss` and measure its gradients with `gradient_norm.ParallelGradientNorm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from model_core.model.llama import Llama
from model_core.parallel import comm
from model_core.parallel.layout import Layout, check_tensor_parallel
from model_core.parallel.tensor import (
    RowParallelLinear,
    ThenCopyToTensorParallel,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from params.schema import ModelParams

# The owning cell's attribute name -> the axis of its [out, in] weight that tensor parallelism splits.
_SPLIT_AXES = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,  # output rows
    "o_proj": 1, "down_proj": 1,  # input columns
    "embed_tokens": 0, "lm_head": 0,  # vocabulary rows
}


def split_axis(name: str) -> int | None:
    """The axis along which tensor parallelism splits the parameter at path `name`; None when replicated."""
    parts = name.split(".")
    return _SPLIT_AXES.get(parts[-2]) if len(parts) >= 2 else None


def take_block(array: np.ndarray, axis: int | None, size: int, index: int) -> np.ndarray:
    """Block `index` of `size` equal blocks of `array` along `axis` (the whole array when axis is None)."""
    if axis is None:
        return array
    return np.split(array, size, axis=axis)[index]


@dataclass(frozen=True)
class TensorParallelism:
    """What `parallelize` did: the tp group, and the first vocabulary id of this rank's block."""

    group: comm.Group
    vocab_start: int


def parallelize(model: Llama, layout: Layout, rank: int, params: ModelParams) -> TensorParallelism:
    """Make `model` (the full single-device model, in place) rank `rank`'s tensor-parallel shard of `layout`."""
    check_tensor_parallel(layout.tp, params)
    group = comm.group(layout.tp_group(rank))
    size, index = group.size, group.index

    def own_block(cell: nn.Cell) -> Parameter:
        """This rank's block of `cell.weight`, as a new Parameter under the same name."""
        full = cell.weight
        block = take_block(full.asnumpy(), split_axis(f"{_name_of(model, cell)}.weight"), size, index)
        return Parameter(Tensor(block), name=full.name, requires_grad=full.requires_grad)

    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            linear.weight = own_block(linear)
        attention.o_proj = RowParallelLinear(own_block(attention.o_proj), group)
        mlp.down_proj = RowParallelLinear(own_block(mlp.down_proj), group)
        attention.num_heads //= size
        attention.num_kv_heads //= size
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.rms_norm = ThenCopyToTensorParallel(norm.rms_norm, group)
    vocab_start = index * (params.vocab_size // size)
    model.embed_tokens = VocabParallelEmbedding(own_block(model.embed_tokens), vocab_start, group)
    if not params.tie_embeddings:
        model.lm_head.weight = own_block(model.lm_head)
    model.head = VocabParallelHead(group)
    return TensorParallelism(group, vocab_start)


def _name_of(model: nn.Cell, cell: nn.Cell) -> str:
    """The path of `cell` inside `model` (`layers.0.self_attn.q_proj`)."""
    for name, candidate in model.cells_and_names():
        if candidate is cell:
            return name
    raise ValueError(f"{type(cell).__name__} is not a cell of this model")


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
