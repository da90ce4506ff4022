"""Run identity by stage: a change to a later stage's params reuses the earlier stages, a rerun with the same params
is a no-op tagged reused, new data continues pretraining when train.continue_from says so, `llmflow train` never
overwrites a run silently, and every CLI error is one line."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import SMALL_MODEL, docstring_documents, prefect_run_logs, small_pipeline_overrides
from mlflow.tracking import MlflowClient

from flows.cli import main
from model_core.data import prepare_dataset
from model_core.train.runs import RUN_RECORD, pretraining_run
from model_core.train.trainer import Trainer
from params import load_params
from params.identity import stage_key, training_inputs
from tasks.compare import compare, render


def _children(client: MlflowClient, experiment: str, parent_run_id: str) -> dict[str, object]:
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {run.data.tags["llmflow.stage"]: run for run in runs}


def test_pretraining_key_ignores_later_stages_cadence_and_layout():
    def key(*sets: str) -> str:
        return stage_key("pretrain", training_inputs(load_params("tiny", list(sets))))

    same = ["lora.steps=7", "eval.seed=3", "train.log_interval=1", "train.checkpoint_interval=5",
            "train.output_dir=elsewhere", "name=other", "smoke.steps=9", "tracking.experiment=x",
            "parallel.tensor_parallel=2", "recompute.mode=all", "parallel.zero_stage=1"]
    for change in same:
        assert key(change) == key(), change
    # The same global batch of 16 sequences, cut differently: the same run.
    assert key("train.micro_batch_size=4", "train.grad_accum_steps=4") == key("train.micro_batch_size=8", "train.grad_accum_steps=2")
    assert key("train.micro_batch_size=4", "parallel.data_parallel=2") == key("train.micro_batch_size=8")
    mixture = "data.sources=[{kind: text, paths: [a], weight: 0.5}, {kind: text, paths: [b], epochs: 2}]"
    for change in ("train.steps=301", "optimizer.lr=2e-3", "train.seed=1", "model.init_std=0.01", "train.micro_batch_size=4", mixture):
        assert key(change) != key(), change


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_a_rerun_is_a_no_op_and_a_lora_change_reuses_pretraining(corpus_jsonl, tmp_path, mlflow_uri):
    from flows.pretrain import pretrain_flow

    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "identity")
    sets = [*overrides, "model.seq_len=128", "lora.enabled=true", "lora.steps=2", "train.steps=10", "smoke.steps=20",
            "smoke.min_loss_drop=0.1"]
    first = pretrain_flow(load_params("tiny", sets))
    with prefect_run_logs() as said:  # a task's prints and the flow's summary, as the console shows them
        again = pretrain_flow(load_params("tiny", sets))
    console = "\n".join(said)
    summary = console[console.index("pipeline summary:"):].splitlines()
    for name in ("data prep", "smoke", "pretrain", "finetune"):
        assert any(line.startswith(f"{name} ") and " reused " in line for line in summary), (name, summary)
    more_lora = pretrain_flow(load_params("tiny", [*sets, "lora.steps=3"]))

    client = MlflowClient(mlflow_uri)
    rerun = _children(client, "identity", again.mlflow_run_id)
    assert set(rerun) == {"data_prep", "smoke", "pretrain", "finetune", "evaluate"}
    for name, run in rerun.items():
        assert run.data.tags["llmflow.reused"] == "true", name
        assert run.info.status == "FINISHED"
    for name in ("smoke", "pretrain", "finetune"):
        assert client.get_metric_history(rerun[name].info.run_id, "loss") == [], f"{name} trained on a rerun"
    for name in ("data prep", "smoke", "pretrain", "finetune", "evaluate"):
        assert f"{name}: reused " in console, name
    figures = {"figures"}  # wall time and the reuse flag differ on a rerun
    assert again.pretrain.model_dump(exclude=figures) == first.pretrain.model_dump(exclude=figures)
    assert again.finetune.model_dump(exclude=figures) == first.finetune.model_dump(exclude=figures)
    assert again.pretrain.figures.reused and not first.pretrain.figures.reused
    assert again.evaluation.losses == first.evaluation.losses

    changed = _children(client, "identity", more_lora.mlflow_run_id)
    for name in ("smoke", "pretrain"):
        assert changed[name].data.tags["llmflow.reused"] == "true"
        assert client.get_metric_history(changed[name].info.run_id, "loss") == [], f"{name} trained again"
    assert more_lora.pretrain.checkpoint == first.pretrain.checkpoint
    assert changed["finetune"].data.tags["llmflow.reused"] == "false"
    assert [m.step for m in client.get_metric_history(changed["finetune"].info.run_id, "loss")] == [3]
    assert more_lora.finetune.adapters_dir != first.finetune.adapters_dir
    # The base model's report is reused, the fine-tuned one is new.
    assert more_lora.evaluation.report_dirs["base"] == first.evaluation.report_dirs["base"]
    assert more_lora.evaluation.report_dirs["finetuned"] != first.evaluation.report_dirs["finetuned"]

    # Comparing the first run with the lora change: the varied param and both runs' headline metrics, which sit
    # on the parent runs, in an experiment MLflow opens in its model-training view.
    assert client.get_experiment_by_name("identity").tags["mlflow.experimentKind"] == "custom_model_development"
    parent = client.get_run(first.mlflow_run_id).data.metrics
    assert parent["pretrain.final_loss"] == pytest.approx(first.pretrain.final_loss)
    assert {"pretrain.best_loss", "pretrain.tokens_per_second", "pretrain.wall_seconds", "finetune.final_loss",
            "evaluate.base.pretraining.perplexity"} <= parent.keys()
    comparison = compare(mlflow_uri, [first.mlflow_run_id, more_lora.mlflow_run_id])
    assert comparison.differing == ["lora.steps"]
    assert [row["params"]["lora.steps"] for row in comparison.runs] == ["2", "3"]
    finetuned = [row["metrics"]["finetune.final_loss"] for row in comparison.runs]
    assert finetuned == [pytest.approx(first.finetune.final_loss), pytest.approx(more_lora.finetune.final_loss)]
    markdown = render(comparison, mlflow_uri, "markdown")
    assert markdown.startswith("| run | lora.steps | pretrain.final_loss |") and "#/experiments/" in markdown
    assert main(["compare", first.mlflow_run_id, more_lora.mlflow_run_id, "--tracking-uri", mlflow_uri,
                 "--plot", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert main(["compare", "--tracking-uri", mlflow_uri, "--experiment", "no-such-experiment"]) == 1


def _cli_sets(*sets: str) -> list[str]:
    return [arg for item in sets for arg in ("--set", item)]


@pytest.fixture(scope="module")
def first_run(corpus_jsonl, tmp_path_factory):
    """`llmflow train` of 10 steps on the first half of the corpus, with a fixed tokenizer (continuing a run on new
    data needs the same token ids); (its --set values, its directory, a second half of the corpus, the tmp dir)."""
    tmp = tmp_path_factory.mktemp("identity-cli")
    documents = docstring_documents()
    halves = [tmp / "first.jsonl", tmp / "second.jsonl"]
    for path, part in zip(halves, (documents[::2], documents[1::2])):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in part))
    tokenizer_params = load_params("tiny", [f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]",
                                            f"data.output_dir={tmp / 'tok'}", *SMALL_MODEL])
    tokenizer = prepare_dataset(tokenizer_params.data, tokenizer_params.tokenizer, tokenizer_params.model).tokenizer_path
    shutil.copy(tokenizer, tmp / "tokenizer.model")
    sets = [
        f"data.output_dir={tmp / 'data'}", f"train.output_dir={tmp / 'train'}", *SMALL_MODEL,
        f"tokenizer.model_path={tmp / 'tokenizer.model'}", "train.steps=10", "train.log_interval=1",
        "train.eval_interval=1000", "train.eval_batches=2", "train.checkpoint_interval=5", "optimizer.warmup_steps=2",
        "optimizer.lr=3e-3", "train.continue_from=latest",
    ]
    first = [f"data.sources=[{{kind: jsonl, paths: ['{halves[0]}']}}]", *sets]
    assert main(["train", *_cli_sets(*first), "--metrics-jsonl", str(tmp / "first.jsonl.metrics")]) == 0
    [directory] = (tmp / "train").glob("pretrain-*")
    return sets, first, directory, halves, tmp


def test_train_refuses_to_overwrite_a_run_and_has_nothing_to_do_for_a_finished_one(first_run, capsys):
    _, first, directory, _, _ = first_run
    capsys.readouterr()
    assert main(["train", *_cli_sets(*first)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(directory) in error
    assert "--resume auto" in error and "--resume none" in error

    assert main(["train", *_cli_sets(*first), "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nothing to do: {directory} already holds this run's final checkpoint step-00000010")
    assert "trained" not in out


def test_later_stages_params_find_the_pretraining_run(first_run):
    """What `llmflow finetune` looks up as its base, with other lora, eval and cadence fields."""
    _, first, directory, _, _ = first_run
    params = load_params("tiny", [*first, "lora.steps=7", "eval.seed=5", "train.log_interval=3", "smoke.steps=2"])
    dataset = prepare_dataset(params.data, params.tokenizer, params.model)
    assert dataset.reused
    assert pretraining_run(params, dataset.output_dir).directory == directory


def test_new_data_continues_pretraining_from_the_last_checkpoint(first_run, capsys):
    sets, _, first_directory, halves, tmp = first_run
    metrics = tmp / "continued.metrics"
    both = [f"data.sources=[{{kind: jsonl, paths: ['{halves[0]}', '{halves[1]}']}}]", *sets]
    capsys.readouterr()
    assert main(["train", *_cli_sets(*both), "--metrics-jsonl", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert f"trained 10 steps (steps 11-20, continuing {first_directory / 'step-00000010'})" in out

    record = json.loads(next(p for p in (tmp / "train").glob(f"pretrain-*/{RUN_RECORD}") if p.parent != first_directory).read_text())
    assert record["start"] == f"continued:{first_directory.name}/step-00000010" and record["final_step"] == 20
    first = [json.loads(line) for line in (tmp / "first.jsonl.metrics").read_text().splitlines()]
    continued = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in continued] == list(range(11, 21))
    # The weights were loaded: its first loss is that of the first run's last weights on the new data's first
    # batch (read from its start); the warmup runs again and the token count goes on. The source grew: its
    # epochs go on from the first run's count, its rows read in the order of the epoch after those.
    params = load_params("tiny", both)
    dataset = prepare_dataset(params.data, params.tokenizer, params.model)
    probe = Trainer(params, dataset.output_dir, tmp / "probe", steps=1, initial_weights=first_directory / "step-00000010")
    probe.batches.mixture.carry({"source0": first[-1]["data/source0/epochs"]})
    assert probe.run().initial_loss == pytest.approx(continued[0]["loss"], rel=1e-6)
    assert continued[0]["lr"] == pytest.approx(first[0]["lr"])
    assert continued[0]["tokens_seen"] == first[-1]["tokens_seen"] + first[0]["tokens_seen"]
    rows = json.loads((dataset.output_dir / "manifest.json").read_text())["splits"]["train"]["rows"]
    assert continued[0]["data/source0/epochs"] == pytest.approx(first[-1]["data/source0/epochs"] + 8 / rows)

    assert main(["train", *_cli_sets(*both, "train.continue_from=none"), "--metrics-jsonl", str(tmp / "fresh.metrics")]) == 0
    fresh = [json.loads(line) for line in (tmp / "fresh.metrics").read_text().splitlines()]
    assert fresh[0]["step"] == 1 and fresh[0]["loss"] > continued[0]["loss"]


def test_cli_errors_are_one_line_without_a_traceback(tmp_path, capsys, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    missing = str(tmp_path / "missing")
    cases = [
        (["lora", "merge", "--base", missing, "--adapters", missing, "--output", str(tmp_path / "out")], 1, "missing"),
        (["lora", "merge", "--base", missing, "--adapters", missing, "--output", str(tmp_path / "full")], 1, "exists"),
        (["convert", "hf-to-ms", "--src", missing, "--dst", str(tmp_path / "x")], 1, "missing"),
        (["ckpt", "reshard", "--checkpoint", missing, "--tensor-parallel", "1", "--output", str(tmp_path / "r")], 1, "missing"),
        (["tokenizer", "check", "--ours", missing, "--reference", missing], 1, "missing"),
        (["params", "show", "--params", "nosuchpreset"], 2, "unknown preset"),
        (["params", "show", "--set", "model.hidden_sise=3"], 2, "model.hidden_sise: unknown field"),
        (["train", "--resume"], 2, "expected one argument"),
        (["nosuchcommand"], 2, "invalid choice"),
        (["sweep", missing], 2, "does not exist"),
        (["plan", "--write", str(tmp_path / "p.yaml")], 1, "--write PATH goes with --try"),
        (["plan", "--try", "1"], 1, "at least 2 steps"),
    ]
    for argv, status, said in cases:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        captured = capsys.readouterr()
        assert code == status, (argv, captured.err)
        assert captured.err.count("\n") == 1 and said in captured.err, (argv, captured.err)
        assert "Traceback" not in captured.err + captured.out, argv

    monkeypatch.setenv("LLMFLOW_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(cases[0][0])


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("llmflow ")


def test_continuing_with_a_tokenizer_trained_on_other_data_is_refused(first_run, capsys):
    sets, _, first_directory, halves, _ = first_run
    trained_tokenizer = [item for item in sets if not item.startswith("tokenizer.model_path=")]
    second = [f"data.sources=[{{kind: jsonl, paths: ['{halves[1]}']}}]", *trained_tokenizer]
    capsys.readouterr()
    assert main(["train", *_cli_sets(*second)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "was trained with another tokenizer" in error and "tokenizer.model_path" in error
