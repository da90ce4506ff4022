"""The table a pipeline run ends with: one row per stage (steps, losses, validation loss and perplexity,
tokens/s, wall time, where its result is), printed to the console and logged by the flow run, so a run's outcome
is readable without opening MLflow."""

from __future__ import annotations

import math

from model_core.tables import fixed_width
from tasks.convert import ConvertResult
from tasks.data import DataResult
from tasks.evaluate import EvaluateStageResult
from tasks.finetune import FinetuneStageResult
from tasks.progress import StageFigures, duration
from tasks.train import TrainStageResult

HEADER = ["stage", "steps", "loss", "validation loss", "perplexity", "tokens/s", "wall", "result"]


def stage_table(
    data: DataResult,
    converted: ConvertResult | None,
    smoke: TrainStageResult | None,
    pretrain: TrainStageResult,
    finetune: FinetuneStageResult | None,
    evaluation: EvaluateStageResult,
) -> str:
    tokens = data.metrics.get("splits.train.tokens")
    rows = [
        HEADER,
        ["data prep", "-", "-", "-", "-", f"{tokens:,.0f} train tokens" if tokens is not None else "-",
         "reused" if data.reused else duration(data.metrics.get("seconds", 0.0)), str(data.dataset_dir)],
    ]
    if converted is not None:
        rows.append(["convert", "-", "-", "-", "-", "-", "reused" if converted.reused else "done",
                     str(converted.checkpoint_dir)])
    for name, stage in (("smoke", smoke), ("pretrain", pretrain), ("finetune", finetune)):
        if stage is not None:
            result = stage.adapters_dir if isinstance(stage, FinetuneStageResult) else stage.checkpoint
            rows.append(_training_row(name, stage.steps, stage.initial_loss, stage.final_loss, stage.figures, result))
    for model, by_set in evaluation.losses.items():
        for held_out, loss in by_set.items():
            rows.append([f"eval {model}", "-", "-", f"{loss:.4f} ({held_out})", _perplexity(loss), "-", "-",
                         str(evaluation.report_dirs[model])])
    return fixed_width(rows)


def _training_row(name: str, steps: int, initial: float, final: float, figures: StageFigures, result) -> list[str]:
    validation = figures.validation_loss
    return [
        name,
        str(steps),
        f"{initial:.4f} -> {final:.4f}",
        f"{validation:.4f}" if validation is not None else "-",
        _perplexity(validation) if validation is not None else "-",
        f"{figures.tokens_per_second:,.0f}" if figures.tokens_per_second is not None else "-",
        "reused" if figures.reused else duration(figures.wall_seconds),
        str(result),
    ]


def _perplexity(loss: float) -> str:
    return f"{math.exp(loss):,.2f}" if loss < 700 else "inf"
