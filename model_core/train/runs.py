"""Where each stage run lives and whether its result is already there.

A stage run's directory is named by the key of the inputs that decide its result (params/identity.py has the
table). A pretraining run also records in `run.json` what it is: its lineage (the training inputs and origin,
without the data), its dataset, its start and its final step. That record lets `train.continue_from: latest`
find, when new data arrives, the newest finished run of the same lineage to continue from, and lets the ranks
of a run launched under msrun read the start their launcher chose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from model_core.storage import file_sha256, write_file
from model_core.train.checkpoint import MANIFEST, Checkpoint, latest_valid, list_checkpoints
from model_core.train.finetune import finetune_params
from params.identity import stage_directory, stage_key, training_inputs
from params.schema import PipelineParams

RUN_RECORD = "run.json"
WEIGHTS = "model.safetensors"
ADAPTERS = "adapters.safetensors"


@dataclass(frozen=True)
class TrainingRun:
    """One training stage run: its directory, the step it ends at, and the checkpoint of an earlier run it
    continues (weights, moments and step number), if any."""

    directory: Path
    final_step: int
    continue_from: Path | None = None
    record: dict | None = None

    def newest(self) -> Checkpoint | None:
        """The newest checkpoint directory, valid or not: whether the run has started."""
        found = list_checkpoints(self.directory)
        return found[-1] if found else None

    def finished(self) -> Checkpoint | None:
        """Its valid checkpoint of the final step, when the run is complete."""
        found = latest_valid(self.directory)
        return found if found is not None and found.step >= self.final_step else None

    def write_record(self) -> None:
        if self.record is None:
            return
        write_file(self.directory / RUN_RECORD, json.dumps(self.record, indent=2, sort_keys=True) + "\n")

    @classmethod
    def at(cls, directory: str | Path, steps: int) -> TrainingRun:
        """The run in a given directory: as its record says, or a fresh run of `steps` steps."""
        directory = Path(directory)
        record = _read_record(directory)
        if record is None:
            return cls(directory, steps)
        start = record.get("continue_from")
        return cls(directory, record["final_step"], Path(start) if start else None, record)


def smoke_run(params: PipelineParams, dataset_dir: str | Path) -> TrainingRun:
    """The smoke run: smoke.steps steps from a random initialisation."""
    smoke = params.model_copy(update={"train": params.train.model_copy(update={"steps": params.smoke.steps})})
    key = stage_key("smoke", {"training": training_inputs(smoke), "dataset": Path(dataset_dir).name})
    return TrainingRun(stage_directory(params, "smoke", key), params.smoke.steps)


def pretraining_run(params: PipelineParams, dataset_dir: str | Path, converted: str | Path | None = None) -> TrainingRun:
    """The pretraining run these params and this dataset make, from a random initialisation or `converted`
    weights, or with train.continue_from=latest: the run already made on this dataset, else the continuation of
    the newest finished run of the same lineage on other data."""
    origin = f"converted:{Path(converted).name}" if converted is not None else "random"
    lineage = stage_key("lineage", {"training": training_inputs(params), "origin": origin})
    dataset = Path(dataset_dir).name
    record = {"lineage": lineage, "dataset": dataset, "tokenizer_sha256": _tokenizer_sha256(dataset_dir)}
    fresh = _pretraining(params, {**record, "start": origin, "continue_from": None, "final_step": params.train.steps})
    if params.train.continue_from == "none":
        return fresh
    runs = [run for run in _recorded_runs(params) if run.record["lineage"] == lineage]
    here = [run for run in runs if run.record["dataset"] == dataset]
    if here:
        return max(here, key=lambda run: (run.directory / RUN_RECORD).stat().st_mtime)
    earlier = [(found, run) for run in runs if (found := run.finished()) is not None]
    if not earlier:
        return fresh
    checkpoint, previous = max(earlier, key=lambda pair: (pair[0].path / MANIFEST).stat().st_mtime)
    if previous.record["tokenizer_sha256"] != record["tokenizer_sha256"]:
        raise ValueError(
            f"train.continue_from=latest: {previous.directory} was trained with another tokenizer than the one "
            f"prepared with {dataset_dir}; set tokenizer.model_path to its tokenizer to continue it, or "
            "train.continue_from=none to start afresh"
        )
    start = f"continued:{previous.directory.name}/{checkpoint.path.name}"
    final_step = checkpoint.step + params.train.steps
    return _pretraining(params, {**record, "start": start, "continue_from": str(checkpoint.path), "final_step": final_step})


def _pretraining(params: PipelineParams, record: dict) -> TrainingRun:
    key = stage_key("pretrain", {name: record[name] for name in ("lineage", "dataset", "start")})
    start = record["continue_from"]
    return TrainingRun(stage_directory(params, "pretrain", key), record["final_step"], Path(start) if start else None, record)


def _recorded_runs(params: PipelineParams) -> list[TrainingRun]:
    found = []
    for path in Path(params.train.output_dir).glob(f"pretrain-*/{RUN_RECORD}"):
        run = TrainingRun.at(path.parent, 0)
        if run.record is not None:
            found.append(run)
    return found


def _read_record(directory: Path) -> dict | None:
    try:
        return json.loads((directory / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _tokenizer_sha256(dataset_dir: str | Path) -> str:
    return json.loads((Path(dataset_dir) / "manifest.json").read_text())["tokenizer"]["sha256"]


def content_identity(directory: str | Path) -> str:
    """What a checkpoint or adapters directory holds, cheaply: the sha256 of its manifest (which lists every
    file's sha256) where it has one, else of its weights."""
    directory = Path(directory)
    for name in (MANIFEST, ADAPTERS, WEIGHTS):
        if (directory / name).is_file():
            return file_sha256(directory / name)
    raise FileNotFoundError(f"{directory} holds none of {MANIFEST}, {ADAPTERS}, {WEIGHTS}: it is not a checkpoint")


def finetune_directory(params: PipelineParams, base: str | Path, instructions_dir: str | Path) -> Path:
    """The fine-tuning run of these lora params on `base` and this instruction dataset."""
    inputs = {
        "training": training_inputs(finetune_params(params)),
        "lora": params.lora.model_dump(mode="json", exclude={"enabled"}),
        "base": content_identity(base),
        "instructions": Path(instructions_dir).name,
    }
    return stage_directory(params, "finetune", stage_key("finetune", inputs))


def eval_directory(
    params: PipelineParams, checkpoint: str | Path, adapters: str | Path | None, held_out: dict[str, Path]
) -> Path:
    """The report of one model (a checkpoint, with or without adapters) on these held-out sets."""
    inputs = {
        "eval": params.eval.model_dump(mode="json"),
        "model": params.model.model_dump(mode="json"),
        "batches": params.train.model_dump(mode="json", include={"micro_batch_size", "reset_at_document_boundaries"}),
        "checkpoint": content_identity(checkpoint),
        "adapters": content_identity(adapters) if adapters is not None else None,
        "held_out": {name: Path(directory).name for name, directory in held_out.items()},
    }
    return stage_directory(params, "eval", stage_key("eval", inputs))
