"""What a person watching a run sees: a line per log interval, the table a pipeline run ends with, and a failed
stage's reason without Prefect's engine tracebacks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import small_pipeline_overrides

from tasks.data import DataResult
from tasks.evaluate import EvaluateStageResult
from tasks.finetune import FinetuneStageResult
from tasks.progress import IntervalLog, StageFigures, duration
from tasks.summary import stage_table
from tasks.train import TrainStageResult

REPO = Path(__file__).resolve().parents[1]


class _Said:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)


def test_interval_log_says_step_loss_lr_speed_mfu_and_an_eta_from_the_measured_rate(monkeypatch):
    clock = iter([100.0, 110.0, 130.0, 140.0, 150.0])
    monkeypatch.setattr("tasks.progress.time.monotonic", lambda: next(clock))
    said = _Said()
    log = IntervalLog("pretrain", 100, logger=said)
    record = {"loss": 5.81234, "lr": 2.87e-4, "tokens_per_second": 1930.4}
    log({"step": 10, **record, "mfu": 0.112})
    log({"step": 20, **record, "validation_loss": 6.01})
    log({"step": 40, **record})
    log({"step": 50, **record, "mfu": 0.112, "mfu_peak_flops": 3.12e11, "mfu_peak_measured": 1.0})
    log({"step": 60, **record, "mfu": 0.05, "mfu_peak_flops": 989.5e12, "mfu_peak_measured": 0.0})
    assert said.lines[0] == "pretrain step 10/100: loss 5.8123, lr 2.87e-04, 1,930 tokens/s, MFU 11.2%"
    assert "MFU 11.2% of measured 0.312 TFLOP/s," in said.lines[3]
    assert "MFU 5.0% of datasheet 990 TFLOP/s," in said.lines[4]
    assert said.lines[1] == "pretrain step 20/100: loss 5.8123, lr 2.87e-04, 1,930 tokens/s, validation loss 6.0100, ETA 1m20s"
    assert said.lines[2].endswith("ETA 1m00s")  # 30 s for the 30 steps since the first record, 60 to go


def test_duration():
    assert [duration(s) for s in (0.4, 42, 271, 7500)] == ["0s", "42s", "4m31s", "2h05m"]


def test_stage_table_has_a_row_per_stage_with_its_figures(tmp_path):
    data = DataResult(dataset_dir=tmp_path / "data", manifest_path=tmp_path / "m.json", tokenizer_path=tmp_path / "t",
                      reused=True, metrics={"splits.train.tokens": 123456.0, "seconds": 3.0})
    smoke = TrainStageResult(checkpoint=tmp_path / "smoke", steps=40, initial_loss=6.2, final_loss=5.1, skipped_steps=0,
                             nonfinite_steps=0, figures=StageFigures(reused=True))
    history = [{"step": 5, "tokens_per_second": 900.0}, {"step": 10, "tokens_per_second": 1000.0, "validation_loss": 4.5},
               {"step": 15, "tokens_per_second": 1100.0}, {"step": 20, "tokens_per_second": 1200.0}]
    pretrain = TrainStageResult(checkpoint=tmp_path / "ckpt", steps=20, initial_loss=6.25, final_loss=4.4, skipped_steps=0,
                                nonfinite_steps=0, figures=StageFigures.of(history, 95.0, reused=False))
    tuned = FinetuneStageResult(adapters_dir=tmp_path / "adapters", base_checkpoint=tmp_path / "ckpt",
                                instructions_dir=tmp_path / "sft", steps=3, initial_loss=3.0, final_loss=2.5,
                                trainable_parameters=10, trainable_share=0.1)
    evaluation = EvaluateStageResult(report_dirs={"base": tmp_path / "eval-a", "finetuned": tmp_path / "eval-b"},
                                     losses={"base": {"pretraining": 4.5}, "finetuned": {"pretraining": 4.6}})
    lines = stage_table(data, None, smoke, pretrain, tuned, evaluation).splitlines()
    assert lines[0].split() == ["stage", "steps", "loss", "validation", "loss", "perplexity", "tokens/s", "wall", "result"]
    rows = {line.split("  ")[0].strip(): line for line in lines[2:]}
    assert list(rows) == ["data prep", "smoke", "pretrain", "finetune", "eval base", "eval finetuned"]
    assert "123,456 train tokens" in rows["data prep"] and "reused" in rows["data prep"]
    assert "reused" in rows["smoke"] and "6.2000 -> 5.1000" in rows["smoke"]
    pretrain_cells = rows["pretrain"].split()
    assert pretrain_cells[:5] == ["pretrain", "20", "6.2500", "->", "4.4000"]
    assert pretrain_cells[5:9] == ["4.5000", "90.02", "1,050", "1m35s"] and pretrain_cells[9] == str(tmp_path / "ckpt")
    assert rows["eval finetuned"].split()[2:6] == ["-", "-", "4.6000", "(pretraining)"]


@pytest.mark.slow  # a real `llmflow run` in a child process
def test_a_failed_stage_says_its_reason_without_engine_tracebacks(corpus_jsonl, tmp_path, mlflow_uri):
    overrides = small_pipeline_overrides(corpus_jsonl, tmp_path / "data", "console-smoke-fails")
    sets = [arg for item in [*overrides, "smoke.steps=5", "smoke.min_loss_drop=50"] for arg in ("--set", item)]
    environment = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": mlflow_uri}
    environment.pop("LLMFLOW_DEBUG", None)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--params", "tiny", *sets], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    ours = [line for line in done.stderr.splitlines() if not re.match(r"\d\d:\d\d:\d\d\.\d+ \| ", line)]  # not Prefect's
    assert ours[-1].startswith("llmflow run: smoke run failed: loss went from "), said[-3000:]
    assert "smoke step 5/5: loss " in done.stdout + done.stderr  # the interval line, through Prefect's logger
