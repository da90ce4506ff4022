"""Worker programs that tests/test_parallel*.py start under msrun; each rank writes its findings as JSON.

    python tests/parallel_worker.py comm OUT_DIR
    python tests/parallel_worker.py train OUT_DIR DATASET_DIR [--set section.field=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn

from model_core.parallel import comm


def _value(rank: int, rows: int = 2) -> np.ndarray:
    return (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 10 * rank + 1)


class _AllInJit(nn.Cell):
    def __init__(self, group: comm.Group) -> None:
        super().__init__()
        self.group = group

    @ms.jit
    def construct(self, x):
        return (
            self.group.all_reduce(x),
            self.group.all_reduce(x, "mean"),
            self.group.all_gather(x),
            self.group.reduce_scatter(x),
            self.group.broadcast(x, 1),
        )


def check_comm(out_dir: Path) -> None:
    """Every collective, native and fallback, PyNative and jit, against numpy."""
    comm.init()
    rank, size = comm.rank(), comm.world_size()
    values = [_value(r) for r in range(size)]
    expected = {
        "sum": sum(values),
        "mean": sum(values) / size,
        "gather": np.concatenate(values),
        "scatter": np.split(sum(values), size)[rank],
        "broadcast": values[1],
    }
    results = {}
    x = ms.Tensor(values[rank])
    for native in (True, False):
        group = comm.Group(tuple(range(size)), rank, use_native=native)
        eager = (
            group.all_reduce(x), group.all_reduce(x, "mean"), group.all_gather(x), group.reduce_scatter(x),
            group.broadcast(x, 1),
        )
        for mode, outputs in (("pynative", eager), ("jit", _AllInJit(group)(x))):
            for name, got in zip(expected, outputs):
                results[f"{name}/{mode}/native={native}"] = bool(np.array_equal(got.asnumpy(), expected[name]))
    got = comm.send_receive(ms.Tensor(values[rank]), 0, 1).asnumpy()
    results["p2p"] = bool(np.array_equal(got, values[0]))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def train(out_dir: Path, dataset_dir: str, *overrides: str) -> None:
    """Train with params `tiny` + overrides; write this rank's metrics history and held optimizer-state bytes."""
    from model_core.parallel.zero import moment_bytes
    from model_core.train.trainer import Trainer
    from params import load_params

    params = load_params("tiny", [value for flag, value in zip(overrides[::2], overrides[1::2]) if flag == "--set"])
    trainer = Trainer(params, dataset_dir, out_dir / "checkpoints")
    result = trainer.run()
    optimizer = trainer.optimizer
    held = optimizer.moment_bytes() if hasattr(optimizer, "moment_bytes") else moment_bytes(optimizer)
    report = {"history": result.history, "moment_bytes": held, "checkpoint": str(result.checkpoint)}
    (out_dir / f"rank{trainer.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"comm": check_comm, "train": train}[command](out, *sys.argv[3:])
