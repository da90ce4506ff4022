"""Optimizer offload under each ZeRO stage: which elements a rank updates, and its moments as whole tensors.

`offloaded_optimizer` gives the `OffloadedAdamW` (model_core/optim/offload.py) of a rank, holding in its file only
the moments it would hold in memory without offload:
  ZeRO 0     one slot per weight, the whole weight and its whole gradient buffer;
  ZeRO-1/2   one slot per piece of this rank's shard of the flattened weights (`zero.shard_pieces`): ZeRO-1 reads
             the piece out of the full, dp-summed gradient buffer, ZeRO-2 from its shard-sized piece buffer.
             After the update the rank's pieces are in the weights themselves and a bucketed all-gather of
             them sets every weight (`GatherUpdatedShards`), as `ShardedAdamW` does, without its fp32 copy of
             the shard;
  ZeRO-3     one slot per weight shard (the weights are the shards), decayed as the full weight would be.
`state_dict`/`load_state_dict` speak whole moments keyed `adam_m.<path>`/`adam_v.<path>`, as every other
optimizer does, so a checkpoint does not say whether offload was on (`state_dict` is a collective under ZeRO).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn

from model_core.optim.adamw import applies_weight_decay
from model_core.optim.offload import OffloadedAdamW, Slot
from model_core.parallel.comm import Group
from model_core.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from model_core.parallel.zero import ShardGather, shard_pieces
from model_core.parallel.zero3 import ShardedParameters, join_shards, take_shard
from params.schema import OptimizerParams

PREFIXES = ("adam_m", "adam_v")


class GatherUpdatedShards(nn.Cell):
    """Every weight from the ranks' updated pieces, which this rank updated in place in its weights: all-gathered
    over the group bucket by bucket (`zero.ShardGather`) and written into each weight."""

    def __init__(self, weights: Sequence[Parameter], pieces: Sequence[tuple[int, int, int]], shard_length: int,
                 group: Group, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        self.weights = ParameterTuple(weights)
        self.pieces = tuple(pieces)
        self.gather = ShardGather(weights, self.pieces, shard_length, group, bucket_bytes)

    @ms.jit
    def construct(self):
        return self.gather(tuple(self.weights[i].reshape(-1)[start:end] for i, start, end in self.pieces))


class OffloadedOptimizer:
    """A rank's `OffloadedAdamW` with the checkpoint interface of the in-memory optimizers (see the module
    docstring); `step(lr, step, grad_scale)` replaces `ApplyGradients`' update."""

    def __init__(self, adamw: OffloadedAdamW, names: Sequence[str], shapes: Sequence[tuple[int, ...]], sharding: str,
                 group: Group, shard_length: int = 0) -> None:
        self.adamw = adamw
        self.param_names = tuple(names)
        self.shapes = tuple(shapes)
        self.sharding = sharding if group.size > 1 else "none"  # "none" | "zero1/2" | "zero3"
        self.group = group
        self.shard_length = shard_length
        self._name_index = {name: i for i, name in enumerate(self.param_names)}

    def step(self, lr: Tensor, step: Tensor, grad_scale: Tensor) -> None:
        self.adamw.step(lr, step, grad_scale)

    def moment_bytes(self) -> int:
        """Bytes of moments held in memory (the staging buckets), not those in the file."""
        return self.adamw.resident_bytes()

    @property
    def last_bytes(self) -> int:
        return self.adamw.last_bytes

    @property
    def last_seconds(self) -> float:
        return self.adamw.last_seconds

    def close(self) -> None:
        self.adamw.close()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Whole moments keyed `adam_m.<path>` / `adam_v.<path>`. A collective under ZeRO."""
        local = self.adamw.local_state()
        slots = self.adamw.slots
        state = {}
        for prefix in PREFIXES:
            if self.sharding == "zero3":
                lengths = [slot.size for slot in slots]
                row = np.concatenate([local[(prefix, k)] for k in range(len(slots))]).reshape(1, -1)
                gathered = self.group.all_gather(Tensor(row)).asnumpy()
                offsets = np.cumsum([0, *lengths])
                for k, slot in enumerate(slots):
                    shape = self.shapes[self._name_index[slot.name]]
                    state[f"{prefix}.{slot.name}"] = join_shards(gathered[:, offsets[k] : offsets[k + 1]].reshape(-1), shape).copy()
                continue
            flat = np.concatenate([local[(prefix, k)] for k in range(len(slots))])
            if self.sharding == "zero1/2":
                padded = np.zeros(self.shard_length, np.float32)
                padded[: flat.size] = flat
                flat = self.group.all_gather(Tensor(padded)).asnumpy()
            offset = 0
            for name, shape in zip(self.param_names, self.shapes):
                size = int(np.prod(shape))
                state[f"{prefix}.{name}"] = flat[offset : offset + size].reshape(shape).copy()
                offset += size
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """This rank's elements of whole moments (which must hold exactly this optimizer's keys and shapes)."""
        expected = {f"{prefix}.{name}": shape for prefix in PREFIXES for name, shape in zip(self.param_names, self.shapes)}
        missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise KeyError(f"optimizer state does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for key, shape in expected.items():
            if tuple(np.shape(state[key])) != tuple(shape):
                raise ValueError(f"{key}: saved shape {tuple(np.shape(state[key]))} differs from the parameter's {shape}")
        local = {}
        for prefix in PREFIXES:
            for k, slot in enumerate(self.adamw.slots):
                whole = np.asarray(state[f"{prefix}.{slot.name}"], np.float32)
                if self.sharding == "zero3":
                    local[(prefix, k)] = take_shard(whole, self.group.size, self.group.index)
                else:
                    local[(prefix, k)] = whole.reshape(-1)[slot.start : slot.end]
        self.adamw.load_local_state(local)


def offloaded_optimizer(
    weights: Sequence[Parameter],
    buffers: Sequence[Parameter],
    names: Sequence[str],
    optimizer: OptimizerParams,
    zero_stage: int,
    group: Group,
    zero3: ShardedParameters | None = None,
    shard_length: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> OffloadedOptimizer:
    """The offloaded AdamW of a rank under `zero_stage` over `group` (see the module docstring). `weights`,
    `buffers` and `names` as the gradient accumulation holds them (ZeRO-2: one buffer per piece of the shard cut
    with `shard_length`); `bucket_bytes`: the most one all-gathered bucket of updated weights holds."""
    if zero3 is not None:
        if zero3.offloaded is not None:  # the shards' values are in the parameter offload file
            weights = [zero3.offloaded.weights[name] for name in names]
        slots = [Slot(name, w, 0, int(b.shape[0]), b, 0, zero3.decays[name]) for name, w, b in zip(names, weights, buffers)]
        adamw = OffloadedAdamW(slots, optimizer)
        shapes = [zero3.shapes[name] for name in names]
        return OffloadedOptimizer(adamw, names, shapes, "zero3", group)
    shapes = [tuple(w.shape) for w in weights]
    if zero_stage == 0 or group.size == 1:
        slots = [Slot(name, w, 0, w.size, b, 0, applies_weight_decay(w)) for name, w, b in zip(names, weights, buffers)]
        return OffloadedOptimizer(OffloadedAdamW(slots, optimizer), names, shapes, "none", group)
    sizes = [int(np.prod(shape)) for shape in shapes]
    pieces, length = shard_pieces(sizes, group.size, group.index, shard_length if zero_stage == 2 else None)
    slots = []
    for k, piece in enumerate(pieces):
        weight = weights[piece.index]
        gradient, start = (buffers[k], 0) if zero_stage == 2 else (buffers[piece.index], piece.start)
        slots.append(Slot(names[piece.index], weight, piece.start, piece.end, gradient, start, applies_weight_decay(weight)))
    gather = GatherUpdatedShards(weights, [(p.index, p.start, p.end) for p in pieces], length, group, bucket_bytes)
    adamw = OffloadedAdamW(slots, optimizer, after_update=gather)
    return OffloadedOptimizer(adamw, names, shapes, "zero1/2", group, length)
