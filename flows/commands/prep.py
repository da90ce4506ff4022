"""`llmflow prep`: data-prep-flow alone."""

from __future__ import annotations

import argparse

from flows.commands.common import add_params_arguments, load


def register(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser(
        "prep",
        help="run data-prep-flow: clean, deduplicate, tokenize and shard the corpus",
        description="Prepare (or reuse) the token shards the params describe, tracked in MLflow.",
    )
    add_params_arguments(prep)
    prep.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from flows.data_prep import data_prep_flow
    from tasks.reachability import check_services

    params = load(args)
    check_services(params)
    result = data_prep_flow(params)
    state = "reused" if result.reused else "prepared"
    print(f"{state} dataset {result.dataset_dir} (manifest {result.manifest_path})")
    return 0
