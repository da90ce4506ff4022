"""One rank of benchmarks/rank_memory.py: build the Trainer from initial weights on disk under an RSS sampler, run
a few steps, and write what this rank held as JSON (OUT/rank<r>.json).

    python benchmarks/_rank_memory_worker.py --threads N --steps S DATASET WEIGHTS OUT [--set section.field=value ...]

The Trainer's public surface is used (its constructor, `model`, `optimizer`, `run`), and the build window is the
call of `model_core.parallel.parallelize.build_shard`, which makes this rank's model and loads its initial
weights; the optimizer, gradient buffers and compiled step come after it and are not part of the build.

After the build, each call of the step's three phases (`Parallelized.gradients`, `gradient_norm`, `apply`) is
watched through the kernel's high-water mark (VmHWM, reset before each call through /proc/self/clear_refs), so
the report says which phase of which step reached the rank's peak and how much RSS each phase left behind, with
glibc's view of the heap (mallinfo2: bytes in use and free bytes it keeps) at those points. Resetting VmHWM also
resets `ru_maxrss`, so the rank's peak is the largest of the build window's and the phases' high-water marks.
At the end, after the figures are taken, `malloc_trim(0)` shows how much of the resident memory was freed heap
glibc had kept (a diagnostic: the measured peak is not changed by it), and the bytes of every Parameter the process
holds are counted (`every_parameter_bytes`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import re
import resource
import sys
import threading
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SAMPLE_INTERVAL_S = 0.002


class BuildWindow:
    """Peak RSS of this process between `open()` and `close()`, sampled every 2 ms by a thread.

    A sampler can miss a short peak, and a sample needs the GIL, which a long C call may hold. So the kernel's
    high-water mark backs it up: if `ru_maxrss` rose inside the window, the window's peak is that new maximum
    exactly; if it did not, the peak lies below the earlier maximum and only the samples can say where."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.before = self.peak = 0
        self.closed_by: str | None = None

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.peak = max(self.peak, self._rss())

    def open(self) -> None:
        gc.collect()  # garbage from setup is not the build's
        self.before = self.peak = self._rss()
        self._maxrss_before = _maxrss_bytes()
        self._thread.start()

    def close(self, by: str) -> None:
        if self.closed_by is not None:
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        maxrss = _maxrss_bytes()
        if maxrss > self._maxrss_before:
            self.peak = max(self.peak, maxrss)
        self.closed_by = by


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def heap() -> dict[str, int]:
    """glibc's heap: bytes handed out (small blocks in arenas, and mmap'd large ones) and free bytes it keeps."""
    info = _LIBC.mallinfo2()
    return {"heap_in_use_bytes": info.uordblks + info.hblkhd, "heap_free_kept_bytes": info.fordblks}


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def anonymous_bytes() -> int:
    """Resident anonymous memory (heap, mmap'd arrays, the runtime's pools), from /proc/self/smaps_rollup."""
    return int(re.search(r"^Anonymous:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text(), re.M).group(1)) * 1024


class PhaseWatch:
    """VmHWM around each call of the step's phases; `peak` is the largest high-water mark seen since `start`."""

    def __init__(self, first_peak: int) -> None:
        self.peak = first_peak
        self.phases: list[dict] = []
        self.calls: dict[str, int] = {}

    def _high_water(self) -> int:
        high = _status_kib("VmHWM") * 1024
        self.peak = max(self.peak, high)
        return high

    def _reset(self) -> None:
        self._high_water()  # fold the mark so far into the peak before the kernel forgets it
        Path("/proc/self/clear_refs").write_text("5")

    def wrap(self, owner, name: str) -> None:
        call = getattr(owner, name)

        def watched(*arguments, **options):
            before = rss_bytes()
            self._reset()
            try:
                return call(*arguments, **options)
            finally:
                self.calls[name] = self.calls.get(name, 0) + 1
                self.phases.append({"phase": f"{name}#{self.calls[name]}", "rss_before_bytes": before,
                                    "peak_bytes": self._high_water(), "rss_after_bytes": rss_bytes(), **heap()})
                self._reset()

        setattr(owner, name, watched)

    def finish(self) -> int:
        self._high_water()
        return self.peak


def build_trainer(params, dataset: str, weights: str, out: Path, steps: int, window: BuildWindow):
    """The Trainer, with the build window around `parallelize.build_shard`: the one call that makes this rank's
    model and loads its initial weights (the optimizer, gradient buffers and compiled step come after it)."""
    from model_core.parallel import parallelize as wiring
    from model_core.train.trainer import Trainer

    build = wiring.build_shard

    def watched(*arguments, **options):
        window.open()
        try:
            return build(*arguments, **options)
        finally:
            window.close("build_shard")

    wiring.build_shard = watched
    try:
        trainer = Trainer(params, dataset, out / "checkpoints", steps=steps, initial_weights=weights)
    finally:
        wiring.build_shard = build
    if window.closed_by is None:
        raise RuntimeError("the Trainer never called parallelize.build_shard: no build window")
    return trainer


def held_bytes(*cells) -> list[int]:
    """Bytes of the Parameters each cell holds that no earlier cell holds (an optimizer lists the model's)."""
    seen: set[int] = set()
    totals = []
    for cell in cells:
        total = 0
        for _, param in cell.parameters_and_names():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.nbytes
        totals.append(total)
    return totals


def every_parameter_bytes() -> int:
    """Bytes of every Parameter alive in the process, each counted once: the weights, masters, gradient buffers,
    shard copies and moments, wherever a cell or the optimizer keeps them. On an accelerator these are device
    memory; the rest of a rank's device memory is the runtime's pool, which the parent reads from MindSpore's own
    statistics at exit."""
    from mindspore import Parameter

    held = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, Parameter):
                held[id(obj)] = obj
        except ReferenceError:  # a weak proxy whose object is gone
            continue
    return sum(int(param.nbytes) for param in held.values())


def largest_full_tensor_bytes(model, weights: Path) -> tuple[int, list[str]]:
    """The largest tensor of the checkpoint, at its full size, of which `model` holds a part (matched by
    parameter path), and the model's parameter paths the checkpoint does not name."""
    from safetensors import safe_open

    with safe_open(str(weights / "model.safetensors"), framework="numpy") as stored:
        stored_names = stored.keys()  # safe_open is not iterable
        full = {name: math.prod(stored.get_slice(name).get_shape()) * 4 for name in stored_names}  # loaded as fp32
    names = [name for name, _ in model.parameters_and_names()]
    held = [full[name] for name in names if name in full]
    if not held:
        raise RuntimeError(f"no parameter path of the model is a tensor of {weights}: {names[:5]} ...")
    return max(held), [name for name in names if name not in full]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("dataset")
    parser.add_argument("weights", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()

    import mindspore as ms

    from model_core.parallel.layout import Layout
    from params import load_params

    ms.device_context.cpu.op_tuning.threads_num(args.threads)
    params = load_params("tiny", [*args.overrides, f"train.steps={args.steps}", "train.log_interval=1",
                                  "train.eval_interval=100000", "train.checkpoint_interval=100000"])
    world = params.parallel.world_size
    if world > 1:
        from mindspore.communication import get_rank, init

        init()  # joining the job (msrun's scheduler serves it from in here) is not part of the build
        rank = get_rank()
    else:
        rank = 0
    window = BuildWindow()
    trainer = build_trainer(params, args.dataset, args.weights, args.out, args.steps, window)
    # Neither a final checkpoint nor a validation pass is part of what a rank holds to train.
    trainer.save = lambda: None
    trainer.evaluate = lambda: float("nan")
    after_build = {"rss_bytes": rss_bytes(), "anonymous_bytes": anonymous_bytes(), **heap()}
    watch = PhaseWatch(max(window.peak, _maxrss_bytes()))
    for name in ("gradients", "gradient_norm", "apply"):
        watch.wrap(trainer.parallel, name)
    result = trainer.run()
    peak = watch.finish()
    gc.collect()
    at_end = {"rss_bytes": rss_bytes(), "anonymous_bytes": anonymous_bytes(), **heap()}
    _LIBC.malloc_trim(0)
    at_end["rss_after_malloc_trim_bytes"] = rss_bytes()
    param_bytes, optimizer_bytes = held_bytes(trainer.model, trainer.optimizer)
    every_parameter = every_parameter_bytes()
    largest, unmatched = largest_full_tensor_bytes(trainer.model, args.weights)
    report = {
        "rank": rank,
        "stage": Layout.from_params(params, world).coordinates(rank).pp,
        "rss_before_bytes": window.before,
        "build_peak_bytes": window.peak,
        "build_bytes": window.peak - window.before,
        "build_window_closed_by": window.closed_by,
        "param_bytes": param_bytes,
        "optimizer_bytes": optimizer_bytes,
        "every_parameter_bytes": every_parameter,
        "largest_full_tensor_bytes": largest,
        "parameters_not_in_checkpoint": unmatched,
        "peak_rss_bytes": peak,
        "skipped_steps": result.skipped_steps,
        "after_trainer_built": after_build,
        "phases": watch.phases,
        "at_end": at_end,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
