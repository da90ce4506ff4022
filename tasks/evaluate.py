"""The evaluate stage as a Prefect task: the pretrained checkpoint and (after a fine-tune) the same checkpoint
with its adapters, scored on the same held-out sets and prompts with the same seed; both reports and a
side-by-side table go to MLflow."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from model_core.eval.evaluate import evaluate_checkpoint
from model_core.eval.report import EvalReport, write_report
from model_core.train.checkpoint import run_directory
from params import PipelineParams, flatten, params_hash
from tasks.data import DataResult
from tasks.finetune import FinetuneStageResult
from tasks.tracking import Tracking, stage_run


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
    directory = run_directory(params.train.output_dir, params.name, params_hash(params), data.dataset_dir, "evaluate")
    with stage_run(tracking, "evaluate") as run:
        run.log_params({key: value for key, value in flatten(params).items() if key.startswith("eval.")})
        run.log_params({"stage.checkpoint": pretrained, **{f"stage.adapters.{k}": v for k, v in models.items() if v}})
        reports: dict[str, EvalReport] = {}
        for name, adapters in models.items():
            reports[name] = evaluate_checkpoint(params, pretrained, data.tokenizer_path, held_out, adapters)
            write_report(reports[name], directory / name)
            run.log_artifacts(directory / name, f"eval/{name}")
        run.log_metrics(
            {
                f"{name}.{dataset}.{metric}": getattr(scores, metric)
                for name, report in reports.items()
                for dataset, scores in report.held_out.items()
                for metric in ("mean_loss", "perplexity")
            }
        )
        table = comparison_markdown(reports)
        run.log_text(table, "eval/comparison.md")
    create_markdown_artifact(table, key="evaluation", description="Held-out loss and perplexity, base vs fine-tuned")
    return EvaluateStageResult(
        report_dirs={name: directory / name for name in reports},
        losses={name: {k: v.mean_loss for k, v in report.held_out.items()} for name, report in reports.items()},
    )


def comparison_markdown(reports: dict[str, EvalReport]) -> str:
    """One row per held-out set, one loss / perplexity column pair per model."""
    names = list(reports)
    datasets = list(next(iter(reports.values())).held_out)
    header = "| held-out set | " + " | ".join(f"{n} loss | {n} perplexity" for n in names) + " |"
    rule = "|---|" + "---|---|" * len(names)
    rows = [
        f"| {dataset} | "
        + " | ".join(
            f"{reports[n].held_out[dataset].mean_loss:.4f} | {reports[n].held_out[dataset].perplexity:.2f}" for n in names
        )
        + " |"
        for dataset in datasets
    ]
    return "\n".join(["# Evaluation: same batches, prompts and seed for every model", "", header, rule, *rows, ""])
