"""Layout trials: `llmflow plan --try` runs a short msrun of each layout that fits two devices (dp2 and tp2 of a
tiny model; pp2 is excluded for want of micro-batches), prints both rows and writes the measured faster one as
params; pretrain-flow's layout-trials stage pretrains with the faster one."""

from __future__ import annotations

import re

import pytest
from conftest import SMALL_MODEL, prefect_run_logs, small_pipeline_overrides
from mlflow.tracking import MlflowClient

from flows.cli import main
from params import load_params

pytestmark = pytest.mark.slow


def test_plan_try_writes_the_faster_layout(corpus_jsonl, tmp_path, capsys):
    sets = [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={tmp_path / 'data'}",
        f"train.output_dir={tmp_path / 'train'}", *SMALL_MODEL, "train.micro_batch_size=2", "train.grad_accum_steps=2",
    ]
    written = tmp_path / "fastest.yaml"
    argv = ["plan", "--try", "3", "--devices", "2", "--device-kind", "cpu", "--write", str(written)]
    assert main([*argv, *(arg for item in sets for arg in ("--set", item))]) == 0
    out = capsys.readouterr().out
    table = out[out.index("layout trials:"):]
    rows = {
        match["layout"]: (float(match["speed"]), int(match["accum"]))
        for match in re.finditer(r"^\*?\s+(?P<layout>dp\d tp\d pp\d zero\d recompute=\w+)\s+(?P<accum>\d+)\s+[\d.]+\s+"
                                 r"(?P<speed>[\d.]+)\s+[\d.]+$", table, re.MULTILINE)
    }
    assert sorted(rows) == ["dp1 tp2 pp1 zero0 recompute=none", "dp2 tp1 pp1 zero1 recompute=none"], table
    faster = max(rows, key=lambda layout: rows[layout][0])
    chosen = load_params(written)
    dp, tp, pp, zero = (int(n) for n in re.findall(r"\d+", faster))
    parallel = chosen.parallel
    assert (parallel.data_parallel, parallel.tensor_parallel, parallel.pipeline_parallel, parallel.zero_stage) == (dp, tp, pp, zero)
    # The same run, laid out differently: micro-batch and global batch as given, everything else untouched.
    assert chosen.train.grad_accum_steps == rows[faster][1] and chosen.global_batch_size == 4
    given = load_params("tiny", sets)
    assert chosen.train.steps == given.train.steps and chosen.model == given.model
    assert f"fastest: {faster}; wrote its params to {written}" in out
    for trial in (tmp_path / "train" / "layout-trials").iterdir():  # each rank's own peak, not only rank 0's
        memory = trial / "checkpoints" / "rank-memory"
        assert sorted(path.name for path in memory.iterdir()) == ["rank-0.json", "rank-1.json"], trial


@pytest.mark.extended  # the trials of the test above inside a pipeline run: ~4 min more
@pytest.mark.usefixtures("prefect_harness")
def test_pretrain_flow_trains_with_the_layout_its_trials_found_fastest(corpus_jsonl, tmp_path, mlflow_uri):
    from flows.pretrain import pretrain_flow

    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "layout-stage")
    params = load_params("tiny", [
        *overrides, "smoke.enabled=false", "parallel.data_parallel=2", "parallel.layout_trial_steps=3", "train.steps=4",
        "train.micro_batch_size=2", "train.grad_accum_steps=2", "train.eval_interval=4", "train.checkpoint_interval=4",
    ])
    with prefect_run_logs() as said:
        result = pretrain_flow(params)
    table = next(message for message in said if message.startswith("layout trials:"))
    speeds = {match["layout"]: float(match["speed"]) for match in re.finditer(
        r"^\*?\s+(?P<layout>dp\d tp\d pp\d zero\d recompute=\w+)\s+\d+\s+[\d.]+\s+(?P<speed>[\d.]+)\s+[\d.]+$", table, re.MULTILINE)}
    assert len(speeds) == 2, table
    faster = max(speeds, key=speeds.get)

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("layout-stage").experiment_id
    stages = {run.data.tags.get("llmflow.stage"): run for run in client.search_runs([experiment])}
    assert stages["layout_trials"].data.params["chosen.layout"] == faster
    # Pretraining ran under msrun with the chosen layout: the params its ranks read say so.
    ranks_params = load_params(next(result.pretrain.checkpoint.parent.glob("params-*-steps.yaml")))
    dp, tp, pp, zero = (int(n) for n in re.findall(r"\d+", faster))
    chosen = ranks_params.parallel
    assert (chosen.data_parallel, chosen.tensor_parallel, chosen.pipeline_parallel, chosen.zero_stage) == (dp, tp, pp, zero)
    assert result.pretrain.steps == 4
