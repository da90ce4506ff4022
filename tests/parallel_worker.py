"""Worker programs that tests/test_*_msrun.py start under msrun; each rank writes its findings as JSON.

    python tests/parallel_worker.py collectives OUT_DIR LATE_SECONDS
    python tests/parallel_worker.py freeze OUT_DIR
    python tests/parallel_worker.py train OUT_DIR DATASET_DIR [--resume PATH] [--lora yes] [--emulate OPERATORS]
                                        [--set section.field=value ...]
    python tests/parallel_worker.py jobs LOG_DIR JOBS_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

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


def _groups(rank: int, size: int) -> list[tuple[object, comm.Group]]:
    """The world group three ways, by label: the native operators the backend has (True), the all-reduce
    fallbacks alone (False), and every operator's native path with stand-ins where the backend lacks it
    ("emulated": the code that otherwise runs only on Ascend and GPU)."""
    ranks = tuple(range(size))
    return [(True, comm.Group(ranks, rank)), (False, comm.Group(ranks, rank, use_native=False)),
            ("emulated", comm.Group(ranks, rank, emulate=frozenset(comm.EMULABLE)))]


def check_comm() -> dict[str, bool]:
    """Every collective, native and fallback, PyNative and jit, against numpy."""
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
    for native, group in _groups(rank, size):
        eager = (
            group.all_reduce(x), group.all_reduce(x, "mean"), group.all_reduce(x, "max"), group.all_gather(x),
            group.reduce_scatter(x), group.broadcast(x, 1),
        )
        for mode, outputs in (("pynative", eager), ("jit", _AllInJit(group)(x))):
            for name, got in zip(expected, outputs):
                results[f"{name}/{mode}/native={native}"] = bool(np.array_equal(got.asnumpy(), expected[name]))
    got = comm.send_receive(ms.Tensor(values[rank]), 0, 1).asnumpy()
    results["p2p"] = bool(np.array_equal(got, values[0]))
    return results


ROWS = 2  # rows of each all-to-all block


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


def check_all_to_all() -> dict[str, bool]:
    """The all-to-all (native where the backend has it, the all-reduce fallback otherwise) and its gradient,
    PyNative and jit, against numpy, on the world group."""
    rank, size = comm.rank(), comm.world_size()
    inputs = [_blocks(r, size, 0.0) for r in range(size)]
    weights = [_blocks(r, size, 0.5) for r in range(size)]
    expected, expected_grad = _all_to_all(inputs, rank), _all_to_all(weights, rank)
    x = Tensor(inputs[rank])
    results = {}
    for native, group in _groups(rank, size):
        loss = _WeightedSum(group, weights[rank])
        results[f"values/pynative/native={native}"] = bool(np.array_equal(group.all_to_all(x).asnumpy(), expected))
        for mode, (_, grad) in (("pynative", ms.value_and_grad(loss, grad_position=0)(x)), ("jit", _ValueAndGradInJit(loss)(x))):
            results[f"grad/{mode}/native={native}"] = bool(np.array_equal(grad.asnumpy(), expected_grad))
        results[f"path/native={native}"] = "native" if group.native_all_to_all else "fallback"
    return results


class _SequenceWeightedSum(nn.Cell):
    """sum(operator(x, *weights) * mask): its gradient in x is the operator's backward of the mask."""

    def __init__(self, operator: nn.Cell, mask: np.ndarray, *weights: np.ndarray) -> None:
        super().__init__()
        self.operator = operator
        self.mask = Tensor(mask)
        self.weights = tuple(Tensor(w) for w in weights)

    def construct(self, x):
        return (self.operator(x, *self.weights) * self.mask).sum()


def check_sequence_collectives() -> dict[str, bool]:
    """The all-gather and reduce-scatter along the sequence (axis 1 of [B, T, H]), native and fallback, and the input
    gradients of sequence parallelism's two operators (a projection of the gathered sequence, and the reduce-scatter),
    PyNative and jit, against numpy. Small integers, so every sum is exact in any order."""
    from model_core.parallel.tensor import ReduceScatterToSequenceParallel, SequenceGatheredLinear

    rank, size = comm.rank(), comm.world_size()
    slices = [(np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) % 5) * (r + 1) - r for r in range(size)]
    wholes = [np.arange(2 * 3 * size * 4, dtype=np.float32).reshape(2, 3 * size, 4) % 7 + 10 * r for r in range(size)]
    weight = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) % 3 - 1  # [out, in]
    masks = [np.arange(2 * 3 * size * 5, dtype=np.float32).reshape(2, 3 * size, 5) % 4 - r for r in range(size)]
    whole_input = np.concatenate(slices, axis=1)
    expected = {
        "gather_sequence": (whole_input, None),
        "scatter_sequence": (np.split(sum(wholes), size, axis=1)[rank], whole_input),
        "gathered_linear": (whole_input @ weight.T, np.split(sum(masks) @ weight, size, axis=1)[rank]),
    }
    results = {}
    for native, group in _groups(rank, size):
        got = {"gather_sequence": group.all_gather_sequence(Tensor(slices[rank])),
               "scatter_sequence": group.reduce_scatter_sequence(Tensor(wholes[rank])),
               "gathered_linear": SequenceGatheredLinear(group)(Tensor(slices[rank]), Tensor(weight))}
        losses = {"scatter_sequence": (_SequenceWeightedSum(ReduceScatterToSequenceParallel(group), slices[rank]), wholes[rank]),
                  "gathered_linear": (_SequenceWeightedSum(SequenceGatheredLinear(group), masks[rank], weight), slices[rank])}
        for name, (value, gradient) in expected.items():
            results[f"{name}/pynative/native={native}"] = bool(np.array_equal(got[name].asnumpy(), value))
            if gradient is None:
                continue
            loss, x = losses[name]
            for mode, (_, grad) in (("pynative", ms.value_and_grad(loss, grad_position=0)(Tensor(x))),
                                    ("jit", _ValueAndGradInJit(loss)(Tensor(x)))):
                results[f"{name}_grad/{mode}/native={native}"] = bool(np.array_equal(grad.asnumpy(), gradient))
    return results


def late(seconds: float) -> list[float]:
    """Rank 1 reaches an all-reduce `seconds` after rank 0 (as a rank still compiling its first step would);
    the sum each rank got."""
    import time

    group = comm.group(range(comm.world_size()))
    group.all_reduce(ms.Tensor(np.ones(2, np.float32)))  # both ranks are in step
    if comm.rank() == 1:
        time.sleep(seconds)
    return group.all_reduce(ms.Tensor(np.full(2, comm.rank() + 1, np.float32))).asnumpy().tolist()


def collectives(out_dir: Path, late_seconds: str) -> None:
    """check_comm's (with check_sequence_collectives'), check_all_to_all's and late's findings from one job: starting
    a job costs more than all the checks."""
    comm.init()
    found = {"comm": {**check_comm(), **check_sequence_collectives()}, "all_to_all": check_all_to_all(),
             "late": late(float(late_seconds))}
    (out_dir / f"rank{comm.rank()}.json").write_text(json.dumps(found))


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
    """Train with params `tiny` + `--set` overrides (LoRA adapters of params.lora with `--lora yes`; the native
    paths of the collectives named by `--emulate`, with stand-ins: `comm.EMULATED_COLLECTIVES_ENV`), resuming from
    `--resume` (default: start fresh); write
    this rank's metrics history, held parameter, optimizer-state and gradient-buffer bytes (read back from the
    arrays), and its weights as held at the start and the end (rank<r>_initial.npz, rank<r>_final.npz; ZeRO-3
    shards under ZeRO-3, their gradient buffers under parameter offload), and how many offload files it still maps."""
    from model_core.model.weights import model_weights, named_weights
    from model_core.optim.offload import offload_mappings
    from model_core.train.trainer import Trainer
    from params import load_params

    pairs = list(zip(options[::2], options[1::2]))
    params = load_params("tiny", [value for flag, value in pairs if flag == "--set"])
    resume = next((value for flag, value in pairs if flag == "--resume"), "none")
    lora = params.lora if ("--lora", "yes") in pairs else None
    emulate = next((value for flag, value in pairs if flag == "--emulate"), "")
    os.environ[comm.EMULATED_COLLECTIVES_ENV] = emulate  # read when the trainer asks for its groups
    try:
        trainer = Trainer(params, dataset_dir, out_dir / "checkpoints", lora=lora)
    finally:
        del os.environ[comm.EMULATED_COLLECTIVES_ENV]
    np.savez(out_dir / f"rank{trainer.rank}_initial.npz", **model_weights(trainer.model))
    result = trainer.run(resume=resume)
    optimizer = trainer.optimizer
    held = optimizer.moment_bytes()
    gradient_bytes = sum(buffer.asnumpy().nbytes for buffer in trainer.parallel.accumulate.buffers)
    parameter_bytes = sum(param.asnumpy().nbytes for param in named_weights(trainer.model).values())
    weights = {id(param) for param in trainer.model.get_parameters()}
    # What the optimizer holds besides the model's weights: moments, masters, update buffers (its groups' integer
    # one-hot rows of their ranks aside).
    optimizer_bytes = sum(param.asnumpy().nbytes for param in optimizer.get_parameters()
                          if id(param) not in weights and param.dtype == ms.float32)
    np.savez(out_dir / f"rank{trainer.rank}_final.npz", **model_weights(trainer.model))
    report = {
        "history": result.history, "moment_bytes": held, "gradient_bytes": gradient_bytes,
        "optimizer_bytes": optimizer_bytes, "parameter_bytes": parameter_bytes, "checkpoint": str(result.checkpoint),
        "offload_mappings_after_run": len(offload_mappings()),
        "zero2_native_reduce_scatter": _zero2_native(trainer),
    }
    (out_dir / f"rank{trainer.rank}.json").write_text(json.dumps(report))


def _zero2_native(trainer) -> bool | None:
    """Whether ZeRO-2's (dense) gradient store reduce-scatters through the native operator's path (False: the
    all-reduce fallback); None without one."""
    shards = getattr(trainer.parallel.accumulate, "shards", None)
    shards = getattr(shards, "dense", shards)  # under expert parallelism, the dense weights' store
    return None if shards is None else bool(shards.group.native_reduce_scatter)


def jobs(log_dir: Path, jobs_json: str) -> None:
    """`train` for each job of JOBS_JSON (a list of {"out": OUT_DIR, "arguments": [DATASET_DIR, options...]}), one
    after another: each job builds its own Trainer, as a new process would, and the workers start once. Rank 0
    writes each job's seconds (compile included) to LOG_DIR/job_seconds.json, to show where a launch's time goes."""
    import gc
    import time

    seconds = {}
    for job in json.loads(Path(jobs_json).read_text()):
        out = Path(job["out"])
        out.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        train(out, *job["arguments"])
        seconds[job["out"]] = round(time.monotonic() - started, 1)
        gc.collect()
        ms.ms_memory_recycle()  # the finished job's cached runtime memory, which MindSpore keeps per model
    if comm.rank() == 0:
        (log_dir / "job_seconds.json").write_text(json.dumps(seconds, indent=1))


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"collectives": collectives, "freeze": freeze, "jobs": jobs, "train": train}[command](out, *sys.argv[3:])
