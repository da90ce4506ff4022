"""`llmflow train`: pretraining without Prefect or MLflow, under msrun when the layout has several ranks."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from flows.commands.common import add_params_arguments, load, prepared_pretraining_data, show_warnings
from model_core.parallel.launch import COLLECTIVE_TIMEOUT_S
from params.rules import check_run

if TYPE_CHECKING:
    from model_core.train.runs import TrainingRun


def register(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train",
        help="train the model on the prepared data (no Prefect/MLflow), with a progress bar",
        description="Prepare (or reuse) the data, then train for train.steps optimizer steps, checkpointing "
        "every train.checkpoint_interval steps.",
    )
    add_params_arguments(train)
    train.add_argument(
        "--resume",
        metavar="auto|none|DIR",
        help="needed when the run directory already holds checkpoints. auto: continue from the newest valid one "
        "(corrupted ones are skipped; nothing to do when the run is complete); none: delete them and start "
        "again; or a checkpoint directory",
    )
    train.add_argument("--metrics-jsonl", metavar="PATH", help="append every logged metrics record to PATH as JSON lines")
    train.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where checkpoints go (default: train.output_dir/pretrain-<key of the inputs that decide the result>, "
        "the directory pretrain-flow's pretrain stage uses)",
    )
    scale_out = train.add_argument_group(
        "scale-out", "with parallel.data_parallel x tensor_parallel x pipeline_parallel > 1, llmflow train starts "
        "that many ranks under msrun itself (all on this node unless --nodes is given)"
    )
    scale_out.add_argument("--nodes", type=int, default=1, help="nodes in the job (ranks split evenly)")
    scale_out.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nodes-1")
    scale_out.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    scale_out.add_argument("--master-port", type=int, help="port on node 0 (default: a free one; set it with --nodes > 1)")
    scale_out.add_argument(
        "--node-timeout", type=int, default=15, metavar="SECONDS",
        help="fail the job when a node has been silent this long (default 15; MS_NODE_TIMEOUT, when set, wins)",
    )
    scale_out.add_argument(
        "--collective-timeout", type=int, default=COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
        help=f"how long a rank waits inside a CPU collective for a late peer, e.g. one still compiling its first "
        f"step (default {COLLECTIVE_TIMEOUT_S}; LLMFLOW_COLLECTIVE_TIMEOUT, when set, wins)",
    )
    train.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.convert import convert_for_run
    from model_core.parallel import comm
    from model_core.parallel.launch import launch_training
    from model_core.train.callbacks import fan_out, jsonl_writer
    from model_core.train.runs import TrainingRun, pretraining_run
    from model_core.train.system import record_rank_peak_memory
    from model_core.train.trainer import Trainer
    from tasks.progress import TrainingProgress

    params = load(args)
    warnings = check_run(params)  # a run that cannot happen fails before anything is prepared
    if not comm.launched_by_msrun():
        show_warnings(warnings)
    dataset = prepared_pretraining_data(params)
    convert = params.convert
    converted = convert_for_run(convert, params.model, params.parallel.tensor_parallel) if convert.hf_source else None
    initial_weights = converted.path if converted else None
    if args.checkpoint_dir:
        planned = TrainingRun.at(args.checkpoint_dir, params.train.steps)
    else:
        planned = pretraining_run(params, dataset.output_dir, initial_weights)
    checkpoints = planned.directory
    resume = args.resume or "none"
    if not comm.launched_by_msrun():  # a launcher decides for its ranks, which run with its choice
        resume = resume_choice(planned, args.resume)
        if resume is None:
            return 0
        planned.write_record()
    if params.parallel.world_size > 1 and not comm.launched_by_msrun():
        # Data and weights are ready, so the ranks only reuse them; each rank runs this same command under msrun.
        cluster = {
            "nodes": args.nodes, "node_rank": args.node_rank, "master_addr": args.master_addr,
            "node_timeout_s": args.node_timeout, "collective_timeout_s": args.collective_timeout,
        }
        rank_args = [*args.raw_args[1:], "--checkpoint-dir", str(checkpoints), "--resume", resume]
        launch_training(params, rank_args, checkpoints / "logs", master_port=args.master_port, **cluster)
        if args.nodes > 1:
            local = params.parallel.world_size // args.nodes
            first = args.node_rank * local
            print(
                f"node {args.node_rank} of {args.nodes}: ranks {first}-{first + local - 1} finished; their logs are "
                f"{checkpoints / 'logs'}/worker_<rank>.log; rank 0 writes the checkpoints to {checkpoints}"
            )
        return 0
    start = initial_weights if planned.continue_from is None else None  # a continued run starts from its own
    trainer = Trainer(params, dataset.output_dir, checkpoints, initial_weights=start, continue_from=planned.continue_from)
    bar = TrainingProgress(planned.final_step, initial=starting_step(planned, resume))
    jsonl = jsonl_writer(args.metrics_jsonl) if args.metrics_jsonl else None
    try:
        result = trainer.run(on_metrics=fan_out(bar, jsonl), resume=resume)
    finally:
        bar.close()
    if result.resumed_from:
        origin = f" (resumed from {result.resumed_from})"
    elif result.continued_from:
        origin = f" (steps {result.schedule_start + 1}-{result.steps}, continuing {result.continued_from})"
    else:
        origin = ""
    rank = comm.rank()
    if comm.launched_by_msrun():
        record_rank_peak_memory(checkpoints, rank)
    saved = f"checkpoint {result.checkpoint}" if rank == 0 else f"rank 0 writes the checkpoints to {checkpoints}"
    print(
        f"{f'rank {rank}: ' if rank else ''}trained {result.steps - result.schedule_start} steps{origin}: loss "
        f"{result.initial_loss:.4f} -> {result.final_loss:.4f}, {result.skipped_steps} skipped; {saved}"
    )
    return 0


def resume_choice(planned: TrainingRun, resume: str | None) -> str | None:
    """How `llmflow train` starts in a run directory: `resume` as given, "none" for a new run, an error for an
    existing run without --resume, None when the run is complete and --resume auto has nothing to do."""
    import shutil

    from model_core.train.checkpoint import list_checkpoints

    newest = planned.newest()
    if newest is None:
        return resume or "none"
    if resume is None:
        raise ValueError(
            f"{planned.directory} already holds this run (newest checkpoint {newest.path.name}); pass --resume auto "
            "to continue it, or --resume none to start it again (its checkpoints are deleted)"
        )
    finished = planned.finished()
    if resume == "auto" and finished is not None:
        counters = finished.state()["counters"]
        print(
            f"nothing to do: {planned.directory} already holds this run's final checkpoint {finished.path.name} "
            f"(loss {counters['initial_loss']:.4f} -> {counters['last_loss']:.4f})"
        )
        return None
    if resume == "none":
        stale = list_checkpoints(planned.directory)
        for checkpoint in stale:  # left behind, a later step of the old run would pass for one of the new
            shutil.rmtree(checkpoint.path)
        print(f"starting {planned.directory} again: deleted its {len(stale)} checkpoints")
    return resume


def starting_step(planned: TrainingRun, resume: str) -> int:
    """The step a run starts at: its newest valid checkpoint's (resume auto), the one it continues, or 0."""
    from model_core.train.checkpoint import Checkpoint, latest_valid

    found = latest_valid(planned.directory) if resume == "auto" else None
    if found is not None:
        return found.step
    if planned.continue_from is not None:
        return Checkpoint(planned.continue_from, -1).state()["step"]
    return 0
