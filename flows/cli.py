"""The `llmflow` command line: run the pipeline or one stage from a params preset or file.

Every command takes `--params NAME_OR_FILE` (default: the `tiny` preset) and any number of
`--set section.field=value` overrides. Bad params exit with status 2 and a message naming the
file, line and field; a failed stage exits with status 1 and its reason (LLMFLOW_DEBUG=1 shows
the traceback too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from params import ParamsError, PipelineParams, load_params, preset_names, to_yaml


def _quiet_prefect_defaults() -> None:
    # Prefect's temporary local API otherwise prints a harmless analytics traceback.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _add_params_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        default="tiny",
        metavar="NAME_OR_FILE",
        help=f"a preset ({', '.join(preset_names())}) or a YAML file; default: tiny",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field, e.g. --set train.steps=50 (repeatable; values are YAML)",
    )


def _cmd_run(params: PipelineParams, args: argparse.Namespace) -> int:
    from flows.pretrain import pretrain_flow

    result = pretrain_flow(params)
    print(f"pipeline finished: MLflow run {result.mlflow_run_id}, dataset {result.data.dataset_dir}")
    from tasks.tracking import tracking_uri

    print(f"browse it with: mlflow ui --backend-store-uri {tracking_uri(params)}")
    return 0


def _cmd_prep(params: PipelineParams, args: argparse.Namespace) -> int:
    from flows.data_prep import data_prep_flow

    result = data_prep_flow(params)
    state = "reused" if result.reused else "prepared"
    print(f"{state} dataset {result.dataset_dir} (manifest {result.manifest_path})")
    return 0


def _cmd_train(params: PipelineParams, args: argparse.Namespace) -> int:
    from model_core.data import prepare_dataset
    from model_core.train.callbacks import fan_out, jsonl_writer
    from model_core.train.checkpoint import run_directory
    from model_core.train.trainer import Trainer
    from params import params_hash
    from tasks.progress import PhaseProgress, TrainingProgress

    preparing = PhaseProgress("data prep")
    dataset = prepare_dataset(params.data, params.tokenizer, params.model, progress=preparing)
    preparing.close()
    checkpoints = args.checkpoint_dir or run_directory(
        params.train.output_dir, params.name, params_hash(params), dataset.output_dir, "pretrain"
    )
    trainer = Trainer(params, dataset.output_dir, checkpoints)
    bar = TrainingProgress(trainer.steps)
    jsonl = jsonl_writer(args.metrics_jsonl) if args.metrics_jsonl else None
    try:
        result = trainer.run(on_metrics=fan_out(bar, jsonl), resume=args.resume)
    finally:
        bar.close()
    resumed = f" (resumed from {result.resumed_from})" if result.resumed_from else ""
    print(
        f"trained {result.steps} steps{resumed}: loss {result.initial_loss:.4f} -> {result.final_loss:.4f}, "
        f"{result.skipped_steps} skipped; checkpoint {result.checkpoint}"
    )
    return 0


def _cmd_params_show(params: PipelineParams, args: argparse.Namespace) -> int:
    if args.format == "json":
        print(params.model_dump_json(indent=2))
    elif args.format == "deployment":  # the --params value of `prefect deployment run`
        print(json.dumps({"params": params.model_dump(mode="json")}))
    elif args.format == "schema":
        print(json.dumps(PipelineParams.model_json_schema(), indent=2))
    else:
        print(to_yaml(params), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmflow",
        description="Declarative LLM pretraining and fine-tuning on MindSpore, orchestrated by Prefect, "
        "tracked in MLflow.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run pretrain-flow, the whole pipeline (data prep and the stages after it)",
        description="Run pretrain-flow in this process on Prefect's temporary local API, tracked in MLflow.",
    )
    _add_params_arguments(run)
    run.set_defaults(handler=_cmd_run)

    prep = commands.add_parser(
        "prep",
        help="run data-prep-flow: clean, deduplicate, tokenize and shard the corpus",
        description="Prepare (or reuse) the token shards the params describe, tracked in MLflow.",
    )
    _add_params_arguments(prep)
    prep.set_defaults(handler=_cmd_prep)

    train = commands.add_parser(
        "train",
        help="train the model on the prepared data (no Prefect/MLflow), with a progress bar",
        description="Prepare (or reuse) the data, then train for train.steps optimizer steps, checkpointing "
        "every train.checkpoint_interval steps.",
    )
    _add_params_arguments(train)
    train.add_argument(
        "--resume",
        default="none",
        metavar="auto|none|DIR",
        help="auto: continue from the newest valid checkpoint of this run (corrupted ones are skipped); "
        "none: start fresh (default); or a checkpoint directory",
    )
    train.add_argument("--metrics-jsonl", metavar="PATH", help="append every logged metrics record to PATH as JSON lines")
    train.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where checkpoints go (default: train.output_dir/<name>-<params hash>-<dataset key>/pretrain, "
        "the directory pretrain-flow's pretrain stage uses)",
    )
    train.set_defaults(handler=_cmd_train)

    params_cmd = commands.add_parser("params", help="inspect params", description="Inspect params.")
    params_sub = params_cmd.add_subparsers(dest="params_command", required=True, metavar="ACTION")
    show = params_sub.add_parser(
        "show",
        help="print the resolved params (preset + file + overrides, validated)",
        description="Print the resolved, validated params, or the JSON schema of every field.",
    )
    _add_params_arguments(show)
    show.add_argument(
        "--format",
        choices=["yaml", "json", "deployment", "schema"],
        default="yaml",
        help="yaml or json params; deployment: JSON for `prefect deployment run --params`; schema: JSON schema",
    )
    show.set_defaults(handler=_cmd_params_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[PipelineParams, argparse.Namespace], int] = args.handler
    try:
        params = load_params(args.params, args.overrides)
    except ParamsError as error:
        print(f"llmflow: {error}", file=sys.stderr)
        return 2
    _quiet_prefect_defaults()
    try:
        return handler(params, args)
    except (ValueError, ArithmeticError) as error:  # bad input or a diverged run, found by a stage
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        print(f"llmflow {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
