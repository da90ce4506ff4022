"""Start a multi-process job under msrun and watch it until it ends: success, or a failure that names the
rank that died and shows the end of its log, within a bounded time. Nothing is left running.

msrun (with --join=True) already kills the other workers when one exits with an error, but then waits for
its scheduler, which only notices lost workers after a heartbeat timeout, and a dead scheduler leaves the
workers retrying for up to --cluster_time_out. So the watcher gives the job `grace_s` seconds to finish
after the first of its processes exits (the trainer ends with a barrier, so healthy ranks leave together)
and then kills every process msrun started: its own process group and each worker's (msrun starts every
worker in a session of its own).

Multi-node: run the same `launch` on every node with `nodes`, that node's `node_rank` and the same
`master_addr`/`master_port` (node 0's address); the world size is the total over all nodes. A node whose
processes die or whose network goes is noticed by the scheduler (on node 0) after `node_timeout_s` without
its heartbeats; the job then stops on every node. Each node notes its host name and address in the log
directory (shared by the nodes, like the checkpoints), so node 0 can say which machine was lost.

MindSpore reads one variable, MS_NODE_TIMEOUT, for two waits: the scheduler's for a silent node, and on the CPU
backend a rank's, inside every collective, for a peer that has not arrived yet. A peer compiling its first
graph of a pipeline stage, or a busy machine, can be late by far more than a node may stay silent, so the
scheduler gets `node_timeout_s` and the ranks `collective_timeout_s` (`comm.init` applies it in each rank
before MindSpore's collectives read it). A lost node is then found by the scheduler alone, and the job is
stopped at once, not after a rank's collective gives up.

A rank that refuses to go on (an error meant for the user: a checkpoint that does not fit the model, say) exits,
and the scheduler may then report it lost before msrun reports its exit code. So each rank leaves its one-line
reason in `log_dir/rank-<r>.error` (`note_rank_failure`), and a failed job is reported by the earliest of those
when there is one: `rank 1: <its reason>`, the last line the user reads.

A job can also hang with every process alive: a rank stopped or wedged outside a collective, ranks that disagree
on which collective comes next. Each rank records a heartbeat (`model_core.parallel.heartbeat`: its step, its
phase, the collective it is in); when no rank has started a new step or phase for `hang_step_multiple` times the
median step time (never sooner than `hang_min_s`; the first step, which compiles, is never judged), the job is
stopped with the silent ranks named and what each of the others waits in, instead of waiting out the collective
timeout with nothing to show. A lost node is reported with the same heartbeats.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from model_core.parallel import heartbeat
from model_core.parallel.layout import Layout, ParallelConfigError
from model_core.storage import write_file
from params.schema import PipelineParams

LOG_TAIL_LINES = 40
# Each rank of `llmflow train` under msrun leaves its peak memory in <checkpoint dir>/RANK_MEMORY/rank-<r>.json:
# rank 0 alone reports metrics, and the busiest rank is often another (a pipeline's first stage, say).
RANK_MEMORY = "rank-memory"
_WORKER_FAILED = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
# The scheduler's word for a rank whose heartbeats stopped: its node died or lost the network.
_RANK_LOST = re.compile(r"The node: (\d+) is timed out")
# How long a rank waits inside a CPU collective for a late peer (PyTorch's process groups wait 10 minutes).
COLLECTIVE_TIMEOUT_S = 600
# The launcher's word for it to each rank, which `comm.init` applies. Kept here, not in comm: the CLI imports this
# module, and comm imports MindSpore, which data-prep worker processes (started from the CLI) must not load.
COLLECTIVE_TIMEOUT_ENV = "LLMFLOW_COLLECTIVE_TIMEOUT"
# Where a rank leaves its reason for failing (the launcher's log directory), for `note_rank_failure`.
RANK_ERRORS_ENV = "LLMFLOW_RANK_ERRORS"


class LaunchError(RuntimeError):
    """The distributed job failed; the message names the rank and ends with its log tail."""


def launch_training(params: PipelineParams, cli_args: Sequence[str], log_dir: str | Path, **cluster) -> None:
    """Run `python -m flows.cli train <cli_args>` on params.parallel.world_size ranks (what `llmflow train`
    does when that is more than 1). The layout is checked first, so a bad one fails before anything starts.
    `cluster`: launch's nodes, node_rank, master_addr, master_port, grace_s, node_timeout_s,
    collective_timeout_s."""
    world_size = params.parallel.world_size
    Layout.from_params(params, world_size)
    launch(["-m", "flows.cli", "train", *cli_args], world_size, log_dir, **hang_watch(params), **cluster)


def hang_watch(params: PipelineParams) -> dict[str, float]:
    """`launch`'s hang-watch arguments from params.parallel: every launch of training ranks (pretraining and
    fine-tuning alike) is watched the same way."""
    return {"hang_step_multiple": params.parallel.hang_step_multiple, "hang_min_s": params.parallel.hang_min_seconds}


@dataclass
class _Process:
    role: str  # "rank N" or "scheduler"
    log: Path | None
    started: float  # psutil create_time: a reused pid is never mistaken for this process
    exited_at: float | None = None


@dataclass
class _Watch:
    processes: dict[int, _Process] = field(default_factory=dict)
    first_exit: float | None = None
    scheduler_checked: float = 0.0
    beats_checked: float = 0.0
    progress: tuple = ()  # every rank's (step, phase) at the last change
    progressed: float = field(default_factory=time.monotonic)
    hang: str | None = None  # why the job was found hung

    def hung(self, log_dir: Path, step_multiple: float, min_s: float) -> bool:
        """Whether no rank has started a new step or phase for `step_multiple` median step times (at least `min_s`);
        read once a second. Sets `hang` to the report."""
        now = time.monotonic()
        if now - self.beats_checked < 1.0:
            return False
        self.beats_checked = now
        beats = heartbeat.read_all(log_dir)
        progress = tuple((beat["rank"], beat["step"], beat["phase"]) for beat in beats)
        if progress != self.progress:
            self.progress, self.progressed = progress, now
            return False
        step_seconds = max((beat.get("step_seconds") or 0.0 for beat in beats), default=0.0)
        if not step_seconds:
            return False  # no step after the first has started: compiling, loading, or not beating at all
        limit = max(step_multiple * step_seconds, min_s)
        if now - self.progressed < limit:
            return False
        self.hang = (
            f"the job hung: no rank has started a new step or phase for {now - self.progressed:.0f} s "
            f"({step_multiple:g} x the median step time {step_seconds:.2f} s, at least {min_s:g} s: "
            f"parallel.hang_step_multiple, parallel.hang_min_seconds)\n{hang_report(beats, self.stopped_ranks())}"
        )
        return True

    def stopped_ranks(self) -> frozenset[int]:
        """Ranks whose process is stopped (SIGSTOP, a debugger) by the process table."""
        stopped = set()
        for pid, process in self.processes.items():
            try:
                if process.role.startswith("rank ") and psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    stopped.add(int(process.role.removeprefix("rank ")))
            except psutil.NoSuchProcess:
                continue
        return frozenset(stopped)

    def lost_node(self, scheduler_log: Path) -> bool:
        """Whether this node's scheduler (node 0 runs it) has given up on a silent node; read once a second."""
        now = time.monotonic()
        if now - self.scheduler_checked < 1.0 or not scheduler_log.exists():
            return False
        self.scheduler_checked = now
        return _RANK_LOST.search(scheduler_log.read_text(errors="replace")) is not None


def hang_report(beats: list[dict], stopped: frozenset[int] = frozenset()) -> str:
    """Which ranks are silent and what each of the others waits in, one line each, from their heartbeats."""
    if not beats:
        return "no rank left a heartbeat (none reached its first step)"
    silent, waiting = heartbeat.silent_ranks(beats, stopped)
    now = max(beat["written_at"] for beat in beats)
    by_rank = {beat["rank"]: beat for beat in beats}
    lines = []
    for rank in silent:
        state = "stopped (SIGSTOP or a debugger)" if rank in stopped else "silent"
        lines.append(f"{state}: {heartbeat.describe(by_rank[rank], now)}")
    lines += [f"waiting: {heartbeat.describe(by_rank[rank], now)}" for rank in waiting]
    return "\n".join(lines)


def launch(
    python_args: Sequence[str],
    world_size: int,
    log_dir: str | Path,
    *,
    nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace_s: float = 15.0,
    hang_step_multiple: float | None = None,
    hang_min_s: float = 180.0,
    cluster_timeout_s: int = 120,
    node_timeout_s: int = 15,
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S,
    echo: TextIO | None = None,
) -> None:
    """Run `python <python_args>` as `world_size / nodes` local ranks of a `world_size`-rank msrun job.

    This node's first rank's log streams to `echo` (stdout by default). Returns when every rank succeeded;
    raises LaunchError otherwise. Logs: `log_dir/worker_<rank>.log`, msrun's own in `log_dir/msrun.log`
    (`msrun-node<r>.log` on each node of a multi-node job, whose nodes may share log_dir). MindSpore's own
    logging shows errors only (its INFO and WARNING lines are connection chatter), unless GLOG_v is set or
    LLMFLOW_DEBUG=1. `node_timeout_s`: how long the scheduler waits for a silent node before it fails the
    job (MindSpore's MS_NODE_TIMEOUT, used as given when set); MindSpore's default of 30 s, plus the stop
    that follows, is more than the half minute within which a lost host should fail the job.
    `collective_timeout_s`: how long a rank waits in a CPU collective for a late peer (see the module docstring;
    LLMFLOW_COLLECTIVE_TIMEOUT, when set, wins). `hang_step_multiple`, `hang_min_s`: when the job counts as hung
    (the module docstring; None: no hang watch)."""
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ParallelConfigError(f"world size {world_size} does not split evenly over {nodes} nodes")
    if not 0 <= node_rank < nodes:
        raise ParallelConfigError(f"node rank {node_rank} is outside 0..{nodes - 1}")
    if node_timeout_s < 1:
        raise ParallelConfigError(f"node timeout {node_timeout_s} s: a node must be given at least 1 s")
    if collective_timeout_s < node_timeout_s:
        raise ParallelConfigError(
            f"collective timeout {collective_timeout_s} s is shorter than the node timeout {node_timeout_s} s: "
            "a rank would give up on a live peer before the scheduler could find a lost one"
        )
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    local = world_size // nodes
    command = [
        sys.executable, "-c", "import sys; from mindspore.parallel.cluster.run import main; sys.exit(main())",
        f"--worker_num={world_size}", f"--local_worker_num={local}", f"--node_rank={node_rank}",
        f"--master_addr={master_addr}", f"--master_port={master_port or free_port()}",
        f"--log_dir={log_dir}", "--join=True", f"--cluster_time_out={cluster_timeout_s}", "--tail_worker_log=-1",
        "python", *python_args,
    ]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    quiet = "GLOG_v" not in env and env.get("LLMFLOW_DEBUG") != "1"
    if quiet:
        env["GLOG_v"] = "3"  # MindSpore's log level: errors only
    env.setdefault("MS_NODE_TIMEOUT", str(node_timeout_s))
    env.setdefault(COLLECTIVE_TIMEOUT_ENV, str(collective_timeout_s))
    env[RANK_ERRORS_ENV] = str(log_dir.resolve())
    env[heartbeat.HEARTBEAT_ENV] = str(log_dir.resolve())
    if nodes > 1:
        _note_this_node(log_dir, node_rank, master_addr)
    _set_aside_earlier_logs(log_dir, range(node_rank * local, (node_rank + 1) * local), node_rank == 0)
    hang_log = log_dir / f"hang-node{node_rank}.log"
    hang_log.unlink(missing_ok=True)
    msrun_log = log_dir / ("msrun.log" if nodes == 1 else f"msrun-node{node_rank}.log")
    with msrun_log.open("w") as sink:
        msrun = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    watch = _Watch()
    try:
        streamed = log_dir / f"worker_{node_rank * local}.log"
        # Only node 0 runs the scheduler; on a shared log directory another node would read its earlier log.
        scheduler_log = log_dir / "scheduler.log" if node_rank == 0 else None
        hang = (hang_step_multiple, hang_min_s) if hang_step_multiple is not None else None
        finished = _supervise(msrun, watch, streamed, scheduler_log, grace_s, echo or sys.stdout, quiet, hang)
    finally:
        _kill_all(msrun, watch)
    if watch.hang is not None:
        write_file(hang_log, watch.hang + "\n")  # for `llmflow doctor`, which reads the log directory
        raise LaunchError(watch.hang)
    refusal = None if finished and msrun.returncode == 0 else _first_refusal(log_dir)
    if refusal:
        raise LaunchError(refusal)
    if not finished:
        reason = _failed_process(msrun_log, watch, local, node_rank, master_addr)
        if watch.first_exit is not None:
            reason += f"\n(the job was killed {grace_s:.0f} s after that exit)"
        raise LaunchError(reason)
    if msrun.returncode != 0:
        raise LaunchError(_failed_process(msrun_log, watch, local, node_rank, master_addr))


def _supervise(
    msrun: subprocess.Popen, watch: _Watch, streamed: Path, scheduler_log: Path | None, grace_s: float,
    echo: TextIO, quiet: bool, hang: tuple[float, float] | None = None,
) -> bool:
    """Stream the log and track processes until msrun exits (True), the grace after a first exit runs out,
    this node's scheduler (`scheduler_log`, node 0's) gives up on a silent node, or the ranks' heartbeats say the
    job hangs (`hang`: the step multiple and the least wait, `_Watch.hung`)."""
    offset = 0
    while True:
        done = msrun.poll() is not None
        offset = _copy_new_text(streamed, offset, echo, quiet, whole=done)
        if done:
            return True
        _track(msrun.pid, watch, streamed.parent)
        if watch.first_exit is not None and time.monotonic() - watch.first_exit > grace_s:
            return False
        if scheduler_log is not None and watch.lost_node(scheduler_log):
            return False  # the job cannot go on without that node's ranks: no grace to wait out
        if hang is not None and watch.hung(streamed.parent, *hang):
            return False
        time.sleep(0.2)


def _track(msrun_pid: int, watch: _Watch, log_dir: Path) -> None:
    try:
        children = psutil.Process(msrun_pid).children()  # workers and scheduler; not their own helpers
    except psutil.NoSuchProcess:
        return
    for child in children:
        if child.pid in watch.processes:
            continue
        try:
            environ = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if environ.get("MS_ROLE") == "MS_WORKER" and "RANK_ID" in environ:
            rank = environ["RANK_ID"]
            watch.processes[child.pid] = _Process(f"rank {rank}", log_dir / f"worker_{rank}.log", child.create_time())
        elif environ.get("MS_ROLE") == "MS_SCHED":
            watch.processes[child.pid] = _Process("scheduler", log_dir / "scheduler.log", child.create_time())
    now = time.monotonic()
    for pid, process in watch.processes.items():
        if process.exited_at is None and not _alive(pid, process):
            process.exited_at = now
            watch.first_exit = watch.first_exit or now


def _alive(pid: int, process: _Process) -> bool:
    try:
        found = psutil.Process(pid)
        return found.create_time() == process.started and found.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _failed_process(
    msrun_log: Path, watch: _Watch, ranks_per_node: int, node_rank: int = 0, master_addr: str = "127.0.0.1"
) -> str:
    """A rank the scheduler lost (on node 0, which runs it: another node died), else the failed worker msrun
    names by pid, else the first process seen to exit. On another node, a rank ended by SIGTERM was most
    likely stopped by msrun because node 0's scheduler went away, which the message says."""
    scheduler_log = msrun_log.parent / "scheduler.log"
    lost = _RANK_LOST.search(scheduler_log.read_text(errors="replace")) if scheduler_log.exists() else None
    if lost:
        rank = int(lost[1])
        node = rank // ranks_per_node
        return (
            f"rank {rank} on node {node}{_where(msrun_log.parent, node)} stopped answering the job's scheduler "
            f"(that node's processes died or it lost the network), so this node's ranks were stopped; the "
            f"scheduler's log: {scheduler_log}{_heartbeats(msrun_log.parent, watch)}"
        )
    found = _WORKER_FAILED.search(msrun_log.read_text(errors="replace"))
    if found and int(found[1]) in watch.processes:
        what = f"exited with code {found[2]}"
        if node_rank != 0 and int(found[2]) == -signal.SIGTERM:
            what += (
                f" (SIGTERM: msrun stops this node's ranks when the job's scheduler on node 0, {master_addr}, goes "
                f"away, so node 0's log, msrun-node0.log, most likely says why the job ended)"
            )
        return _describe(watch.processes[int(found[1])], what)
    exited = [p for p in watch.processes.values() if p.exited_at]
    if exited:
        return _describe(min(exited, key=lambda p: p.exited_at), "exited first")
    return f"msrun failed before any rank started; the end of {msrun_log}:\n{log_tail(msrun_log)}"


def _heartbeats(log_dir: Path, watch: _Watch) -> str:
    """The ranks' last heartbeats, as `hang_report` says them, when they left any."""
    beats = heartbeat.read_all(log_dir)
    return f"\nthe ranks' last heartbeats:\n{hang_report(beats, watch.stopped_ranks())}" if beats else ""


def note_rank_failure(reason: str) -> None:
    """Leave this rank's one-line reason for failing where its launcher looks (nothing outside `launch`)."""
    directory, rank = os.environ.get(RANK_ERRORS_ENV), os.environ.get("RANK_ID")
    if directory and rank is not None:
        write_file(Path(directory) / f"rank-{rank}.error", reason)


def _first_refusal(log_dir: Path) -> str | None:
    """`rank R: <reason>` of the rank that noted its reason first (a peer's own failure may follow it)."""
    notes = [
        (path.stat().st_mtime_ns, int(path.stem.removeprefix("rank-")), path) for path in log_dir.glob("rank-*.error")
    ]
    if not notes:
        return None
    _, rank, path = min(notes)
    return f"rank {rank}: {path.read_text(errors='replace').strip()}"


def _set_aside_earlier_logs(log_dir: Path, ranks: range, scheduler: bool) -> None:
    """Rename the logs an earlier job in this directory (a resumed run's first attempt) left, to
    `<name>.previous.log`: msrun rewrites them in place, so streaming from the start of a stale log would
    skip the new one's first lines, and a stale scheduler log would blame a node for a failure it did not
    cause this time. An earlier job's rank-<r>.error notes and heartbeats are deleted: they are not this job's."""
    for rank in ranks:
        (log_dir / f"rank-{rank}.error").unlink(missing_ok=True)
        heartbeat.file_of(log_dir, rank).unlink(missing_ok=True)
    names = [f"worker_{rank}.log" for rank in ranks] + (["scheduler.log"] if scheduler else [])
    for name in names:
        log = log_dir / name
        if log.exists():
            log.replace(log.with_name(f"{log.stem}.previous.log"))


def _note_this_node(log_dir: Path, node_rank: int, master_addr: str) -> None:
    """Write `node-<rank>.json`: this machine's name and the address it reaches node 0 from."""
    note = {"node": node_rank, "host": socket.gethostname(), "address": _address_towards(master_addr)}
    write_file(log_dir / f"node-{node_rank}.json", json.dumps(note))


def _address_towards(master_addr: str) -> str | None:
    """The local address the route to node 0 leaves from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def _where(log_dir: Path, node: int) -> str:
    """' (host NAME, ADDRESS)' from the node's own note, or nothing when it left none here."""
    try:
        note = json.loads((log_dir / f"node-{node}.json").read_text())
    except (OSError, ValueError):
        return ""
    return f" (host {note['host']}, {note['address']})" if note.get("address") else f" (host {note['host']})"


def _describe(process: _Process, what: str) -> str:
    return f"{process.role} {what}; the end of its log {process.log}:\n{log_tail(process.log)}"


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, leaving out MindSpore's [INFO]/[WARNING] chatter when anything else is left."""
    if path is None or not path.exists():
        return f"({path}: no log)"
    text = path.read_text(errors="replace").splitlines()
    meaningful = [line for line in text if not line.startswith(("[INFO]", "[WARNING]"))]
    return "\n".join((meaningful or text)[-lines:])


def _copy_new_text(path: Path, offset: int, echo: TextIO, quiet: bool = False, whole: bool = False) -> int:
    """Copy the log's complete new lines (all of it when `whole`) to `echo`; the offset copied up to. `quiet`
    leaves out MindSpore's INFO lines: a worker's communication threads print some while the process exits,
    whatever GLOG_v says."""
    if not path.exists():
        return offset
    with path.open("rb") as handle:
        handle.seek(offset)
        chunk = handle.read()
    if not whole:
        chunk = chunk[: chunk.rfind(b"\n") + 1]
    if chunk:
        lines = chunk.decode(errors="replace").splitlines(keepends=True)
        echo.write("".join(line for line in lines if not (quiet and line.startswith("[INFO] "))))
        echo.flush()
    return offset + len(chunk)


def _kill_all(msrun: subprocess.Popen, watch: _Watch) -> None:
    """SIGKILL what is left of the job: each worker's session, then msrun's group (scheduler included)."""
    for pid, process in watch.processes.items():
        if _alive(pid, process):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if msrun.poll() is None:
        try:
            os.killpg(msrun.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    msrun.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
