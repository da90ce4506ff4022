"""`llmflow params show`: the resolved params, or their schema."""

from __future__ import annotations

import argparse
import json

from flows.commands.common import add_params_arguments, load
from params import PipelineParams, to_yaml


def register(commands: argparse._SubParsersAction) -> None:
    params_cmd = commands.add_parser("params", help="inspect params", description="Inspect params.")
    params_sub = params_cmd.add_subparsers(dest="params_command", required=True, metavar="ACTION")
    show = params_sub.add_parser(
        "show",
        help="print the resolved params (preset + file + overrides, validated)",
        description="Print the resolved, validated params, or the JSON schema of every field.",
    )
    add_params_arguments(show)
    show.add_argument(
        "--format",
        choices=["yaml", "json", "deployment", "schema"],
        default="yaml",
        help="yaml or json params; deployment: JSON for `prefect deployment run --params`; schema: JSON schema",
    )
    show.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    params = load(args)
    if args.format == "json":
        print(params.model_dump_json(indent=2))
    elif args.format == "deployment":  # the --params value of `prefect deployment run`
        print(json.dumps({"params": params.model_dump(mode="json")}))
    elif args.format == "schema":
        print(json.dumps(PipelineParams.model_json_schema(), indent=2))
    else:
        print(to_yaml(params), end="")
    return 0
