"""Shared fixtures: a small real corpus, an isolated MLflow store, and one Prefect test harness per session."""

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
