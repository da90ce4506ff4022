"""Two hosts on one machine: two network namespaces joined by a veth pair, addressed from 192.0.2.0/24 (a
documentation range: nothing outside the namespaces is ever addressed), one `llmflow train` node rank in each.
dp2 with one rank a host and tp2 x pp2 with two equal one process over 10 steps; the second node says what it
did instead of a checkpoint it never wrote, MindSpore's INFO lines stay out of both consoles, and killing the
second host stops the first within 30 s with the lost rank and its host named in one line, after which
`--resume auto` on both hosts continues the job bit for bit.

The namespaces need root (CAP_SYS_ADMIN) and iproute2's `ip`; where they cannot be made the tests skip and
say why. They are deleted after the tests, and before them in case a killed run left some behind."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_MODEL, docstring_documents
from safetensors.numpy import load_file

from model_core.data import prepare_dataset
from model_core.parallel.layout import Layout
from model_core.train.trainer import Trainer
from params import load_params

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# (namespace, its end of the veth pair, its address)
HOSTS = (("llmflow-h0", "llmflow-v0", "192.0.2.1"), ("llmflow-h1", "llmflow-v1", "192.0.2.2"))
MASTER_PORT = 29555  # a fresh namespace has every port free
STEPS = 10


def _ip(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *arguments], capture_output=True, text=True, check=False)


def _why_no_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN)"
    made = _ip("netns", "add", "llmflow-probe")
    _ip("netns", "delete", "llmflow-probe")
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


def _delete_hosts() -> None:
    for namespace, _, _ in HOSTS:  # deleting a namespace deletes the veth end inside it, and so the pair
        _kill_everything_in(namespace)
        _ip("netns", "delete", namespace)


def _kill_everything_in(namespace: str) -> None:
    pids = _ip("netns", "pids", namespace).stdout.split()
    if pids:
        subprocess.run(["kill", "-9", *pids], check=False)


def _make_hosts() -> None:
    (first, first_end, _), (second, second_end, _) = HOSTS
    steps = [
        ("netns", "add", first), ("netns", "add", second),
        ("link", "add", first_end, "type", "veth", "peer", "name", second_end),
        ("link", "set", first_end, "netns", first), ("link", "set", second_end, "netns", second),
    ]
    for namespace, end, address in HOSTS:
        steps += [
            ("-n", namespace, "addr", "add", f"{address}/24", "dev", end),
            ("-n", namespace, "link", "set", end, "up"),
            ("-n", namespace, "link", "set", "lo", "up"),  # msrun's ranks also talk to their own node
            # Ray finds a host's address from the route towards a public one (a UDP connect, nothing sent);
            # with this route that is the veth, whose far end is the other namespace and nothing else.
            ("-n", namespace, "route", "add", "default", "dev", end),
        ]
    for step in steps:
        result = _ip(*step)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(step)}: {result.stderr.strip()}")


@pytest.fixture(scope="module")
def two_hosts():
    reason = _why_no_namespaces()
    if reason is not None:
        print(f"skipping the multi-host tests: {reason}")
        pytest.skip(reason)
    _delete_hosts()
    try:
        _make_hosts()
        yield HOSTS
    finally:
        _delete_hosts()


@pytest.fixture(scope="module")
def overrides(corpus_jsonl, tmp_path_factory):
    """The params both nodes and the one-process reference train with; the dataset prepared once, first."""
    out = tmp_path_factory.mktemp("multihost")
    values = [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={out / 'data'}",
        f"train.output_dir={out / 'train'}", *SMALL_MODEL, f"train.steps={STEPS}", "train.log_interval=1",
        "train.eval_interval=1000", "train.checkpoint_interval=1000", "train.micro_batch_size=2",
        "optimizer.warmup_steps=2",
    ]
    params = load_params("tiny", values)
    prepare_dataset(params.data, params.tokenizer, params.model)
    return values


def _node(
    host: tuple[str, str, str], node_rank: int, overrides: list[str], metrics: Path, *options: str
) -> subprocess.Popen:
    settings = [item for value in overrides for item in ("--set", value)]
    command = [
        "ip", "netns", "exec", host[0], sys.executable, "-m", "flows.cli", "train", "--params", "tiny", *settings,
        "--nodes", "2", "--node-rank", str(node_rank), "--master-addr", HOSTS[0][2],
        "--master-port", str(MASTER_PORT), "--metrics-jsonl", str(metrics), *options,
    ]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_on_both(hosts, overrides: list[str], out: Path, *options: str) -> list[str]:
    """Both node ranks of one job, each in its host; their console output. Both must succeed."""
    out.mkdir(parents=True, exist_ok=True)
    nodes = [_node(host, rank, overrides, out / f"node{rank}.jsonl", *options) for rank, host in enumerate(hosts)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank} exited {node.returncode}:\n{output[-3000:]}"
        assert "[INFO]" not in output, f"node {rank} printed MindSpore INFO lines:\n{output[-3000:]}"
    return outputs


def _assert_equals_one_process(out: Path, overrides: list[str], micro_batches: int) -> None:
    """Rank 0's losses and gradient norms against one process on the same global batch."""
    across = [json.loads(line) for line in (out / "node0.jsonl").read_text().splitlines()]
    one = [*overrides, f"parallel.micro_batches={micro_batches}", f"train.output_dir={out / 'one'}"]
    reference = load_params("tiny", one)
    expected = Trainer(reference, _dataset(reference), out / "one" / "ckpt").run().history
    assert [record["step"] for record in across] == [record["step"] for record in expected] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in across], [r[key] for r in expected], rtol=1e-5, err_msg=key)


@pytest.mark.extended  # two hosts equal one process in the tp2 x pp2 test below, which runs by default
def test_dp2_across_two_hosts_equals_one_process(two_hosts, overrides, tmp_path):
    outputs = _run_on_both(two_hosts, [*overrides, "parallel.data_parallel=2"], tmp_path)
    summaries = ("trained", "rank", "node")
    first, second = ([line for line in output.splitlines() if line.startswith(summaries)] for output in outputs)
    assert first[0].startswith(f"trained {STEPS} steps") and "; checkpoint /" in first[0]
    assert second[0].startswith(f"rank 1: trained {STEPS} steps") and "rank 0 writes the checkpoints to" in second[0]
    assert second[-1].startswith("node 1 of 2: ranks 1-1 finished; their logs are") and "None" not in outputs[1]
    _assert_equals_one_process(tmp_path, overrides, micro_batches=2)


@pytest.mark.extended  # ~70 s; tp2 x pp2 equals one process in tests/test_pipeline_msrun.py by default
def test_tp2_pp2_on_two_hosts_keeps_each_tp_group_in_one_host_and_equals_one_process(two_hosts, overrides, tmp_path):
    """Two ranks a host: ranks 0-1 (stage 0's tp pair) on the first, 2-3 (stage 1's) on the second, so only the
    pipeline's messages cross between the hosts."""
    layout = ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "parallel.micro_batches=4"]
    outputs = _run_on_both(two_hosts, [*overrides, *layout, f"train.output_dir={tmp_path / 'train'}"], tmp_path)
    assert outputs[1].splitlines()[-1].startswith("node 1 of 2: ranks 2-3 finished")
    placed = Layout(tp=2, pp=2)
    assert [placed.tp_group(rank) for rank in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [placed.coordinates(rank).pp for rank in range(4)] == [0, 0, 1, 1]
    (logs,) = (tmp_path / "train").glob("pretrain-*/logs")
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):  # msrun names the ranks each node started
        started = (logs / f"msrun-node{node}.log").read_text()
        assert all(f"rank id:{rank}," in started for rank in ranks), started[-2000:]
    _assert_equals_one_process(tmp_path, overrides, micro_batches=4)


def _dataset(params) -> Path:
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


def test_killing_the_second_host_fails_the_first_within_30_s_and_both_resume_bit_exactly(two_hosts, overrides, tmp_path):
    """Everything in the second host is killed once the job has checkpointed; node 0 stops when MindSpore's
    scheduler misses the lost node's heartbeats for --node-timeout (10 s here), with one line naming the
    rank, its node and that node's host. Both nodes then rerun the same command with --resume auto: the job
    continues from the last checkpoint and repeats an uninterrupted job's steps and weights to the bit."""
    job = [*overrides, "parallel.data_parallel=2", "train.steps=40", "train.checkpoint_interval=5"]
    killed = [*job, f"train.output_dir={tmp_path / 'train'}"]
    # 10 s rather than the default 15: the scheduler's own check adds up to as much again on busy cores, and
    # this job has two ranks only, so a live rank's heartbeats are not late.
    nodes = [
        _node(host, rank, killed, tmp_path / f"killed{rank}.jsonl", "--node-timeout", "10")
        for rank, host in enumerate(two_hosts)
    ]
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "train").glob("pretrain-*/step-00000005")):
            assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "no checkpoint"
            time.sleep(0.1)
        _kill_everything_in(two_hosts[1][0])
        killed_at = time.monotonic()
        output = nodes[0].communicate(timeout=180)[0]
        waited = time.monotonic() - killed_at
    finally:
        for node in nodes:
            node.kill()
    print(f"node 0 stopped {waited:.1f} s after the second host's processes were killed")
    assert nodes[0].returncode == 1, output[-3000:]
    # Rank 0's own log streams to the console as it is written: when its all-reduce fails before the scheduler
    # gives up on the lost node, its own "llmflow train: RuntimeError" line comes first. The launcher's reason
    # is the last line, with no traceback of the launcher's own.
    reasons = [line for line in output.splitlines() if line.startswith("llmflow train: ")]
    second_host = f"rank 1 on node 1 (host {os.uname().nodename}, {two_hosts[1][2]}) stopped answering"
    assert reasons and reasons[-1].startswith(f"llmflow train: {second_host}"), output[-3000:]
    assert "Traceback" not in output[output.index(reasons[-1]) :] and waited < 30

    resumed = _run_on_both(two_hosts, killed, tmp_path / "resumed", "--resume", "auto")
    (summary,) = [line for line in resumed[0].splitlines() if line.startswith("trained ")]
    start = int(summary.split("(resumed from ")[1].split("step-")[1][:8])
    assert summary.startswith("trained 40 steps") and 5 <= start < 40, summary
    _run_on_both(two_hosts, [*job, f"train.output_dir={tmp_path / 'whole'}"], tmp_path / "whole")
    keys = ("step", "loss", "grad_norm", "lr")
    again, whole = ([json.loads(line) for line in (tmp_path / run / "node0.jsonl").read_text().splitlines()]
                    for run in ("resumed", "whole"))
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in whole if r["step"] > start]
    (last,), (uninterrupted,) = ((tmp_path / run).glob("pretrain-*/step-00000040") for run in ("train", "whole"))
    weights, expected = (load_file(str(directory / "model.safetensors")) for directory in (last, uninterrupted))
    assert weights.keys() == expected.keys()
    assert all(np.array_equal(weights[name], expected[name]) for name in expected)


def _in(host: tuple[str, str, str], *command: str, env: dict[str, str], **popen) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", host[0], *command], cwd=REPO, env={**os.environ, **env}, **popen)


def _wait_until_served(host: tuple[str, str, str], url: str, seconds: float = 180) -> None:
    probe = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2)"
    deadline = time.monotonic() + seconds
    while _in(host, sys.executable, "-c", probe, env={}, stderr=subprocess.DEVNULL).wait() != 0:
        assert time.monotonic() < deadline, f"nothing answered at {url} in {seconds:.0f} s"
        time.sleep(1)


@pytest.mark.extended  # a two-node local Ray cluster writes the same manifest in tests/test_data_runners.py by default
def test_prep_on_a_ray_cluster_across_two_hosts_writes_the_local_runs_manifest(two_hosts, tmp_path):
    """A Ray head and a Prefect server in the first host, a Ray worker in the second: `llmflow prep` with
    data.runner=ray sends its map steps to both hosts (data on the shared filesystem, task runs reporting to
    the server every node can reach) and writes the manifest byte for byte as one local worker does."""
    (first, _, head), (_, _, worker) = two_hosts
    documents = docstring_documents()
    corpus = []
    for number, texts in enumerate((documents[::2], documents[1::2])):
        corpus.append(tmp_path / f"part-{number}.jsonl")
        corpus[-1].write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    paths = ", ".join(f"'{path}'" for path in corpus)
    prep = [
        f"data.sources=[{{kind: jsonl, paths: [{paths}]}}]", "data.shard_bytes=8192", "data.rows_per_shard=64",
        "model.vocab_size=512", "model.seq_len=32", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    quiet = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    # Every node and the driver share one token: Ray refuses a node that joins without the head's.
    ray_token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    api = f"http://{head}:4200/api"
    server = _in(
        two_hosts[0], "prefect", "server", "start", "--host", head, "--port", "4200",
        env={**quiet, "PREFECT_HOME": str(tmp_path / "prefect")}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        ray = ["ray", "start", "--num-cpus=1", "--disable-usage-stats"]
        for host, options in ((two_hosts[0], ["--head", "--port=6379", "--include-dashboard=false"]),
                              (two_hosts[1], [f"--address={head}:6379"])):
            started = _in(host, *ray, *options, f"--node-ip-address={host[2]}", f"--temp-dir=/tmp/llmflow-ray-{host[0]}",
                          env={**quiet, **ray_token}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert started.wait(timeout=180) == 0, started.stdout.read()[-3000:]
        _wait_until_served(two_hosts[0], f"{api}/health")
        on_ray = [*prep, f"data.output_dir={tmp_path / 'ray'}", "data.runner=ray", f"data.ray_address={head}:6379"]
        settings = [item for value in on_ray for item in ("--set", value)]
        command = _in(two_hosts[0], sys.executable, "-m", "flows.cli", "prep", "--params", "tiny", *settings,
                      env={**quiet, **ray_token, "PREFECT_API_URL": api}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = command.communicate(timeout=600)[0]
        assert command.returncode == 0, output[-3000:]
        # Ray starts a worker process on a node only for work sent there: the second host's log directory shows one.
        assert list(Path(f"/tmp/llmflow-ray-{two_hosts[1][0]}").glob("session_latest/logs/worker-*.out")), worker
    finally:
        server.kill()
        for host in two_hosts:
            _kill_everything_in(host[0])
        for host in two_hosts:
            shutil.rmtree(f"/tmp/llmflow-ray-{host[0]}", ignore_errors=True)
    local = load_params("tiny", [*prep, f"data.output_dir={tmp_path / 'local'}", "data.num_workers=1"])
    expected = prepare_dataset(local.data, local.tokenizer, local.model).output_dir / "manifest.json"
    (manifest,) = (tmp_path / "ray").glob("*/manifest.json")
    assert json.loads((manifest.parent / "prep_report.json").read_text())["reuse"]["input_shards"] >= 4
    assert manifest.read_bytes() == expected.read_bytes()
