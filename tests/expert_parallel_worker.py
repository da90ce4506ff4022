"""Worker program that tests/test_expert_parallel_msrun.py starts under msrun; each rank writes its findings as
JSON.

    python tests/expert_parallel_worker.py all_to_all OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from model_core.parallel import comm

ROWS = 2  # rows of each block


def _blocks(rank: int, size: int, offset: float) -> np.ndarray:
    """[size * ROWS, 3], distinct per rank and per block."""
    return np.arange(size * ROWS * 3, dtype=np.float32).reshape(size * ROWS, 3) + 100 * rank + offset


def _all_to_all(arrays: list[np.ndarray], rank: int) -> np.ndarray:
    """numpy's all-to-all: block `rank` of every member's array, in member order."""
    return np.concatenate([a[rank * ROWS : (rank + 1) * ROWS] for a in arrays])


class _WeightedSum(nn.Cell):
    """sum(all_to_all(x) * weight): its gradient in x is the all-to-all of the weights."""

    def __init__(self, group: comm.Group, weight: np.ndarray) -> None:
        super().__init__()
        self.exchange = comm.AllToAll(group)
        self.weight = Tensor(weight)

    def construct(self, x):
        return (self.exchange(x) * self.weight).sum()


class _ValueAndGradInJit(nn.Cell):
    def __init__(self, loss: nn.Cell) -> None:
        super().__init__()
        self.value_and_grad = ops.value_and_grad(loss, grad_position=0)

    @ms.jit
    def construct(self, x):
        return self.value_and_grad(x)


def check_all_to_all(out_dir: Path) -> None:
    """The all-to-all (native where the backend has it, the all-reduce fallback otherwise) and its gradient,
    PyNative and jit, against numpy, on the world group."""
    comm.init()
    rank, size = comm.rank(), comm.world_size()
    inputs = [_blocks(r, size, 0.0) for r in range(size)]
    weights = [_blocks(r, size, 0.5) for r in range(size)]
    expected, expected_grad = _all_to_all(inputs, rank), _all_to_all(weights, rank)
    x = Tensor(inputs[rank])
    results = {}
    for native in (True, False):
        group = comm.Group(tuple(range(size)), rank, use_native=native)
        loss = _WeightedSum(group, weights[rank])
        results[f"values/pynative/native={native}"] = bool(np.array_equal(group.all_to_all(x).asnumpy(), expected))
        for mode, (_, grad) in (("pynative", ms.value_and_grad(loss, grad_position=0)(x)), ("jit", _ValueAndGradInJit(loss)(x))):
            results[f"grad/{mode}/native={native}"] = bool(np.array_equal(grad.asnumpy(), expected_grad))
        results[f"fallback_used/native={native}"] = not group.native_all_to_all
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"all_to_all": check_all_to_all}[command](out, *sys.argv[3:])
