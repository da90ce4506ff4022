"""`llmflow plan --explain-oom`: a run's failure placed in its phase (load, step, update, checkpoint) from the
traceback the real code raises there, or from the metrics when the OOM killer left no traceback; the advice
for each phase, in the order experienced trainers try them."""

from __future__ import annotations

import json
import traceback

import pytest
from conftest import SMALL_MODEL

from flows.cli import main
from model_core.data import prepare_dataset
from model_core.parallel import parallelize
from model_core.parallel.oom import explain_oom
from model_core.train import checkpoint as ckpt
from model_core.train.trainer import Trainer
from params import load_params


@pytest.fixture(scope="module")
def params(corpus_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("oom")
    values = [f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={out / 'data'}",
              *SMALL_MODEL, "train.steps=2", "train.checkpoint_interval=1", "train.eval_interval=1000",
              f"train.output_dir={out / 'train'}"]
    loaded = load_params("tiny", values)
    prepare_dataset(loaded.data, loaded.tokenizer, loaded.model)
    return loaded


def _out_of_memory(*args, **kwargs):
    raise MemoryError("std::bad_alloc: out of memory")


def _failure(params, tmp_path, breaks) -> str:
    """The traceback a run prints when memory runs out where `breaks(trainer_or_none)` makes it run out."""
    dataset = prepare_dataset(params.data, params.tokenizer, params.model).output_dir
    try:
        trainer = breaks(None) or Trainer(params, dataset, tmp_path / "ckpt")
        breaks(trainer)
        trainer.run()
    except MemoryError:
        return traceback.format_exc()
    raise AssertionError("memory did not run out")


@pytest.mark.parametrize(
    ("phase", "first_advice"),
    [("load", "add tensor parallelism"), ("step", "turn on recompute"), ("update", "shard it with ZeRO"),
     ("checkpoint", "shard the weights")],
)
def test_a_failure_in_the_real_code_is_placed_in_its_phase(params, tmp_path, monkeypatch, phase, first_advice):
    def breaks(trainer):
        if trainer is None:  # before the trainer is built
            if phase == "load":
                monkeypatch.setattr(parallelize, "materialize", _out_of_memory)
            if phase == "checkpoint":
                monkeypatch.setattr(ckpt, "save_shards", _out_of_memory)
            return None
        if phase == "step":
            monkeypatch.setattr(trainer.parallel, "accumulate", _out_of_memory)
        if phase == "update":
            monkeypatch.setattr(trainer.parallel, "_apply", _out_of_memory)

    diagnosis = explain_oom(_failure(params, tmp_path, breaks))
    assert diagnosis.phase == phase, diagnosis
    assert first_advice in diagnosis.advice
    assert "MemoryError" in diagnosis.evidence


def test_a_process_the_oom_killer_ended_is_placed_by_its_metrics(tmp_path, capsys):
    log = "rank 1 exited with code -9; the end of its log /runs/logs/worker_1.log:\nstep 3 ...\n"
    assert explain_oom(log).phase is None and "--metrics" in explain_oom(log).advice
    assert explain_oom(log, []).phase == "load"
    later = explain_oom(log, [{"step": 1, "loss": 6.0}, {"step": 2, "loss": 5.9}])
    assert later.phase == "step" and "after step 2" in later.evidence
    assert explain_oom("loss 6.2 -> 5.1\nRuntimeError: rank 2 lost\n").phase is None

    (tmp_path / "worker.log").write_text(log)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ({"step": 1}, {"step": 2})))
    assert main(["plan", "--explain-oom", str(tmp_path / "worker.log"), "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("memory ran out in the forward or backward of a training step")
    assert "what to change: activations: turn on recompute" in printed
    assert main(["plan", "--explain-oom", str(tmp_path / "metrics.jsonl")]) == 1  # no memory failure in it
    assert main(["plan", "--params", "tiny"]) == 1
    assert "--devices and --device-memory are required" in capsys.readouterr().err


def test_a_file_that_is_not_a_log_is_named_not_diagnosed(tmp_path, capsys):
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(13))
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "worker.log").write_text("MemoryError: out of memory\n")
    log = "expected a failed run's log (a rank's logs/worker_<rank>.log, or its console output)"
    binary = "could not be read as text (binary: a NUL byte at offset 8)"
    cases = [
        (["--explain-oom", str(png)], f"{png} {binary}; {log}"),
        (["--explain-oom", str(tmp_path / "missing.log")], f"{tmp_path / 'missing.log'} does not exist; {log}"),
        (["--explain-oom", str(tmp_path / "empty.log")], f"{tmp_path / 'empty.log'} is empty; {log}"),
        (["--explain-oom", str(tmp_path)], f"{tmp_path} is not a file; {log}"),
        (["--explain-oom", str(tmp_path / "worker.log"), "--metrics", str(png)],
         f"{png} {binary}; expected the run's --metrics-jsonl file"),
    ]
    before = sorted(tmp_path.iterdir())
    for argv, said in cases:
        assert main(["plan", *argv]) == 1, argv
        assert capsys.readouterr() == ("", f"llmflow plan: {said}\n"), argv
    assert sorted(tmp_path.iterdir()) == before
