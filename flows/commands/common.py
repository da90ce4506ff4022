"""What several commands share: the --params/--set arguments, the params they resolve to, and the pretraining
dataset the stages after data prep read."""

from __future__ import annotations

import argparse
import sys

from params import PipelineParams, load_params, preset_names


def add_params_arguments(parser: argparse.ArgumentParser) -> None:
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


def load(args: argparse.Namespace) -> PipelineParams:
    return load_params(args.params, args.overrides)


def show_warnings(warnings: list[str]) -> None:
    """The run's warnings from params/rules.py `check_run`, on stderr, by the command that starts the run (its
    msrun ranks run the command again, and leave them to it)."""
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


def prepared_pretraining_data(params: PipelineParams):
    """The pretraining dataset (prepared or reused): later stages take its tokenizer and validation split.
    Prepared in this process, or, with data.runner=ray, by data-prep-flow on the Ray cluster."""
    from model_core.data import prepare_dataset
    from model_core.data.prepare import prepared
    from tasks.progress import PhaseProgress

    if params.data.runner == "ray":
        from flows.data_prep import data_prep_flow
        from tasks.reachability import check_services

        check_services(params)
        result = data_prep_flow(params)
        return prepared(result.dataset_dir, result.reused)
    preparing = PhaseProgress("data prep")
    try:
        return prepare_dataset(params.data, params.tokenizer, params.model, progress=preparing)
    finally:
        preparing.close()
