"""`llmflow plan`: per-rank memory of every layout, a recommendation, layout trials and OOM explanations."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows.commands.common import add_params_arguments, load, prepared_pretraining_data
from params import PipelineParams

if TYPE_CHECKING:
    from model_core.parallel.planner import Plan


def register(commands: argparse._SubParsersAction) -> None:
    planner = commands.add_parser(
        "plan",
        help="estimate per-rank memory of every valid layout and recommend one",
        description="Estimate per-rank bytes (parameters, gradients, optimizer state, activations with and without "
        "recompute, communication buffers) for every dp x tp x pp x ZeRO layout of --devices, and recommend "
        "one: data parallel with ZeRO stages 1, 2, 3, then recompute, then tensor parallel inside a node, pipeline "
        "stages, offload last. "
        "See docs/planner.md.",
    )
    add_params_arguments(planner)
    planner.add_argument(
        "--devices", type=int,
        help="number of devices (ranks); required unless --explain-oom (with --try: default the params' world size)",
    )
    planner.add_argument("--device-memory", metavar="BYTES", help="memory per device, e.g. 64GiB, 80GB")
    planner.add_argument("--devices-per-node", type=int, default=8, help="devices per node; tp stays inside one")
    planner.add_argument(
        "--device-kind", choices=["accelerator", "cpu"], default="accelerator",
        help="accelerator: counted tensors; cpu: calibrated to measured host RSS",
    )
    planner.add_argument(
        "--runtime-reserve", metavar="BYTES", help="memory the device runtime keeps for itself (default: 0 on "
        "accelerators, the measured MindSpore baseline on cpu)",
    )
    planner.add_argument(
        "--offload-bandwidth", metavar="BYTES", help="bytes per second offloaded optimizer state moves at (default: "
        "25GB, PCIe 4.0 x16, for accelerators; 2GB, a local NVMe drive, for cpu)",
    )
    planner.add_argument(
        "--explain-oom", metavar="LOG", help="instead of planning: read a failed run's log (a worker log or the "
        "console output) and say in which phase memory ran out and what to change",
    )
    planner.add_argument("--metrics", metavar="JSONL", help="with --explain-oom: the run's --metrics-jsonl file")
    planner.add_argument(
        "--try", dest="try_steps", type=int, metavar="STEPS",
        help="run each (dp, tp, pp) that fits for STEPS steps under msrun on this machine (--devices defaults to the "
        "params' world size, --device-memory to this machine's memory over the devices) and print their measured "
        "tokens/s and peak memory; see README 'Layout trials'",
    )
    planner.add_argument("--write", metavar="PATH", help="with --try: write the params of the fastest layout to PATH")
    planner.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.parallel.planner import format_plan_table, parse_bytes, plan

    if args.explain_oom:
        return _explain_oom(args.explain_oom, args.metrics)
    if args.write and args.try_steps is None:
        raise ValueError("--write PATH goes with --try STEPS (it writes the fastest layout the trials measured)")
    if args.try_steps is not None and args.try_steps < 2:
        raise ValueError(f"--try {args.try_steps}: a trial needs at least 2 steps (the first compiles; speed is measured after it)")
    params = load(args)
    devices, memory = args.devices, args.device_memory
    if args.try_steps is not None:  # the trials run here: this machine's devices, its memory shared by its ranks
        import psutil

        devices = devices or params.parallel.world_size
        memory = memory or str(psutil.virtual_memory().total // devices)
    if devices is None or memory is None:
        raise ValueError("--devices and --device-memory are required (or --explain-oom LOG to read a failed run)")
    reserve = parse_bytes(args.runtime_reserve) if args.runtime_reserve else None
    bandwidth = parse_bytes(args.offload_bandwidth) if args.offload_bandwidth else None
    result = plan(
        params, devices, parse_bytes(memory), devices_per_node=args.devices_per_node,
        device_kind=args.device_kind, runtime_bytes=reserve, offload_bandwidth=bandwidth,
    )
    print(format_plan_table(result))
    if args.try_steps is None:
        return 0 if result.recommended is not None else 1
    return _try_layouts(params, result, args.try_steps, args.write)


def _try_layouts(params: PipelineParams, planned: Plan, steps: int, write: str | None) -> int:
    """`plan --try`: a short run of each fitting layout, the table, and the fastest written to `write`."""
    from model_core.parallel.trials import (
        fastest,
        format_trials_table,
        none_finished,
        nothing_to_try,
        run_trials,
        write_params,
    )

    refused = nothing_to_try(params, planned)
    if refused:
        raise ValueError(refused)
    prepared_pretraining_data(params)  # once here; every trial's ranks reuse it
    workdir = Path(params.train.output_dir) / "layout-trials"
    trials = run_trials(params, planned, steps, workdir, sys.stdout)
    print(format_trials_table(trials, steps))
    best = fastest(trials)
    if best is None:
        raise ValueError(none_finished(trials, workdir))
    if write:
        print(f"fastest: {best.estimate.candidate}; wrote its params to {write_params(best.params, write)}")
    else:
        print(f"fastest: {best.estimate.candidate} (--write PATH saves its params)")
    return 0


def _explain_oom(log: str, metrics: str | None) -> int:
    """Say where a failed run ran out of memory and what to change; exit 1 when the log shows no such failure."""
    from model_core.parallel.oom import explain_oom, read_log, read_metrics

    diagnosis = explain_oom(read_log(log), read_metrics(metrics) if metrics else None)
    print(diagnosis)
    return 0 if diagnosis.phase is not None else 1
