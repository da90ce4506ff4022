"""`llmflow run`: the whole pipeline, pretrain-flow, in this process."""

from __future__ import annotations

import argparse

from flows.commands.common import add_params_arguments, load
from params.rules import check_run


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="run pretrain-flow, the whole pipeline (data prep and the stages after it)",
        description="Run pretrain-flow in this process on Prefect's temporary local API, tracked in MLflow.",
    )
    add_params_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from flows.pretrain import pretrain_flow
    from tasks.reachability import check_services

    params = load(args)
    check_run(params, finetunes=params.lora.enabled)  # before Prefect starts, as the flow's first line does again
    check_services(params)
    result = pretrain_flow(params)
    print(f"pipeline finished: MLflow run {result.mlflow_run_id}, dataset {result.data.dataset_dir}")
    from tasks.tracking import tracking_uri

    print(f"browse it with: mlflow ui --backend-store-uri {tracking_uri(params)}")
    return 0
