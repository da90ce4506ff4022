"""`llmflow doctor RUN_ID|DIR`: say what kind of trouble a training run is in (out of memory, a hang or silent
node, divergence, non-finite steps, loss spikes, a plateau, or none) and rank its likely causes, each with its
evidence and the param that changes it. README 'Troubleshooting' maps each symptom to what it prints."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="diagnose a training run that will not learn, diverges, hangs or died: kind of trouble, ranked causes",
        description="Read a training run's params, metrics (loss, validation loss, gradient norm, loss scale, skipped "
        "steps, tokens/s), dataset health, logs and rank heartbeats; say what kind of trouble it shows and rank the "
        "likely causes, each with its evidence and the param that changes it. RUN is a training run directory "
        "(train.output_dir/pretrain-<key>, smoke-<key>, or llmflow train --checkpoint-dir) or an MLflow run id (a "
        "pipeline run: its failed or last training stage; or one stage's run).",
    )
    doctor.add_argument("run", metavar="RUN_ID|DIR", help="an MLflow run id or a training run directory")
    doctor.add_argument(
        "--params", metavar="NAME_OR_FILE",
        help="the run's params (default: the params file in the run directory, or the MLflow run's params.yaml)",
    )
    doctor.add_argument("--metrics", metavar="JSONL", type=Path, help="the run's --metrics-jsonl file")
    doctor.add_argument(
        "--log", dest="logs", action="append", default=[], type=Path, metavar="FILE",
        help="a log of the run, e.g. its console output (repeatable; a directory's logs/ are read anyway)",
    )
    doctor.add_argument("--dataset", metavar="DIR", type=Path, help="the prepared dataset the run trained on")
    doctor.add_argument("--format", choices=["text", "json"], default="text")
    doctor.add_argument(
        "--tracking-uri", help="the MLflow store for a run id (default: MLFLOW_TRACKING_URI, else tracking.uri of "
        "--params or the tiny preset)",
    )
    doctor.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from params import load_params
    from tasks.doctor import diagnose_target
    from tasks.tracking import tracking_uri

    params = load_params(args.params) if args.params else None
    uri = args.tracking_uri or tracking_uri(params or load_params("tiny"))
    report, source = diagnose_target(args.run, uri, params, args.metrics, args.logs, args.dataset)
    if args.format == "json":
        print(report.to_json())
    else:
        print(f"llmflow doctor: {source}\n{report.text()}")
    return 0
