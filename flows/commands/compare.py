"""`llmflow compare`: pipeline runs side by side from MLflow."""

from __future__ import annotations

import argparse

from flows.commands.common import add_params_arguments, load


def register(commands: argparse._SubParsersAction) -> None:
    comparer = commands.add_parser(
        "compare",
        help="pipeline runs side by side: the params that differ, headline metrics, loss curves, MLflow links",
        description="Compare pipeline runs recorded in MLflow: the params that differ between them, their "
        "headline metrics (final and best loss, validation loss, perplexities, tokens/s, MFU, wall time), an "
        "overlay of their pretraining loss curves, and where to open each in MLflow's UI.",
    )
    add_params_arguments(comparer)
    comparer.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="parent (pipeline) run ids to compare")
    comparer.add_argument(
        "--experiment", help="without run ids: the experiment whose last finished pipeline runs are compared "
        "(default: tracking.experiment of --params, where the pipeline records them)",
    )
    comparer.add_argument("--last", type=int, metavar="N", help="without run ids: how many of them (default 2)")
    comparer.add_argument("--format", choices=["table", "markdown", "json"], default="table")
    comparer.add_argument("--plot", default="compare-loss.png", metavar="PNG", help="where the loss overlay goes")
    comparer.add_argument(
        "--tracking-uri", help="the MLflow store (default: MLFLOW_TRACKING_URI, else tracking.uri of --params)"
    )
    comparer.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tasks.compare import compare, render, write_loss_overlay
    from tasks.tracking import tracking_uri

    if args.run_ids and (args.experiment or args.last is not None):
        raise ValueError("give run ids, or --experiment/--last to take an experiment's latest runs, not both")
    if args.last is not None and args.last < 2:
        raise ValueError(f"--last {args.last}: a comparison needs at least 2 runs")
    params = load(args)
    uri = args.tracking_uri or tracking_uri(params)
    experiment = None if args.run_ids else args.experiment or params.tracking.experiment  # where the pipeline logs
    comparison = compare(uri, args.run_ids, experiment, 2 if args.last is None else args.last)
    print(render(comparison, uri, args.format))
    if args.format != "json":
        written = write_loss_overlay(comparison, args.plot)
        print(f"pretraining loss curves: {written}" if written else "no pretraining loss history to plot")
    return 0
