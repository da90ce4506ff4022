"""Shared fixtures: a small real corpus and the dataset prepared from it, the single-process training run the
multi-process tests compare against, an isolated MLflow store, and one Prefect test harness per session. Each is
made once per session, however many test files ask for it."""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# Fixtures whose one launch or run several test files read: under pytest-xdist those files must run in one worker, or
# each worker would launch the jobs (or train the reference) again.
SHARED_LAUNCHES = ("two_worker_jobs", "four_worker_jobs", "single_process")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (README's `-n 2`; `--dist loadgroup` in pyproject), put each test module in one group,
    so that its module fixtures (a pretrained model, a Ray cluster) are made once, and every module that reads the
    shared msrun launches or the single-process reference in one group together. A worker takes a whole group and the next when it is nearly
    done, so the groups go out longest first: the shared launches, then modules by their count of slow tests."""
    if not hasattr(config, "workerinput"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.module.__name__, []).append(item)
    groups: dict[str, list] = {}
    for name, module_items in modules.items():
        shared = any(set(SHARED_LAUNCHES) & set(item.fixturenames) for item in module_items) or any(
            hasattr(item.module, "shared_or_own_job") for item in module_items)  # reads them through getfixturevalue
        groups.setdefault("shared msrun launches" if shared else name, []).extend(module_items)
    for group, group_items in groups.items():
        for item in group_items:
            item.add_marker(pytest.mark.xdist_group(group))

    def weight(group: str) -> tuple[bool, int]:
        slow = [item for item in groups[group] if item.get_closest_marker("slow") and not item.get_closest_marker("extended")]
        return group != "shared msrun launches", -len(slow)

    items[:] = [item for group in sorted(groups, key=weight) for item in groups[group]]


# Modules whose docstrings make a small, real, human-written corpus (a few hundred KB).
CORPUS_MODULES = ("argparse", "textwrap", "json", "pathlib", "functools", "collections", "csv", "string")


def docstring_documents() -> list[str]:
    """Docstrings of a few standard-library modules and their members, in a fixed order."""
    import importlib

    documents = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        for _, member in [("", module), *sorted(vars(module).items())]:
            doc = inspect.getdoc(member) if (inspect.ismodule(member) or inspect.isclass(member) or inspect.isfunction(member)) else None
            if doc and len(doc) >= 80 and doc not in documents:
                documents.append(doc)
    return documents


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for text in docstring_documents():
            handle.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One SQLite store for the session (creating one costs seconds); tests use distinct experiments."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return uri


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@contextmanager
def prefect_run_logs() -> Iterator[list[str]]:
    """The messages flow and task runs log while the block runs: what a person sees on the console, prints of
    `log_prints` flows and tasks included. Read at the loggers, because Prefect configures logging and binds its
    console handler to a stream once per process, so neither pytest's stream capture nor its root-level log
    capture sees these reliably in every test order."""
    messages: list[str] = []
    recorder = _Recorder(messages)
    loggers = [logging.getLogger(name) for name in ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(recorder)
    try:
        yield messages
    finally:
        for logger in loggers:
            logger.removeHandler(recorder)


class _Recorder(logging.Handler):
    def __init__(self, messages: list[str]):
        super().__init__()
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


SMALL_MODEL = [
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=128",
    "model.seq_len=32",
]


# The training run the msrun tests repeat under each layout: 20 steps of the small model, logged every step.
PARALLEL_STEPS = 20
PARALLEL_RUN = [
    *SMALL_MODEL, "train.log_interval=1", "train.eval_interval=10", "train.checkpoint_interval=10",
    f"train.steps={PARALLEL_STEPS}", "optimizer.warmup_steps=2", "train.micro_batch_size=2",
]


@pytest.fixture(scope="session")
def dataset_dir(corpus_jsonl, tmp_path_factory) -> Path:
    """The corpus prepared for SMALL_MODEL (tokenizer, train and validation shards); tests only read it."""
    from model_core.data import prepare_dataset
    from params import load_params

    out = tmp_path_factory.mktemp("small-data")
    params = load_params("tiny", [f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={out}", *SMALL_MODEL])
    return prepare_dataset(params.data, params.tokenizer, params.model).output_dir


@pytest.fixture(scope="session")
def single_process(dataset_dir, tmp_path_factory) -> dict:
    """The reference of the msrun tests: PARALLEL_RUN in one process, the same global batch of 8 rows
    (4 micro-batches of 2); its metrics, Adam moment and parameter bytes, initial and final weights and
    checkpoint directory (steps 10 and 20)."""
    from model_core.model.weights import model_weights
    from model_core.train.trainer import Trainer
    from params import load_params

    out = tmp_path_factory.mktemp("single")
    params = load_params("tiny", [*PARALLEL_RUN, "parallel.micro_batches=4", f"train.output_dir={out}"])
    trainer = Trainer(params, dataset_dir, out / "ckpt")
    initial = model_weights(trainer.model)
    history = trainer.run().history
    moments = sum(m.asnumpy().nbytes for m in (*trainer.optimizer.exp_avg, *trainer.optimizer.exp_avg_sq))
    final = model_weights(trainer.model)
    return {
        "history": history, "moment_bytes": moments, "parameter_bytes": sum(w.nbytes for w in final.values()),
        "initial": initial, "final": final, "checkpoints": out / "ckpt",
    }


# Jobs of PARALLEL_RUN + overrides on two and on four msrun workers, name -> overrides, that test files register
# when they are imported and read back from `two_worker_jobs` and `four_worker_jobs`: each set runs one job after
# another in one launch, whose start-up each job would otherwise pay.
TWO_WORKER_JOBS: dict[str, tuple[str, ...]] = {}
FOUR_WORKER_JOBS: dict[str, tuple[str, ...]] = {}


@contextmanager
def workers_temp_dir(directory: Path) -> Iterator[Path]:
    """TMPDIR for the processes started in the block: `directory`, where a test finds what they left there."""
    directory.mkdir()
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(directory)
    try:
        yield directory
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before


@pytest.fixture(scope="session")
def two_worker_jobs(dataset_dir, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """name -> (the job's directory, each rank's report) for every job in TWO_WORKER_JOBS. The workers' temporary
    directory is `tmp` beside the jobs' directories (what the offload test reads)."""
    from test_parallel_msrun import train_jobs

    root = tmp_path_factory.mktemp("two-worker-jobs")
    with workers_temp_dir(root / "tmp"):
        return train_jobs(root, dataset_dir, dict(TWO_WORKER_JOBS))


@pytest.fixture(scope="session")
def four_worker_jobs(dataset_dir, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """name -> (the job's directory, each rank's report) for every job in FOUR_WORKER_JOBS."""
    from test_parallel_msrun import train_jobs

    return train_jobs(tmp_path_factory.mktemp("four-worker-jobs"), dataset_dir, dict(FOUR_WORKER_JOBS), workers=4)


def small_pipeline_overrides(corpus: Path, output_dir: Path, experiment: str) -> list[str]:
    """The tiny preset shrunk to seconds: a small corpus, a 512-token vocabulary, a 2-layer model, short runs."""
    return [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus}']}}]",
        f"data.output_dir={output_dir}",
        "data.rows_per_shard=64",
        *SMALL_MODEL,
        "optimizer.warmup_steps=5",
        "smoke.steps=40",
        "smoke.min_loss_drop=0.3",
        "train.steps=20",
        "train.log_interval=5",
        "train.eval_interval=10",
        "train.eval_batches=2",
        "train.checkpoint_interval=10",
        f"train.output_dir={output_dir.parent / 'train'}",
        "lora.enabled=false",
        "eval.batches=2",
        "eval.max_new_tokens=4",
        "eval.prompts=['Return the number of']",  # the default instruction prompt is longer than 32 tokens
        f"tracking.experiment={experiment}",
    ]
