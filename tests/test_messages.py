"""Mistakes with `llmflow plan --try` and `llmflow compare` end in one line that names the value, says what would
be taken, and leaves nothing written; `compare` without run ids takes the experiment the pipeline records to."""

from __future__ import annotations

import json

from mlflow.tracking import MlflowClient

from flows.cli import main


def test_plan_try_refuses_a_batch_no_layout_splits_before_preparing_anything(tmp_path, capsys):
    # Three devices leave dp=3 alone (tp=3 and pp=3 do not divide the tiny model), and 3 x 8 does not divide 8.
    sets = [f"data.output_dir={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'train'}"]
    argv = ["plan", "--try", "2", "--devices", "3", "--device-kind", "cpu", *(a for s in sets for a in ("--set", s))]
    assert main(argv) == 1
    said = capsys.readouterr().err
    assert said == (
        "llmflow plan: no layout that fits keeps the global batch of 8 sequences: a pass of dp x "
        "train.micro_batch_size=8 x parallel.micro_batches=1 takes 24 under dp=3, and 8 is not a multiple of it; "
        "train.grad_accum_steps=3 (a global batch of 24) would split, or try other --devices\n"
    )
    assert list(tmp_path.iterdir()) == []  # no data prepared, no trial directory


def test_compare_takes_the_params_experiment_by_default(mlflow_uri, tmp_path, capsys):
    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment("compare-default")
    ids = []
    for lr in ("0.001", "0.003", "0.01"):
        run = client.create_run(experiment, run_name=f"lr-{lr}")
        client.log_param(run.info.run_id, "optimizer.lr", lr)
        client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    params = tmp_path / "params.yaml"
    params.write_text("tracking:\n  experiment: compare-default\n")

    assert main(["compare", "--params", str(params), "--format", "json"]) == 0  # --last 2 is the default
    shown = json.loads(capsys.readouterr().out)
    assert shown["experiment"] == "compare-default" and [row["id"] for row in shown["runs"]] == ids[1:]
    assert main(["compare", "--params", str(params), "--last", "3", "--plot", str(tmp_path / "loss.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the last 3 finished pipeline runs of experiment 'compare-default', oldest first\n")
    assert out.index("lr-0.001") < out.index("lr-0.003") < out.index("lr-0.01")

    missing = tmp_path / "none.db"
    refusals = [
        (["--last", "2", ids[0], ids[1]], "give run ids, or --experiment/--last to take an experiment's latest runs, not both"),
        (["--last", "1"], "--last 1: a comparison needs at least 2 runs"),
        (["--experiment", "no-such"], f"no MLflow experiment named 'no-such' at {mlflow_uri}; name one with --experiment"),
        (["--tracking-uri", f"sqlite:///{missing}"], f"no MLflow store at sqlite:///{missing} ({missing} does not exist)"),
    ]
    for argv, said in refusals:
        assert main(["compare", "--params", str(params), *argv]) == 1, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(f"llmflow compare: {said}"), (argv, err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["params.yaml"]  # no plot, no new store
