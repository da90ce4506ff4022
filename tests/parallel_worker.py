"""Worker programs that tests/test_parallel*.py start under msrun; each rank writes its findings as JSON.

    python tests/parallel_worker.py comm OUT_DIR
    python tests/parallel_worker.py late OUT_DIR SECONDS
    python tests/parallel_worker.py freeze OUT_DIR
    python tests/parallel_worker.py train OUT_DIR DATASET_DIR [--resume PATH] [--set section.field=value ...]
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
    """Distinct per rank, rising on even ranks and falling on odd ones, so each rank holds some maxima."""
    return np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * (-1) ** rank + 3 * rank + 1


class _AllInJit(nn.Cell):
    def __init__(self, group: comm.Group) -> None:
        super().__init__()
        self.group = group

    @ms.jit
    def construct(self, x):
        return (
            self.group.all_reduce(x),
            self.group.all_reduce(x, "mean"),
            self.group.all_reduce(x, "max"),
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
        "max": np.max(values, axis=0),
        "gather": np.concatenate(values),
        "scatter": np.split(sum(values), size)[rank],
        "broadcast": values[1],
    }
    results = {}
    x = ms.Tensor(values[rank])
    for native in (True, False):
        group = comm.Group(tuple(range(size)), rank, use_native=native)
        eager = (
            group.all_reduce(x), group.all_reduce(x, "mean"), group.all_reduce(x, "max"), group.all_gather(x),
            group.reduce_scatter(x), group.broadcast(x, 1),
        )
        for mode, outputs in (("pynative", eager), ("jit", _AllInJit(group)(x))):
            for name, got in zip(expected, outputs):
                results[f"{name}/{mode}/native={native}"] = bool(np.array_equal(got.asnumpy(), expected[name]))
    got = comm.send_receive(ms.Tensor(values[rank]), 0, 1).asnumpy()
    results["p2p"] = bool(np.array_equal(got, values[0]))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def late(out_dir: Path, seconds: str) -> None:
    """Rank 1 reaches an all-reduce `seconds` after rank 0 (as a rank still compiling its first step would);
    each rank writes the sum it got."""
    import time

    comm.init()
    rank = comm.rank()
    group = comm.group(range(comm.world_size()))
    group.all_reduce(ms.Tensor(np.ones(2, np.float32)))  # both ranks are up
    if rank == 1:
        time.sleep(float(seconds))
    summed = group.all_reduce(ms.Tensor(np.full(2, rank + 1, np.float32))).asnumpy()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summed.tolist()))


def freeze(out_dir: Path) -> None:
    """Rank 1 stops (SIGSTOP: alive, but silent, as a rank on a host that lost the network) while rank 0 waits
    for it in an all-reduce."""
    import os
    import signal

    comm.init()
    group = comm.group(range(comm.world_size()))
    group.all_reduce(ms.Tensor(np.ones(2, np.float32)))  # both ranks are up
    if comm.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    group.all_reduce(ms.Tensor(np.ones(2, np.float32)))


def train(out_dir: Path, dataset_dir: str, *options: str) -> None:
    """Train with params `tiny` + `--set` overrides, resuming from `--resume` (default: start fresh); write
    this rank's metrics history, held parameter, optimizer-state and gradient-buffer bytes (read back from the
    arrays), and its weights as held at the start and the end (rank<r>_initial.npz, rank<r>_final.npz; ZeRO-3
    shards under ZeRO-3, their gradient buffers under parameter offload), and how many offload files it still maps."""
    from model_core.model.weights import model_weights, named_weights
    from model_core.optim.offload import offload_mappings
    from model_core.parallel.zero import moment_bytes
    from model_core.train.trainer import Trainer
    from params import load_params

    pairs = list(zip(options[::2], options[1::2]))
    params = load_params("tiny", [value for flag, value in pairs if flag == "--set"])
    resume = next((value for flag, value in pairs if flag == "--resume"), "none")
    trainer = Trainer(params, dataset_dir, out_dir / "checkpoints")
    np.savez(out_dir / f"rank{trainer.rank}_initial.npz", **model_weights(trainer.model))
    result = trainer.run(resume=resume)
    optimizer = trainer.optimizer
    held = optimizer.moment_bytes() if hasattr(optimizer, "moment_bytes") else moment_bytes(optimizer)
    gradient_bytes = sum(buffer.asnumpy().nbytes for buffer in trainer.parallel.accumulate.buffers)
    parameter_bytes = sum(param.asnumpy().nbytes for param in named_weights(trainer.model).values())
    np.savez(out_dir / f"rank{trainer.rank}_final.npz", **model_weights(trainer.model))
    report = {
        "history": result.history, "moment_bytes": held, "gradient_bytes": gradient_bytes,
        "parameter_bytes": parameter_bytes, "checkpoint": str(result.checkpoint),
        "offload_mappings_after_run": len(offload_mappings()),
    }
    (out_dir / f"rank{trainer.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"comm": check_comm, "freeze": freeze, "late": late, "train": train}[command](out, *sys.argv[3:])
