"""Why a run ran out of memory, read from what it left: its log (a rank's worker log, the console output) and,
when given, its metrics (JSON lines of `llmflow train --metrics-jsonl`).

Where memory ran out says what to change, as experienced trainers read it:
  load       while the weights were being made or read: the parameters themselves do not fit a rank, so
             split them: tensor parallelism, then pipeline stages, then ZeRO-3.
  step       in the forward or backward of a micro-batch (one compiled graph, so the two are not told apart):
             activations, so recompute, then a smaller micro-batch (more micro-batches keep the global batch).
  update     in the optimizer step: optimizer state, so ZeRO-1/2, then ZeRO-3, then optimizer offload when
             the gap is small (`llmflow plan` says whether it is).
  checkpoint while a checkpoint was gathered and written: the whole state passing through host memory, so
             shard it (ZeRO-3) or keep fewer copies.
The phase comes from the innermost llmflow frame of the failure's traceback that names one of the phase's
functions (`Trainer.save`, `Parallelized.apply`, `Parallelized.gradients`, `build_shard`, ...). A process the kernel's OOM killer
ended (SIGKILL: exit code -9 or 137, "Killed") leaves no traceback; then the metrics say whether any step had
finished: none means the load or the first step, some means a later step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Messages that say memory ran out, from Python, MindSpore's allocators, CUDA/Ascend and the kernel.
_OUT_OF_MEMORY = re.compile(
    r"MemoryError|out of memory|Out of memory|OutOfMemory|bad_alloc|Malloc .*failed|Allocate .*memory failed|"
    r"alloc(?:ate)? device memory failed|Cannot allocate memory|memory is not enough|Memory not enough",
    re.IGNORECASE,
)
_KILLED = re.compile(r"exit(?:ed)? with (?:exception\. )?(?:error )?code:? ?(-9|137)\b|\bKilled\b|SIGKILL|signal 9\b", re.IGNORECASE)
# The llmflow functions whose frame places a failure in a phase (the innermost such frame decides).
_PHASE_FUNCTIONS = {
    "checkpoint": {"save", "save_checkpoint", "full_weights", "write_safetensors"},
    "update": {"apply", "_apply", "update"},
    "step": {"gradients", "run_pass", "_optimizer_step", "summed_loss"},
    "load": {"build_shard", "materialize", "load_weights", "read_block", "parallelize", "convert_for_run", "_load",
             "resume", "_continue", "values", "hf_to_ms"},
}
_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')
ADVICE = {
    "load": (
        "the parameters themselves do not fit one rank: add tensor parallelism (parallel.tensor_parallel, inside "
        "a node), then pipeline stages (parallel.pipeline_parallel), then ZeRO-3 (parallel.zero_stage=3)"
    ),
    "step": (
        "activations: turn on recompute (recompute.mode=all, or selected blocks), then halve train.micro_batch_size "
        "and double parallel.micro_batches to keep the global batch"
    ),
    "update": (
        "optimizer state: shard it with ZeRO (parallel.zero_stage=1, then 2, then 3); if ZeRO-2 is on and the gap "
        "is within 20%, parallel.optimizer_offload=true (`llmflow plan` says whether it is)"
    ),
    "checkpoint": (
        "the whole state passing through host memory to be written: shard the weights (parallel.zero_stage=3) so "
        "each rank writes its own, or raise host memory"
    ),
}
PHASE_WORDS = {
    "load": "while loading or making the weights",
    "step": "in the forward or backward of a training step",
    "update": "in the optimizer update",
    "checkpoint": "while writing a checkpoint",
}


@dataclass(frozen=True)
class Diagnosis:
    phase: str | None  # load, step, update, checkpoint; None when memory did not run out, or no phase is known
    evidence: str  # the log line (or metrics fact) the diagnosis rests on
    advice: str

    def __str__(self) -> str:
        if self.phase is None:
            return f"{self.evidence}\n{self.advice}"
        return f"memory ran out {PHASE_WORDS[self.phase]} ({self.evidence})\nwhat to change: {self.advice}"


def explain_oom(log_text: str, metrics: list[dict] | None = None) -> Diagnosis:
    """The phase a run ran out of memory in, and what to change (the module docstring's table)."""
    lines = log_text.splitlines()
    failure = next((i for i in range(len(lines) - 1, -1, -1) if _OUT_OF_MEMORY.search(lines[i])), None)
    if failure is not None:
        phase = _phase_from_traceback(lines[: failure + 1])
        evidence = lines[failure].strip()
        if phase is None:
            return Diagnosis(None, f"memory ran out ({evidence}), but the log shows no llmflow frame to place it",
                             "run with LLMFLOW_DEBUG=1 to keep the traceback, or pass the run's metrics")
        return Diagnosis(phase, evidence, ADVICE[phase])
    killed = next((line.strip() for line in reversed(lines) if _KILLED.search(line)), None)
    if killed is None:
        return Diagnosis(None, "the log shows no out-of-memory failure and no process killed by a signal",
                         "nothing to change for memory; the failure is elsewhere in the log")
    if metrics is None:
        return Diagnosis(None, f"a process was killed ({killed}), as the OOM killer does, with no traceback",
                         "pass the run's metrics (--metrics FILE) to place it before or after its first step")
    steps = [record["step"] for record in metrics if "step" in record]
    if not steps:
        return Diagnosis("load", f"{killed}; no step had finished", ADVICE["load"])
    return Diagnosis("step", f"{killed}; after step {max(steps)}, with no traceback to tell forward, backward or "
                     "update apart", ADVICE["step"])


def _phase_from_traceback(lines: list[str]) -> str | None:
    """The phase of the innermost llmflow frame (in model_core, tasks or flows) that names a phased function."""
    for line in reversed(lines):
        frame = _FRAME.search(line)
        if frame is None or not any(part in frame[1] for part in ("model_core", "tasks", "flows")):
            continue
        for phase, functions in _PHASE_FUNCTIONS.items():
            if frame[2] in functions:
                return phase
    return None


def read_log(path: str | Path) -> str:
    """The text of a failed run's log; a missing, empty or binary file is an error naming it."""
    return _read_text(Path(path), "a failed run's log (a rank's logs/worker_<rank>.log, or its console output)")


def read_metrics(path: str | Path) -> list[dict]:
    """The metrics records of a JSON-lines file; a malformed line is an error naming its file and line."""
    records = []
    lines = _read_text(Path(path), "the run's --metrics-jsonl file").splitlines()
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON metrics record ({error.msg})") from error
    return records


def _read_text(path: Path, wanted: str) -> str:
    """`path` as text, or a ValueError that names it, says why it is not text and what is wanted. A NUL byte
    marks a binary file (as git and grep judge it); stray bytes that are not UTF-8, which a process killed
    mid-write or a foreign locale leaves in a real log, are read as replacement characters."""
    if not path.is_file():
        raise ValueError(f"{path} {'is not a file' if path.exists() else 'does not exist'}; expected {wanted}")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path} is empty; expected {wanted}")
    if b"\0" in data:
        raise ValueError(f"{path} could not be read as text (binary: a NUL byte at offset {data.index(0)}); "
                         f"expected {wanted}")
    return data.decode("utf-8", errors="replace")
