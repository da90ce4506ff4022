"""Each rank's heartbeat under the launcher: where it is (step, phase, the collective it last entered or left),
in a small JSON file the launcher's hang watch and `llmflow doctor` read.

A rank's main thread only changes a few fields in memory (at each phase of a step and around each collective
called from Python); a daemon thread writes them, with the time, to `<dir>/heartbeat-rank<r>.json`: as soon as they
change, but at most every CHANGE_INTERVAL_S, and every INTERVAL_S when they do not (so the file's age says whether
the rank is alive).
MindSpore gives up the GIL while a rank waits inside a collective, eager or compiled, so a rank that waits for a
peer keeps beating while it waits, and its file says what it waits in; a rank that is stopped, hung outside a
collective or gone stops beating, and its file ages. The directory is the launcher's log directory, passed in
HEARTBEAT_ENV; without it (one process, or ranks started by hand) nothing is recorded.

Collectives inside compiled graphs (a step's gradient all-reduces, a pipeline's sends) cannot be seen from Python:
the phase that runs the graph names them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from model_core.storage import replace_file

HEARTBEAT_ENV = "LLMFLOW_HEARTBEAT_DIR"
INTERVAL_S = 1.0
CHANGE_INTERVAL_S = 0.25
# A heartbeat older than another rank's by more than this has stopped beating (stopped, wedged, or gone): a live
# rank writes every INTERVAL_S, and a busy machine can hold its thread back a little.
STALE_S = 3 * INTERVAL_S
# Steps whose durations give the median step time a heartbeat carries (the first, which compiles, is left out).
RECENT_STEPS = 16


def file_of(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"heartbeat-rank{rank}.json"


class _Recorder:
    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.state = {"rank": rank, "pid": os.getpid(), "step": 0, "phase": "starting", "collective": None}
        self.step_started: float | None = None
        self.durations: list[float] = []
        self.timed_first = False  # whether this process's first step (which compiles) has ended
        self.lock = threading.Lock()
        self.changed = threading.Event()
        threading.Thread(target=self._write_forever, name="heartbeat", daemon=True).start()

    def _write_forever(self) -> None:
        while True:
            with self.lock:
                text = json.dumps({**self.state, "written_at": time.time()})
                self.changed.clear()
            try:
                replace_file(self.path, text)
            except OSError:
                pass  # a full or vanished log directory must not stop training; the launcher sees the file age
            time.sleep(CHANGE_INTERVAL_S)
            self.changed.wait(INTERVAL_S - CHANGE_INTERVAL_S)

    def update(self, **fields) -> None:
        with self.lock:
            self.state.update(fields)
            self.changed.set()


_recorder: _Recorder | None = None
_started = False


def _get() -> _Recorder | None:
    global _recorder, _started
    if not _started:
        _started = True
        directory, rank = os.environ.get(HEARTBEAT_ENV), os.environ.get("RANK_ID")
        if directory and rank is not None and os.environ.get("MS_ROLE") != "MS_SCHED":
            _recorder = _Recorder(file_of(directory, int(rank)), int(rank))
    return _recorder


def phase(name: str, step: int | None = None) -> None:
    """This rank is now in phase `name` (of optimizer step `step`, counted from 1, when given). A new step
    records the previous one's duration."""
    recorder = _get()
    if recorder is None:
        return
    fields: dict = {"phase": name, "phase_since": time.time()}
    if step is not None and step != recorder.state["step"]:
        now = time.monotonic()
        if recorder.step_started is not None and recorder.timed_first:
            recorder.durations = (recorder.durations + [now - recorder.step_started])[-RECENT_STEPS:]
            fields["step_seconds"] = sorted(recorder.durations)[len(recorder.durations) // 2]
        recorder.timed_first = recorder.step_started is not None
        recorder.step_started = now
        fields["step"] = step
    recorder.update(**fields)


@contextmanager
def collective(name: str, ranks: tuple[int, ...]) -> Iterator[None]:
    """Record entering and leaving a collective over `ranks` called from Python."""
    recorder = _get()
    if recorder is None:
        yield
        return
    recorder.update(collective={"name": name, "group": list(ranks), "entered_at": time.time(), "left": False})
    try:
        yield
    finally:
        recorder.update(collective={**recorder.state["collective"], "left": True})


def read_all(directory: str | Path) -> list[dict]:
    """Every rank's last heartbeat in `directory`, by rank; unreadable files are left out."""
    beats = []
    for path in sorted(Path(directory).glob("heartbeat-rank*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(beats, key=lambda beat: beat["rank"])


def silent_ranks(beats: list[dict], stopped: frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """(silent ranks, waiting ranks). Silent: stopped (`stopped`, from the process table), or no longer beating
    while another rank still did: its last heartbeat is older than the newest by more than STALE_S, which holds
    while the job runs and after it was killed alike. When every rank beat to the end, the ranks outside a
    collective hold up those inside one; when all are inside one, those at the lowest step hold up the rest."""
    newest = max((beat["written_at"] for beat in beats), default=0.0)
    ranks = [beat["rank"] for beat in beats]
    silent = {beat["rank"] for beat in beats if newest - beat["written_at"] > STALE_S} | set(stopped)
    if not silent:
        inside = {beat["rank"] for beat in beats if _inside(beat)}
        if inside and inside != set(ranks):
            silent = set(ranks) - inside
        elif inside:
            lowest = min(beat["step"] for beat in beats)
            behind = {beat["rank"] for beat in beats if beat["step"] == lowest}
            silent = behind if behind != set(ranks) else set()
    return sorted(silent), [rank for rank in ranks if rank not in silent]


def _inside(beat: dict) -> bool:
    return beat.get("collective") is not None and not beat["collective"]["left"]


def describe(beat: dict, now: float) -> str:
    """One rank's heartbeat in words, as of `now`: its step and phase, the collective it is inside (or last left),
    and how long it has not beaten when that is past the staleness limit."""
    words = f"rank {beat['rank']} at step {beat['step']} in {beat['phase']}"
    if beat.get("phase_since"):
        words += f" (for {now - beat['phase_since']:.0f} s)"
    held = beat.get("collective")
    if held is not None:
        where = "inside" if not held["left"] else "last left"
        words += f", {where} {held['name']} over ranks {held['group']}"
        if not held["left"]:
            words += f" for {now - held['entered_at']:.0f} s"
    if now - beat["written_at"] > STALE_S:
        words += f"; no heartbeat for {now - beat['written_at']:.0f} s"
    return words
