"""The evaluate stage as a Prefect task: the pretrained checkpoint and (after a fine-tune) the same checkpoint
with its adapters, scored on the same held-out sets and prompts with the same seed; both reports and a
side-by-side table go to MLflow."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.eval.evaluate import evaluate_checkpoint
from model_core.eval.perplexity import HeldOutLoss
from model_core.eval.report import JSON_NAME, write_report
from model_core.train.runs import eval_directory
from params import PipelineParams, flatten
from tasks.data import DataResult
from tasks.finetune import FinetuneStageResult
from tasks.tracking import Tracking, evaluation_datasets, record_reuse, stage_run


class EvaluateStageResult(BaseModel):
    report_dirs: dict[str, Path]  # "base", and "finetuned" after a fine-tune
    losses: dict[str, dict[str, float]]  # model -> held-out set -> mean token loss


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_stage(
    params: PipelineParams,
    data: DataResult,
    pretrained: Path,
    tuned: FinetuneStageResult | None,
    tracking: Tracking,
) -> EvaluateStageResult:
    held_out = {"pretraining": data.dataset_dir}
    models: dict[str, Path | None] = {"base": None}
    if tuned is not None:
        held_out["instructions"] = tuned.instructions_dir
        models["finetuned"] = tuned.adapters_dir
    with stage_run(tracking, "evaluate") as run:
        # A report per model, keyed by what it scores: a model scored in an earlier run is not scored again.
        directories = {name: eval_directory(params, pretrained, adapters, held_out) for name, adapters in models.items()}
        done = {name for name, directory in directories.items() if (directory / JSON_NAME).is_file()}
        run.log_params({key: value for key, value in flatten(params).items() if key.startswith("eval.")})
        run.log_params({"stage.checkpoint": pretrained, **{f"stage.adapters.{k}": v for k, v in models.items() if v}})
        run.log_datasets(evaluation_datasets(held_out.values()))
        record_reuse(run, "evaluate", ", ".join(map(str, directories.values())) if done == set(models) else None)
        scores: dict[str, dict[str, HeldOutLoss]] = {}
        for name, adapters in models.items():
            directory = directories[name]
            if name not in done:
                report = evaluate_checkpoint(params, pretrained, data.tokenizer_path, held_out, adapters)
                write_report(report, directory)
                run.log_artifacts(directory, f"eval/{name}")
            scores[name] = read_held_out(directory)
        run.log_metrics(
            {
                f"{name}.{dataset}.{metric}": getattr(loss, metric)
                for name, by_set in scores.items()
                for dataset, loss in by_set.items()
                for metric in ("mean_loss", "perplexity")
            }
        )
        table = comparison_markdown(scores)
        run.log_text(table, "eval/comparison.md")
    create_markdown_artifact(table, key="evaluation", description="Held-out loss and perplexity, base vs fine-tuned")
    return EvaluateStageResult(
        report_dirs=directories,
        losses={name: {k: v.mean_loss for k, v in by_set.items()} for name, by_set in scores.items()},
    )


def read_held_out(directory: Path) -> dict[str, HeldOutLoss]:
    """The held-out scores of a written report."""
    report = json.loads((directory / JSON_NAME).read_text())
    return {name: HeldOutLoss(**values) for name, values in report["held_out"].items()}


def comparison_markdown(scores: dict[str, dict[str, HeldOutLoss]]) -> str:
    """One row per held-out set, one loss / perplexity column pair per model."""
    names = list(scores)
    datasets = list(next(iter(scores.values())))
    header = "| held-out set | " + " | ".join(f"{n} loss | {n} perplexity" for n in names) + " |"
    rule = "|---|" + "---|---|" * len(names)
    rows = [
        f"| {dataset} | "
        + " | ".join(
            f"{scores[n][dataset].mean_loss:.4f} | {scores[n][dataset].perplexity:.2f}" for n in names
        )
        + " |"
        for dataset in datasets
    ]
    return "\n".join(["# Evaluation: same batches, prompts and seed for every model", "", header, rule, *rows, ""])
