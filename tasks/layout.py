"""The layout-trials stage of pretrain-flow: each layout of the run's world size that the planner finds fitting
trained for `parallel.layout_trial_steps` steps, and the params of the fastest handed to pretraining. The trials'
table goes to MLflow and the console; `llmflow plan --try` is the same by hand."""

from __future__ import annotations

import io
from pathlib import Path

import mindspore as ms
import psutil
from prefect import task
from prefect.cache_policies import NO_CACHE

from model_core.parallel.planner import plan
from model_core.parallel.trials import fastest, format_trials_table, none_finished, nothing_to_try, run_trials
from params import PipelineParams
from tasks.data import DataResult
from tasks.tracking import Tracking, stage_run, training_datasets


@task(name="layout-trials", cache_policy=NO_CACHE)
def choose_layout(params: PipelineParams, data: DataResult, tracking: Tracking) -> PipelineParams:
    """`params` with the layout that trained fastest; the dataset is prepared already, so the trials reuse it.
    This machine's memory is shared by the ranks, as `plan --try` assumes; on the CPU backend the planner's
    host-RSS calibration applies."""
    steps, devices = params.parallel.layout_trial_steps, params.parallel.world_size
    with stage_run(tracking, "layout_trials") as run:
        run.log_datasets(training_datasets(data.dataset_dir))
        kind = "cpu" if ms.get_context("device_target") == "CPU" else "accelerator"
        planned = plan(params, devices, psutil.virtual_memory().total // devices, device_kind=kind)
        refused = nothing_to_try(params, planned)
        if refused:
            raise ValueError(refused)
        workdir = Path(params.train.output_dir) / "layout-trials"
        trials = run_trials(params, planned, steps, workdir, io.StringIO())
        table = format_trials_table(trials, steps)
        run.log_text(table, "layout_trials.txt")
        print(table)
        best = fastest(trials)
        if best is None:
            raise ValueError(none_finished(trials, workdir))
        run.log_params({"chosen.layout": str(best.estimate.candidate), "trial_steps": steps})
        run.log_metrics({"chosen.tokens_per_second": best.tokens_per_second, "trials": len(trials)})
        print(f"layout trials: pretraining with {best.estimate.candidate}")
    return best.params  # the same run: only the layout, recompute and gradient accumulation differ
