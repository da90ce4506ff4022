"""Sweeps: a sweep file's mistakes are one line naming the file, line and field; a 3-trial learning-rate sweep
stops the trial that cannot learn at the smoke gate, nests every trial under one MLflow sweep run and tags
exactly one trial best, the one with the lowest validation loss."""

from __future__ import annotations

import pytest
import yaml
from conftest import prefect_run_logs, small_pipeline_overrides
from mlflow.tracking import MlflowClient

from flows.cli import main
from tasks.compare import compare

BAD_SWEEPS = [
    ("name: s\nspace:\n  optimizer.lrr: [1.0e-3]\n", "bad.yaml:3: space.optimizer.lrr: unknown params field 'lrr'"),
    ("name: s\nspace:\n  optimiser.lr: [1.0e-3]\n", "bad.yaml:3: space.optimiser.lr: unknown params field 'optimiser'"),
    ("name: s\nspace:\n  optimizer: [1]\n", "bad.yaml:3: space.optimizer: optimizer is a section"),
    ("name: s\nspac:\n  optimizer.lr: [1]\n", "bad.yaml:2: spac: unknown sweep field"),
    ("name: s\nspace:\n  optimizer.lr: 0.1\n", "bad.yaml:3: space.optimizer.lr: got 0.1; give a list of values"),
    ("name: s\nspace:\n  train.seed: [1]\n  optimizer.lr: {min: 1.0e-4, max: 1.0e-2}\n",
     "bad.yaml:4: space.optimizer.lr: a range, but a grid needs a list of values (or method: random)"),
    ("name: s\nmethod: random\nspace:\n  optimizer.lr: [1]\n", "bad.yaml:2: method: random needs trials: N"),
    ("name: s\ntrials: 3\nspace:\n  optimizer.lr: [1]\n", "bad.yaml:2: trials: trials=3 is for method: random"),
    ("name: s\nmethod: random\ntrials: 2\nspace:\n  optimizer.lr: {min: 1.0e-2, max: 1.0e-4}\n",
     "bad.yaml:5: space.optimizer.lr: min=0.01 is above max=0.0001; a range needs min below max"),
    ("name: s\nmethod: random\ntrials: 2\nspace:\n  optimizer.lr:\n    min: 1.0e-4\n    max: 1.0e-2\n    step: 2\n",
     "bad.yaml:8: space.optimizer.lr.step: unknown range field (a range has min, max, scale)"),
    ("name: s\nspace:\n  train.seed: [1, 2]\n  optimizer.lr: []\n",
     "bad.yaml:4: space.optimizer.lr: lists no values; give at least one"),
    ("name: s\nspace: {}\n", "bad.yaml:2: space: names no field to vary; give at least one"),
    ("name: s\nspace:\n  optimizer.lr: [-1.0]\n", "trial 1 (optimizer.lr=-1): invalid params: optimizer.lr=-1.0: optimizer.lr: Input should be greater than 0"),
    ("name: s\noverrides: {train.stepz: 3}\nspace:\n  optimizer.lr: [1]\n", "bad.yaml:2: overrides.train.stepz: unknown params field"),
    ("name: s\nspace:\n  tracking.experiment: [a, b]\n", "space.tracking.experiment: tracking fields are fixed"),
    ("name: s\nspace: [1\n", "bad.yaml:3: invalid YAML"),
]


def test_sweep_file_errors_are_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    for text, said in BAD_SWEEPS:
        path.write_text(text)
        assert main(["sweep", str(path), "--dry-run"]) == 2, text
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and said in error and "Traceback" not in error, (text, error)
    assert [path.name for path in tmp_path.iterdir()] == ["bad.yaml"]  # a refused sweep writes nothing
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml does not exist" in capsys.readouterr().err


def test_random_sweeps_are_seeded_and_draw_inside_their_ranges(tmp_path, capsys):
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump({
        "name": "r", "method": "random", "trials": 4, "seed": 7,
        "space": {"optimizer.lr": {"min": 1e-4, "max": 1e-2}, "train.seed": [1, 2]},
    }))
    assert main(["sweep", str(path), "--dry-run"]) == 0
    first = capsys.readouterr().out
    assert main(["sweep", str(path), "--dry-run"]) == 0
    assert capsys.readouterr().out == first and first.count("\ntrial ") == 4
    from params.sweep import load_sweep

    for trial in load_sweep(path).trial_list():
        assert 1e-4 <= trial.params.optimizer.lr <= 1e-2 and trial.params.train.seed in (1, 2)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_a_learning_rate_sweep_tags_the_best_trial(corpus_jsonl, tmp_path, mlflow_uri):
    from flows.sweep import sweep_flow
    from params.sweep import load_sweep

    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "sweep")
    overrides += ["optimizer.min_lr=1e-7", "smoke.steps=10", "smoke.min_loss_drop=0.2", "train.steps=10", "train.eval_interval=5"]
    sweep_file = tmp_path / "lr.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "lr",
        "params": "tiny",
        "overrides": {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in overrides)},
        # 1e-6 cannot lower the loss by 0.2 in 10 steps: the smoke gate stops it.
        "space": {"optimizer.lr": [1e-6, 3e-3, 1e-2]},
        "metric": "pretrain.validation_loss",
        "max_concurrency": 2,  # two trials at once, each in a worker process of its own
    }))
    with prefect_run_logs() as said:
        record = sweep_flow(load_sweep(sweep_file))
    console = "\n".join(said)

    assert [t.status for t in record.trials] == ["stopped", "finished", "finished"]
    assert "smoke run failed" in record.trials[0].reason
    client = MlflowClient(mlflow_uri)
    runs = {t.number: client.get_run(t.run_id) for t in record.trials}
    for number, run in runs.items():
        assert run.data.tags["mlflow.parentRunId"] == record.sweep_run_id
        assert run.data.tags["llmflow.trial_status"] == record.trials[number - 1].status
    best = [number for number, run in runs.items() if run.data.tags["llmflow.best_trial"] == "true"]
    losses = {n: runs[n].data.metrics["pretrain.validation_loss"] for n in (2, 3)}
    assert best == [min(losses, key=losses.get)] == [record.best.number]

    sweep_run = client.get_run(record.sweep_run_id)
    assert sweep_run.info.status == "FINISHED" and sweep_run.data.tags["llmflow.kind"] == "sweep"
    assert sweep_run.data.params["best.optimizer.lr"] == str(record.best.assignment["optimizer.lr"])
    assert sweep_run.data.metrics["best.pretrain.validation_loss"] == pytest.approx(min(losses.values()))
    assert sweep_run.data.metrics["trials_stopped"] == 1
    artifacts = {a.path for a in client.list_artifacts(record.sweep_run_id)}
    assert {"comparison.md", "comparison.json", "sweep.yaml", "loss_curves.png"} <= artifacts
    header = record.table.splitlines()[0].split()
    assert header[:3] == ["run", "status", "optimizer.lr"] and record.table in console
    # `llmflow compare --experiment` takes the finished trials for pipeline runs, not the sweep's own run.
    latest = compare(mlflow_uri, experiment="sweep", last=3)
    assert [row["id"] for row in latest.runs] == [t.run_id for t in record.trials if t.status == "finished"]
