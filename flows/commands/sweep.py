"""`llmflow sweep`: sweep-flow, one pipeline run per trial."""

from __future__ import annotations

import argparse
import json


def register(commands: argparse._SubParsersAction) -> None:
    sweeper = commands.add_parser(
        "sweep",
        help="run sweep-flow: one pipeline run per trial of a sweep file, the best trial tagged",
        description="Run pretrain-flow once per trial of SWEEP_FILE (a grid or random search over params fields; "
        "params/sweeps/lr_tiny.yaml is an example), each stopped early by the smoke gate when it cannot learn, "
        "all under one MLflow sweep run with the comparison table; the trial best by the sweep's metric is tagged "
        "llmflow.best_trial=true.",
    )
    sweeper.add_argument("sweep_file", metavar="SWEEP_FILE", help="the sweep YAML file")
    shown = sweeper.add_mutually_exclusive_group()
    shown.add_argument("--dry-run", action="store_true", help="list the trials and stop")
    shown.add_argument(
        "--deployment-params", action="store_true",
        help="print the sweep as JSON for `prefect deployment run 'sweep-flow/lr-sweep' --params` and stop",
    )
    sweeper.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from params.sweep import load_sweep

    sweep = load_sweep(args.sweep_file)
    if args.dry_run:
        print(f"sweep {sweep.name}: {sweep.method}, ranked by {sweep.metric} ({sweep.goal}); base {sweep.params}")
        for trial in sweep.trial_list():
            print(f"trial {trial.number}: {trial.label()}")
        return 0
    if args.deployment_params:  # the --params value of `prefect deployment run 'sweep-flow/...'`
        print(json.dumps({"sweep": sweep.model_dump(mode="json")}))
        return 0
    from flows.sweep import sweep_flow
    from tasks.reachability import check_services

    check_services(sweep.trial_list()[0].params)  # the base params: the sweep's own run goes where its trials' do
    record = sweep_flow(sweep)
    print(f"sweep finished: MLflow run {record.sweep_run_id}; best trial {record.best.number} ({record.best.label})")
    return 0
