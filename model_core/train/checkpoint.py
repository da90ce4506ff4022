"""Training checkpoints: tensors in safetensors, trainer state in JSON, a sha256 manifest, atomic writes.

A checkpoint is a directory `step-00000100/` holding `model.safetensors` (weights by their model names),
`optimizer.safetensors` (AdamW moments), `state.json` (step, loss scale, data position, counters, the
params it was made with) and `manifest.json` (sha256 of the other three). It is built in a temporary
sibling and renamed into place, so a crash never leaves a half-written `step-*` directory; the newest
`keep` checkpoints are kept. `latest_valid` skips (and warns about) a checkpoint whose files do not match
their manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from model_core.data.shards import file_sha256

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "state.json"
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
        """(weights, optimizer moments, trainer state)."""
        return (
            load_file(self.path / "model.safetensors"),
            load_file(self.path / "optimizer.safetensors"),
            json.loads((self.path / STATE).read_text()),
        )


def save_checkpoint(
    directory: str | Path,
    step: int,
    weights: dict[str, np.ndarray],
    optimizer: dict[str, np.ndarray],
    state: dict,
    keep: int,
) -> Checkpoint:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:08d}"
    building = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=directory))
    try:
        save_file(weights, str(building / "model.safetensors"))
        save_file(optimizer, str(building / "optimizer.safetensors"))
        (building / STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
        files = {name: file_sha256(building / name) for name in (*TENSOR_FILES, STATE)}
        (building / MANIFEST).write_text(json.dumps({"step": step, "sha256": files}, indent=2))
        _fsync_dir(building)
        if final.exists():  # a rerun of the same step replaces it whole
            shutil.rmtree(final)
        os.replace(building, final)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    _prune(directory, keep)
    return Checkpoint(final, step)


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
    missing = {*TENSOR_FILES, STATE} - set(manifest.get("sha256", {}))
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


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as handle:
            os.fsync(handle.fileno())


def run_directory(output_dir: str | Path, name: str, params_hash: str, dataset_dir: str | Path, stage: str) -> Path:
    """`<output_dir>/<name>-<params hash>-<dataset key>/<stage>`: one run's checkpoints, where `--resume auto`
    looks. New data (a new prepared dataset directory) or new params start a new run instead of resuming."""
    return Path(output_dir) / f"{name}-{params_hash[:12]}-{Path(dataset_dir).name[:12]}" / stage
