"""`llmflow doctor`: each trouble provoked (on the small tiny model where a run shows it within seconds, as metric
shapes or a dataset's health where it needs a long run or another helper's data prep) is named first, with its
evidence; a healthy run with noisy warmup steps is called healthy. And the hang watch: a rank that stops beating is
named, with what the others wait in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import SMALL_MODEL

from model_core.parallel import heartbeat
from model_core.parallel.launch import LaunchError, _Watch, hang_report, launch
from model_core.train.doctor import RunEvidence, diagnose
from params import load_params
from params.rules import run_warnings, slowest_rope_wavelength


def _falling(steps: range, start: float = 6.0, rate: float = 0.01, noise: float = 0.05) -> list[dict]:
    """Loss falling by `rate` a step with a fixed alternating wiggle of `noise`."""
    return [
        {"step": s, "loss": start - rate * s + (noise if s % 2 else -noise), "grad_norm": 1.0, "loss_scale": 1.0,
         "skipped_steps": 0}
        for s in steps
    ]


def _flat(steps: range, level: float = 6.0) -> list[dict]:
    return [{"step": s, "loss": level + (0.01 if s % 2 else -0.01), "grad_norm": 1.0} for s in steps]


def _health(**dataset: float) -> dict:
    """A manifest's health section with data prep's shape: these dataset metrics, the same for one source."""
    thresholds = {"fertility": 0.5, "rare_token_share": 0.3, "unknown_rate": 0.01, "repeated_ngram_rate": 0.2,
                  "longest_id_run": 64, "near_copy_row_share": 0.1}
    values = {"fertility": 0.25, "rare_token_share": 0.05, "unknown_rate": 0.0, "repeated_ngram_rate": 0.02,
              "longest_id_run": 3, "near_copy_row_share": 0.0, **dataset}
    return {"dataset": values, "sources": {"docs": dict(values)}, "thresholds": thresholds, "warnings": []}


def test_a_healthy_run_with_noisy_warmup_steps_is_called_healthy():
    params = load_params("tiny", ["optimizer.warmup_steps=30", "train.steps=200"])
    warmup = [{"step": s, "loss": 6.0 + (2.5 if s % 3 == 0 else -0.5), "grad_norm": 30.0 if s % 3 == 0 else 2.0}
              for s in range(1, 31)]
    report = diagnose(RunEvidence(params, warmup + _falling(range(31, 201)), health=_health()))
    assert report.kind == "none", report.text()
    assert report.causes == []
    assert "healthy" in report.text()


def test_repetition_in_the_data_is_named_first_with_its_numbers():
    params = load_params("tiny")
    health = _health(repeated_ngram_rate=0.91, near_copy_row_share=0.97, longest_id_run=12)
    report = diagnose(RunEvidence(params, _flat(range(1, 120)), health=health))
    assert report.kind == "plateau"
    first = report.causes[0]
    assert first.name.startswith("repetition in the data")
    assert "near_copy_row_share 0.97 in the dataset, threshold 0.1" in first.evidence
    assert "repeated_ngram_rate 0.91" in first.evidence
    assert "data.near_dup_threshold" in first.change
    healthy_curve = diagnose(RunEvidence(params, _falling(range(1, 120)), health=health))
    assert healthy_curve.kind == "none" and healthy_curve.causes[0].name.startswith("repetition")


def test_validation_loss_climbing_while_training_loss_falls_is_memorising():
    metrics = _falling(range(1, 121))
    for record, validation in zip(metrics[29::30], (5.9, 5.6, 5.8, 6.1)):
        record["validation_loss"] = validation
    report = diagnose(RunEvidence(load_params("tiny"), metrics))
    assert report.kind == "none"
    assert report.causes[0].name.startswith("the model learns the training rows by heart")
    assert report.causes[0].evidence.startswith("steps 60-120: validation loss 5.600 -> 6.100 while training loss")


def test_a_tokenizer_of_rare_pieces_is_named_first():
    params = load_params("tiny")
    health = _health(fertility=0.81, rare_token_share=0.62)
    health["sources"]["docs"]["fertility"] = 0.93
    report = diagnose(RunEvidence(params, _flat(range(1, 120)), health=health))
    assert report.kind == "plateau"
    first = report.causes[0]
    assert "rare pieces" in first.name
    assert "fertility 0.93 in source docs, threshold 0.5" in first.evidence
    assert "rare_token_share 0.62" in first.evidence
    assert "model.vocab_size" in first.change


def test_health_warnings_alone_are_evidence_when_thresholds_are_not_named():
    health = {"dataset": {}, "sources": {}, "thresholds": {}, "warnings": ["fertility 0.9 in source docs is above 0.5"]}
    report = diagnose(RunEvidence(load_params("tiny"), _flat(range(1, 120)), health=health))
    assert report.causes[0].evidence == "data health: fertility 0.9 in source docs is above 0.5"


def test_rope_theta_too_small_for_the_sequence_is_named_first():
    params = load_params("tiny", ["model.rope_theta=10", "model.seq_len=1024"])
    report = diagnose(RunEvidence(params, _flat(range(1, 120))))
    assert report.kind == "plateau"
    first = report.causes[0]
    assert first.name.startswith("RoPE theta too small")
    assert first.evidence.startswith("model.rope_theta=10 with head dim 32: the slowest RoPE pair comes full circle every 54 ")
    assert [first.evidence] == run_warnings(params)  # the warning the run started with
    assert slowest_rope_wavelength(10_000, 128) > 4096  # the Llama 2 presets are not flagged


def test_presets_break_no_bound_of_their_own():
    for preset in ("tiny", "llama2_7b_dp8", "llama2_13b_tp4_pp2_dp4", "mixtral_8x7b_ep8"):
        report = diagnose(RunEvidence(load_params(preset), _falling(range(1, 3000), rate=0.001)))
        assert (report.kind, report.causes) == ("none", []), f"{preset}: {report.text()}"


def test_loss_spikes_after_warmup_name_the_step():
    params = load_params("tiny", ["optimizer.grad_clip=null"])
    metrics = _falling(range(1, 120))
    metrics[79] = {**metrics[79], "loss": 9.5, "grad_norm": 250.0}
    report = diagnose(RunEvidence(params, metrics))
    assert report.kind == "spikes"
    assert "step 80: loss 9.500" in report.summary and "gradient norm 250" in report.summary
    assert report.causes[0].change == "optimizer.grad_clip=1.0"
    assert "largest gradient norm logged was 250" in report.causes[0].evidence


def test_a_fine_tune_that_blows_up_names_lora_lr_and_a_pretraining_lr_is_not_judged_by_lora_rates():
    from model_core.train.finetune import finetune_params

    tuned = finetune_params(load_params("tiny", ["lora.enabled=true", "lora.lr=0.01", "lora.steps=100"]))
    metrics = _falling(range(1, 101), start=3.0)
    for record in metrics[40:50]:  # ten records worse than guessing over the 512-piece vocabulary
        record["loss"] = 9.0
    report = diagnose(RunEvidence(tuned, metrics, stage="finetune"))
    assert report.kind == "divergence", report.text()
    assert "loss above ln(vocab_size)" in report.summary and "for 10 records running" in report.summary
    assert report.causes[0].change == "lora.lr: try 0.0002"
    assert report.causes[0].evidence.startswith("lora.lr=0.01 is 50x the 0.0002 that LoRA and QLoRA fine-tunes train at")
    healthy = finetune_params(load_params("tiny", ["lora.enabled=true", "lora.lr=2e-4", "lora.steps=100"]))
    assert diagnose(RunEvidence(healthy, _falling(range(1, 101), start=3.0), stage="finetune")).causes == []


def test_an_oom_log_is_placed_in_its_phase():
    log = ('Traceback (most recent call last):\n  File "/x/model_core/train/trainer.py", line 1, in _optimizer_step\n'
           "RuntimeError: Allocate memory failed\n")
    report = diagnose(RunEvidence(load_params("tiny"), logs={"worker_0.log": log}))
    assert report.kind == "oom"
    assert report.causes[0].name == "memory ran out in the forward or backward of a training step"
    assert "worker_0.log: RuntimeError: Allocate memory failed" in report.causes[0].evidence


@pytest.mark.parametrize(("line", "cause", "change"), [
    ("[ERROR] Failed to connect to the tcp server : 10.0.0.1:8118", "could not reach the master", "--master-port"),
    ("ValueError: Total worker number is 2, but got exceeded local worker number: 4.", "process count", "--nodes"),
    ("rank 1 on node 1 (host b, 10.0.0.2) stopped answering the job's scheduler (...)", "a node went silent",
     "--node-timeout"),
    ("RuntimeError: RANK_ID 1 conflicts with the rank id another process registered", "RANK_ID / DEVICE_ID",
     "leave RANK_ID"),
])
def test_a_launch_failure_in_the_logs_is_named_as_a_hang(line, cause, change):
    report = diagnose(RunEvidence(logs={"logs/msrun.log": f"starting\n{line}\n"}))
    assert report.kind == "hang"
    assert cause in report.causes[0].name and change in report.causes[0].change
    assert report.causes[0].evidence == f"logs/msrun.log: {line}"


@pytest.fixture(scope="module")
def short_runs(dataset_dir, tmp_path_factory) -> dict[str, tuple[object, list[dict], str | None]]:
    """Real short runs of the small model: name -> (params, metrics records, the error it ended with)."""
    from model_core.train.trainer import Trainer

    base = [*SMALL_MODEL, "train.log_interval=1", "train.eval_interval=1000", "train.micro_batch_size=2"]
    runs = {
        # Four times the small model's width: at 64 wide, Adam at lr 0.05 only makes the loss noisy.
        "divergence": ["model.hidden_size=256", "model.ffn_hidden_size=512", "optimizer.lr=0.05", "optimizer.grad_clip=null",
                       "optimizer.warmup_steps=2", "train.steps=30"],
        "overflow": ["precision.compute_dtype=float16", "precision.initial_loss_scale=1e30", "train.steps=10"],
    }
    found = {}
    for name, sets in runs.items():
        out = tmp_path_factory.mktemp(name)
        params = load_params("tiny", [*base, *sets, f"train.output_dir={out}"])
        records: list[dict] = []
        try:
            Trainer(params, dataset_dir, out / "ckpt").run(on_metrics=records.append)
            failure = None
        except ArithmeticError as error:
            failure = str(error)
        found[name] = (params, records, failure)
    return found


def test_a_learning_rate_far_too_high_without_clipping_diverges(short_runs):
    params, records, failure = short_runs["divergence"]
    report = diagnose(RunEvidence(params, records, failure=failure))
    assert report.kind == "divergence", report.text()
    first, second = report.causes[:2]
    assert first.name.startswith("learning rate far above") and first.evidence in run_warnings(params)
    assert second.change == "optimizer.grad_clip=1.0"


def test_an_fp16_loss_scale_fixed_too_high_overflows(short_runs):
    params, records, failure = short_runs["overflow"]
    assert failure is not None and "not finite" in failure
    report = diagnose(RunEvidence(params, records, failure=failure))
    assert report.kind == "non-finite"
    first = report.causes[0]
    assert first.name.startswith("fp16 loss-scale overflow")
    assert "at loss scale 5e+29 ->" in first.evidence and "precision.initial_loss_scale=1e+30" in first.evidence


def test_the_cli_reads_a_run_directory(tmp_path, capsys):
    from flows.cli import main
    from params import to_yaml

    params = load_params("tiny", ["model.rope_theta=10", "model.seq_len=1024"])
    (tmp_path / "params-100-steps.yaml").write_text(to_yaml(params))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _flat(range(1, 100))))
    assert main(["doctor", str(tmp_path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "plateau" and report["causes"][0]["name"].startswith("RoPE theta")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\nnot json\n')
    assert main(["doctor", str(tmp_path)]) == 1
    assert f"{tmp_path / 'metrics.jsonl'}:2: not a JSON metrics record" in capsys.readouterr().err


def _beat(rank: int, step: int, phase: str, written_at: float, inside: str | None = None) -> dict:
    collective = {"name": inside, "group": [0, 1], "entered_at": written_at - 20, "left": False} if inside else None
    return {"rank": rank, "pid": 100 + rank, "step": step, "phase": phase, "phase_since": written_at - 20,
            "collective": collective, "written_at": written_at, "step_seconds": 0.5}


def test_silent_ranks_are_those_that_stopped_beating():
    beats = [_beat(0, 5, "forward-backward", 1000.0, inside="all_reduce"), _beat(1, 5, "forward-backward", 970.0)]
    assert heartbeat.silent_ranks(beats) == ([1], [0])
    # Read after the job was killed, every beat aged together: the rank outside a collective is the silent one.
    together = [_beat(0, 5, "loss sum", 1000.0, inside="all_reduce"), _beat(1, 5, "forward-backward", 1000.0)]
    assert heartbeat.silent_ranks(together) == ([1], [0])
    behind = [_beat(0, 5, "loss sum", 1000.0, inside="all_reduce"), _beat(1, 1, "loss sum", 999.0, inside="all_reduce")]
    assert heartbeat.silent_ranks(behind) == ([1], [0])
    report = hang_report(beats, frozenset({1}))
    assert report.splitlines()[0].startswith("stopped (SIGSTOP or a debugger): rank 1 at step 5 in forward-backward")
    assert "no heartbeat for 30 s" in report.splitlines()[0]
    assert report.splitlines()[1].startswith("waiting: rank 0 at step 5 in forward-backward")
    assert "inside all_reduce over ranks [0, 1] for 20 s" in report


def test_a_rank_writes_its_heartbeat_when_it_changes_and_times_steps_after_the_first(tmp_path):
    """In a process the launcher started (its env), the heartbeat follows the phases within a fraction of a second
    and carries the median duration of the steps after the first (which compiles)."""
    code = (
        "import time, json\n"
        "from model_core.parallel import heartbeat\n"
        "for step, pause in ((1, 0.6), (2, 0.1), (3, 0.1), (4, 0.1)):\n"
        "    heartbeat.phase('forward-backward', step=step)\n"
        "    time.sleep(pause)\n"
        "with heartbeat.collective('all_reduce', (0, 1)):\n"
        "    time.sleep(0.6)\n"
        f"    print(open(heartbeat.file_of({str(tmp_path)!r}, 1)).read())\n"
    )
    env = {**os.environ, "LLMFLOW_HEARTBEAT_DIR": str(tmp_path), "RANK_ID": "1", "MS_ROLE": "MS_WORKER"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    beat = json.loads(done.stdout)
    assert (beat["rank"], beat["step"], beat["phase"]) == (1, 4, "forward-backward")
    assert beat["collective"]["name"] == "all_reduce" and not beat["collective"]["left"]
    assert 0.1 <= beat["step_seconds"] < 0.5  # steps 2 and 3, not the first


def test_the_watch_calls_a_hang_after_the_multiple_of_the_step_time(tmp_path, monkeypatch):
    clock = [10.0]
    monkeypatch.setattr("model_core.parallel.launch.time.monotonic", lambda: clock[0])
    now = time.time()
    for beat in (_beat(0, 5, "forward-backward", now, inside="all_reduce"), _beat(1, 5, "update", now - 30)):
        heartbeat.file_of(tmp_path, beat["rank"]).write_text(json.dumps(beat))
    watch = _Watch(progressed=0.0)
    assert not watch.hung(tmp_path, step_multiple=10, min_s=3)  # the first look records the progress
    clock[0] = 14.0  # 10 x the 0.5 s median step time not yet passed
    assert not watch.hung(tmp_path, step_multiple=10, min_s=3)
    clock[0] = 15.1
    assert watch.hung(tmp_path, step_multiple=10, min_s=3)
    assert "no rank has started a new step or phase for 5 s (10 x the median step time 0.50 s" in watch.hang
    assert "silent: rank 1 at step 5 in update" in watch.hang
    report = diagnose(RunEvidence(load_params("tiny"), heartbeats=heartbeat.read_all(tmp_path)))
    assert report.kind == "hang" and report.causes[0].name == "rank 1 went silent while the others waited for it"


HANG_WORKER = """
import os, signal, sys, time
from model_core.parallel import comm, heartbeat
from model_core.parallel.data_parallel import sum_over
comm.init()
group = comm.group(tuple(range(comm.world_size())))
for step in range(1, 10_000):
    heartbeat.phase("forward-backward", step=step)
    time.sleep(0.2)
    if step == 4 and comm.rank() == 1:
        time.sleep(0.5)  # its heartbeat thread writes step 4 first
        os.kill(os.getpid(), signal.SIGSTOP)
    heartbeat.phase("loss sum")
    sum_over(group, [1.0])
"""


@pytest.mark.slow  # one 2-rank msrun launch
def test_a_rank_stopped_under_msrun_is_named_by_the_launcher_and_the_doctor(tmp_path, capsys):
    from flows.cli import main

    script = tmp_path / "hang_worker.py"
    script.write_text(HANG_WORKER)
    started = time.monotonic()
    with pytest.raises(LaunchError) as failed:
        launch([str(script)], 2, tmp_path / "logs", hang_step_multiple=5, hang_min_s=5, node_timeout_s=60, echo=sys.stderr)
    message = str(failed.value)
    assert message.startswith("the job hung: no rank has started a new step or phase for")
    assert "stopped (SIGSTOP or a debugger): rank 1 at step 4 in forward-backward" in message
    assert "waiting: rank 0 at step 4 in loss sum" in message and "inside all_reduce over ranks [0, 1]" in message
    assert time.monotonic() - started < 90
    capsys.readouterr()
    assert main(["doctor", str(tmp_path)]) == 0  # after the job: its heartbeats and the launcher's hang-node0.log
    printed = capsys.readouterr().out
    assert "trouble: hang or silent node" in printed
    assert "1. rank 1 went silent while the others waited for it" in printed
    assert "the job hung: no rank has started a new step or phase" in printed
