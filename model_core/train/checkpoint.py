"""Training checkpoints: tensors in safetensors, trainer state in JSON, a layout record, a sha256 manifest,
atomic writes.

A checkpoint is a directory `step-00000100/` holding the weights by their model names and the AdamW
moments, `state.json` (step, loss scale, data position, counters, the params it was made with),
`layout.json` (the dp x tp x pp layout it was trained under) and `manifest.json` (sha256 of all the others).
Under tensor parallelism each tp rank's block is a file of its own (`model-tp1-of-2.safetensors`,
`optimizer-tp1-of-2.safetensors`; replicated tensors are in every file); under pipeline parallelism each
stage's (`model-pp1-of-2.safetensors`, or `model-pp1-of-2-tp0-of-2.safetensors` with both), holding the
weights of its layers; with one rank of each the files are `model.safetensors` and `optimizer.safetensors`.
Optimizer moments are always whole over dp (ZeRO shards are gathered), so only tp and pp change the files;
`model_core.train.reshard` converts between layouts.

A checkpoint is built in a temporary sibling and renamed into place, so a crash never leaves a
half-written `step-*` directory; the newest `keep` checkpoints are kept. Under msrun the ranks that hold a
shard write it into the sibling and one rank commits: writing every shard from its own rank means no rank
ever holds the whole model (ranks of one job share the checkpoint filesystem). `latest_valid` skips (and
warns about) a checkpoint whose files do not match their manifest.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from model_core.parallel.layout import Layout
from model_core.storage import commit_directory, file_sha256

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "state.json"
LAYOUT = "layout.json"
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")

Tensors = dict[str, np.ndarray]


def block_index(layout: Layout, stage: int, tp_index: int) -> int:
    """The number of the block that pipeline stage `stage`, tensor-parallel rank `tp_index` writes."""
    return stage * layout.tp + tp_index


def shard_files(index: int, layout: Layout) -> tuple[str, str]:
    """(weights, moments) file names of block `index` (`block_index`) of `layout`."""
    stage, tp_index = divmod(index, layout.tp)
    parts = [f"pp{stage}-of-{layout.pp}"] if layout.pp > 1 else []
    parts += [f"tp{tp_index}-of-{layout.tp}"] if layout.tp > 1 else []
    if not parts:
        return TENSOR_FILES
    suffix = "-".join(parts)
    return f"model-{suffix}.safetensors", f"optimizer-{suffix}.safetensors"


def all_shard_files(layout: Layout) -> set[str]:
    return {name for index in range(layout.tp * layout.pp) for name in shard_files(index, layout)}


class CheckpointLayoutError(ValueError):
    """The checkpoint's files are split for another layout than the reader asked for."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    def layout(self) -> Layout:
        """The layout it was trained under (one rank for checkpoints written before layouts were recorded)."""
        path = self.path / LAYOUT
        if not path.is_file():
            return Layout()
        return Layout(**json.loads(path.read_text()))

    def state(self) -> dict:
        return json.loads((self.path / STATE).read_text())

    def load_shard(self, index: int) -> tuple[Tensors, Tensors]:
        """(weights, optimizer moments) of block `index` (`block_index`: the tp rank when pp is 1)."""
        weights, moments = shard_files(index, self.layout())
        return load_file(self.path / weights), load_file(self.path / moments)

    def load(self) -> tuple[Tensors, Tensors, dict]:
        """(weights, optimizer moments, trainer state) of a checkpoint stored as one block."""
        layout = self.layout()
        if layout.tp != 1 or layout.pp != 1:
            raise CheckpointLayoutError(
                f"{self.path} is split over tensor_parallel={layout.tp} x pipeline_parallel={layout.pp}; join its "
                "blocks with model_core.train.reshard (reshard to tp 1 pp 1, or whole_tensors)"
            )
        return (*self.load_shard(0), self.state())


def save_checkpoint(
    directory: str | Path,
    step: int,
    weights: Tensors,
    optimizer: Tensors,
    state: dict,
    keep: int,
) -> Checkpoint:
    """Write the checkpoint of a one-rank run from its one process."""
    return save_shards(directory, step, {0: (weights, optimizer)}, state, Layout(), keep)


def save_shards(
    directory: str | Path,
    step: int,
    shards: Mapping[int, tuple[Tensors, Tensors]],
    state: dict | None,
    layout: Layout,
    keep: int | None,
    barrier: Callable[[], None] = lambda: None,
) -> Checkpoint | None:
    """Write this process's blocks {block index: (weights, moments)} of a checkpoint.

    Every process of the job calls it with the same step (`barrier` waits for all of them); exactly one
    passes `state` and commits: it prepares the temporary directory, and once every block is written, adds
    state, layout and manifest and renames it into place, then keeps the newest `keep` checkpoints (all
    when None). Returns the checkpoint on the committing process.
    """
    directory = Path(directory)
    final = directory / f"step-{step:08d}"
    building = directory / f".{final.name}.partial"
    committing = state is not None
    if committing:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)  # left by a crash in an earlier attempt at this step
        building.mkdir()
    barrier()
    for index, (weights, moments) in shards.items():
        weights_file, moments_file = shard_files(index, layout)
        save_file(weights, str(building / weights_file))
        save_file(moments, str(building / moments_file))
    barrier()
    if not committing:
        return None
    try:
        _commit(building, final, step, state, layout)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    if keep is not None:
        _prune(directory, keep)
    return Checkpoint(final, step)


def _commit(building: Path, final: Path, step: int, state: dict, layout: Layout) -> None:
    expected = all_shard_files(layout)
    missing = sorted(expected - {path.name for path in building.iterdir()})
    if missing:
        raise FileNotFoundError(f"checkpoint step {step}: no rank wrote {missing} into {building}")
    (building / STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
    split = {} if layout.pipeline_layers is None else {"pipeline_layers": list(layout.pipeline_layers)}
    split |= {"cp": layout.cp} if layout.cp > 1 else {}  # a record only: cp changes nothing a checkpoint holds
    (building / LAYOUT).write_text(json.dumps({"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, **split}))
    files = {name: file_sha256(building / name) for name in (*sorted(expected), STATE, LAYOUT)}
    (building / MANIFEST).write_text(json.dumps({"step": step, "sha256": files}, indent=2))
    commit_directory(building, final, replace=True)  # a rerun of the same step replaces it whole


def list_checkpoints(directory: str | Path) -> list[Checkpoint]:
    """Every `step-*` checkpoint directory, oldest first (not verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            found.append(Checkpoint(path, int(suffix)))
    return sorted(found, key=lambda checkpoint: checkpoint.step)


def verify(checkpoint: Checkpoint) -> str | None:
    """None when every file matches the manifest, else what is wrong."""
    try:
        manifest = json.loads((checkpoint.path / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        return f"unreadable {MANIFEST}: {error}"
    for name, expected in manifest.get("sha256", {}).items():
        path = checkpoint.path / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != expected:
            return f"{name} does not match its sha256"
    required = all_shard_files(checkpoint.layout()) | {STATE}
    missing = required - set(manifest.get("sha256", {}))
    return f"manifest lists no {sorted(missing)}" if missing else None


def latest_valid(directory: str | Path) -> Checkpoint | None:
    """The newest checkpoint whose files match their manifest; corrupted ones are skipped with a warning."""
    for checkpoint in reversed(list_checkpoints(directory)):
        problem = verify(checkpoint)
        if problem is None:
            return checkpoint
        logger.warning("skipping corrupted checkpoint %s: %s", checkpoint.path, problem)
    return None


def _prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)

