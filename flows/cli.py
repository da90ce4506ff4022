"""The `llmflow` command line: run the pipeline or one stage from a params preset or file, and the
conversion and tokenizer tools.

The pipeline commands take `--params NAME_OR_FILE` (default: the `tiny` preset) and any number of
`--set section.field=value` overrides. Errors are said on stderr without a traceback: bad params or
arguments exit with status 2 and a message naming the file, line and field (one line per problem); any
other failure exits with status 1 and its reason in one line (LLMFLOW_DEBUG=1 shows the traceback too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from model_core.parallel.launch import COLLECTIVE_TIMEOUT_S, LaunchError, note_rank_failure
from params import ParamsError, PipelineParams, load_params, preset_names, to_yaml
from params.rules import check_run

if TYPE_CHECKING:
    from model_core.parallel.planner import Plan
    from model_core.train.runs import TrainingRun


def _quiet_prefect_defaults() -> None:
    # Prefect's temporary local API otherwise prints a harmless analytics traceback.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Its 20 s default for the temporary API to start is missed on a busy machine, failing the run before it begins.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if not os.environ.get("LLMFLOW_DEBUG"):
        import logging

        for name in ("prefect.task_runs", "prefect.flow_runs"):
            logging.getLogger(name).addFilter(_without_traceback)


def _without_traceback(record) -> bool:
    """A failed task or flow run is logged by Prefect's engine with its traceback, once per enclosing run; the
    failure's own message is in the record's text and in llmflow's last line, so the traceback is kept only
    for LLMFLOW_DEBUG=1."""
    record.exc_info, record.exc_text = None, None
    return True


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


def _params(args: argparse.Namespace) -> PipelineParams:
    return load_params(args.params, args.overrides)


def _cmd_run(args: argparse.Namespace) -> int:
    from flows.pretrain import pretrain_flow
    from tasks.reachability import check_services

    params = _params(args)
    check_run(params, finetunes=params.lora.enabled)  # before Prefect starts, as the flow's first line does again
    check_services(params)
    result = pretrain_flow(params)
    print(f"pipeline finished: MLflow run {result.mlflow_run_id}, dataset {result.data.dataset_dir}")
    from tasks.tracking import tracking_uri

    print(f"browse it with: mlflow ui --backend-store-uri {tracking_uri(params)}")
    return 0


def _cmd_prep(args: argparse.Namespace) -> int:
    from flows.data_prep import data_prep_flow
    from tasks.reachability import check_services

    params = _params(args)
    check_services(params)
    result = data_prep_flow(params)
    state = "reused" if result.reused else "prepared"
    print(f"{state} dataset {result.dataset_dir} (manifest {result.manifest_path})")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from model_core.convert import convert_for_run
    from model_core.parallel import comm
    from model_core.parallel.launch import launch_training
    from model_core.train.callbacks import fan_out, jsonl_writer
    from model_core.train.runs import TrainingRun, pretraining_run
    from model_core.train.system import record_rank_peak_memory
    from model_core.train.trainer import Trainer
    from tasks.progress import TrainingProgress

    params = _params(args)
    check_run(params)  # a run that cannot happen fails before anything is prepared
    dataset = _prepared_pretraining_data(params)
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
        resume = _resume_choice(planned, args.resume)
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
    bar = TrainingProgress(planned.final_step, initial=_starting_step(planned, resume))
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


def _resume_choice(planned: TrainingRun, resume: str | None) -> str | None:
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


def _starting_step(planned: TrainingRun, resume: str) -> int:
    """The step a run starts at: its newest valid checkpoint's (resume auto), the one it continues, or 0."""
    from model_core.train.checkpoint import Checkpoint, latest_valid

    found = latest_valid(planned.directory) if resume == "auto" else None
    if found is not None:
        return found.step
    if planned.continue_from is not None:
        return Checkpoint(planned.continue_from, -1).state()["step"]
    return 0


def _prepared_pretraining_data(params: PipelineParams):
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


def _latest_pretrained(params: PipelineParams, dataset_dir: Path) -> Path:
    """The newest valid checkpoint of this params' pretraining run (the one `llmflow train` writes)."""
    from model_core.convert import convert_for_run
    from model_core.train.checkpoint import latest_valid
    from model_core.train.runs import pretraining_run

    convert = params.convert
    converted = convert_for_run(convert, params.model, params.parallel.tensor_parallel).path if convert.hf_source else None
    directory = pretraining_run(params, dataset_dir, converted).directory
    found = latest_valid(directory)
    if found is None:
        raise ValueError(f"no valid pretraining checkpoint in {directory}; run `llmflow train` first or pass --base")
    return found.path


def _cmd_finetune(args: argparse.Namespace) -> int:
    from model_core.data import prepare_instructions
    from model_core.model.lora import CONFIG
    from model_core.parallel import comm
    from model_core.parallel.launch import launch
    from model_core.train.callbacks import fan_out, jsonl_writer
    from model_core.train.finetune import ADAPTERS_DIR, finetune
    from model_core.train.runs import TrainingRun, finetune_directory
    from tasks.progress import TrainingProgress

    params = _params(args)
    check_run(params, finetunes=True)  # a run that cannot happen fails before anything is prepared
    dataset = _prepared_pretraining_data(params)
    base = args.base or _latest_pretrained(params, dataset.output_dir)
    instructions = prepare_instructions(
        params.lora, params.data, dataset.tokenizer_path, params.model, params.tokenizer,
        min_validation_rows=params.train.micro_batch_size,
    )
    checkpoints = Path(args.checkpoint_dir or finetune_directory(params, base, instructions.output_dir))
    resume = args.resume or "none"
    if not comm.launched_by_msrun():  # a launcher decides for its ranks, which run with its choice
        planned = TrainingRun.at(checkpoints, params.lora.steps)
        if (checkpoints / ADAPTERS_DIR / CONFIG).exists() or planned.finished() is None:
            resume = _resume_choice(planned, args.resume)
        elif args.resume is None:  # complete but without adapters: the write after the last step did not happen
            resume = "auto"
        if resume is None:
            print(f"adapters: {checkpoints / ADAPTERS_DIR}")
            return 0
    if params.parallel.world_size > 1 and not comm.launched_by_msrun():
        launch(["-m", "flows.cli", *args.raw_args, "--resume", resume], params.parallel.world_size, checkpoints / "logs")
        return 0
    bar = TrainingProgress(params.lora.steps, description="finetune")
    jsonl = jsonl_writer(args.metrics_jsonl) if args.metrics_jsonl else None
    try:
        result = finetune(params, instructions.output_dir, base, checkpoints, on_metrics=fan_out(bar, jsonl), resume=resume)
    finally:
        bar.close()
    summary, trained = result.summary, result.train
    print(
        f"LoRA on {summary.adapted_modules} projections: {summary.trainable_parameters:,} trainable parameters "
        f"of {summary.total_parameters:,} ({summary.trainable_share:.2%}), "
        f"{summary.saved_state_bytes / 2**20:,.1f} MiB of gradient and optimizer state saved against full fine-tuning"
    )
    print(
        f"fine-tuned {trained.steps} steps: loss {trained.initial_loss:.4f} -> {trained.final_loss:.4f}; "
        f"adapters {result.adapters_dir} (base {base})"
    )
    return 0


def _cmd_lora_merge(args: argparse.Namespace) -> int:
    from model_core.convert import merge_into_checkpoint

    params = _params(args)
    merged = merge_into_checkpoint(args.base, args.adapters, args.output, params.model)
    print(f"merged {args.adapters} into {args.base} -> {merged}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from model_core.data import prepare_instructions
    from model_core.eval.evaluate import evaluate_checkpoint
    from model_core.eval.report import write_report
    from model_core.train.runs import eval_directory

    params = _params(args)
    dataset = _prepared_pretraining_data(params)
    instructions = prepare_instructions(
        params.lora, params.data, dataset.tokenizer_path, params.model, params.tokenizer,
        min_validation_rows=params.train.micro_batch_size,
    )
    held_out = {"pretraining": dataset.output_dir, "instructions": instructions.output_dir}
    report = evaluate_checkpoint(params, args.checkpoint, dataset.tokenizer_path, held_out, args.adapters)
    output = args.output or eval_directory(params, args.checkpoint, args.adapters, held_out)
    json_path, markdown_path = write_report(report, output)
    for name, scores in report.held_out.items():
        print(f"{name}: loss {scores.mean_loss:.4f}, perplexity {scores.perplexity:.2f} over {scores.tokens:,} tokens")
    for output_text in report.generations:
        print(f"--- {output_text.prompt!r} ({output_text.stopped_by})\n{output_text.text}")
    print(f"report: {markdown_path} and {json_path}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from model_core.parallel.planner import format_plan_table, parse_bytes, plan

    if args.explain_oom:
        return _explain_oom(args.explain_oom, args.metrics)
    if args.write and args.try_steps is None:
        raise ValueError("--write PATH goes with --try STEPS (it writes the fastest layout the trials measured)")
    if args.try_steps is not None and args.try_steps < 2:
        raise ValueError(f"--try {args.try_steps}: a trial needs at least 2 steps (the first compiles; speed is measured after it)")
    params = _params(args)
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
    _prepared_pretraining_data(params)  # once here; every trial's ranks reuse it
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


def _cmd_compare(args: argparse.Namespace) -> int:
    from tasks.compare import compare, render, write_loss_overlay
    from tasks.tracking import tracking_uri

    if args.run_ids and (args.experiment or args.last is not None):
        raise ValueError("give run ids, or --experiment/--last to take an experiment's latest runs, not both")
    if args.last is not None and args.last < 2:
        raise ValueError(f"--last {args.last}: a comparison needs at least 2 runs")
    params = _params(args)
    uri = args.tracking_uri or tracking_uri(params)
    experiment = None if args.run_ids else args.experiment or params.tracking.experiment  # where the pipeline logs
    comparison = compare(uri, args.run_ids, experiment, 2 if args.last is None else args.last)
    print(render(comparison, uri, args.format))
    if args.format != "json":
        written = write_loss_overlay(comparison, args.plot)
        print(f"pretraining loss curves: {written}" if written else "no pretraining loss history to plot")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
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


def _explain_oom(log: str, metrics: str | None) -> int:
    """Say where a failed run ran out of memory and what to change; exit 1 when the log shows no such failure."""
    from model_core.parallel.oom import explain_oom, read_log, read_metrics

    diagnosis = explain_oom(read_log(log), read_metrics(metrics) if metrics else None)
    print(diagnosis)
    return 0 if diagnosis.phase is not None else 1


def _cmd_ckpt_reshard(args: argparse.Namespace) -> int:
    from model_core.parallel.layout import Layout
    from model_core.train.reshard import reshard

    split = tuple(int(n) for n in args.pipeline_layers.split(",")) if args.pipeline_layers else None
    target = Layout(dp=args.data_parallel, tp=args.tensor_parallel, pp=args.pipeline_parallel, pipeline_layers=split)
    written = reshard(args.checkpoint, target, args.output)
    print(f"resharded {args.checkpoint} -> {written.path} ({target})")
    return 0


def _cmd_params_show(args: argparse.Namespace) -> int:
    params = _params(args)
    if args.format == "json":
        print(params.model_dump_json(indent=2))
    elif args.format == "deployment":  # the --params value of `prefect deployment run`
        print(json.dumps({"params": params.model_dump(mode="json")}))
    elif args.format == "schema":
        print(json.dumps(PipelineParams.model_json_schema(), indent=2))
    else:
        print(to_yaml(params), end="")
    return 0


def _cmd_convert_hf_to_ms(args: argparse.Namespace) -> int:
    from model_core.convert import hf_to_ms

    result = hf_to_ms(args.src, args.dst, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
    print(f"converted {args.src} -> {result.path} (vocab {result.vocab_size}, padded to {result.params.vocab_size})")
    print(f"model params for this checkpoint: {result.params_path}")
    return 0


def _cmd_convert_ms_to_hf(args: argparse.Namespace) -> int:
    from model_core.convert import ms_to_hf

    result = ms_to_hf(args.src, args.dst, tokenizer=args.tokenizer, dtype=args.dtype)
    print(f"exported {args.src} -> {result.path} (loads with transformers.AutoModelForCausalLM)")
    return 0


def _cmd_tokenizer_check(args: argparse.Namespace) -> int:
    from model_core.convert import check_tokenizers

    text = args.text_file.read_text(encoding="utf-8") if args.text_file else None
    report = check_tokenizers(args.ours, args.reference, text)
    print(report.format())
    return 0 if report.aligned else 1


def _add_convert_commands(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert", help="convert weights between Hugging Face Llama and llmflow", description="Convert weights."
    )
    directions = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_ms = directions.add_parser(
        "hf-to-ms",
        help="a Hugging Face Llama directory -> an llmflow checkpoint (+ its model params)",
        description="Read config.json and model.safetensors (or a sharded index, or pytorch_model.bin, "
        "read without running pickled code) and write model.safetensors + params for llmflow.",
    )
    to_ms.add_argument("--src", required=True, type=Path, help="Hugging Face model directory")
    to_ms.add_argument("--dst", required=True, type=Path, help="output checkpoint directory (must not exist)")
    to_ms.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    to_ms.add_argument("--tensor-parallel", type=int, default=1, help="pad the vocabulary to a multiple of this")
    to_ms.set_defaults(handler=_cmd_convert_hf_to_ms)
    to_hf = directions.add_parser(
        "ms-to-hf",
        help="an llmflow checkpoint -> a directory transformers loads",
        description="Write config.json, model.safetensors and (with --tokenizer) the tokenizer files.",
    )
    to_hf.add_argument("--src", required=True, type=Path, help="llmflow checkpoint (converted or training step-*)")
    to_hf.add_argument("--dst", required=True, type=Path, help="output Hugging Face directory")
    to_hf.add_argument("--tokenizer", type=Path, help="SentencePiece .model to ship with the export")
    to_hf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    to_hf.set_defaults(handler=_cmd_convert_ms_to_hf)

    tokenizer = commands.add_parser("tokenizer", help="tokenizer tools", description="Tokenizer tools.")
    actions = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="compare two tokenizers on a sample and report the first divergence",
        description="Encode a sample with both tokenizers; report vocab sizes, special-token ids and the first "
        "place their ids differ. Exit status 1 when they diverge.",
    )
    check.add_argument("--ours", required=True, type=Path, help="our SentencePiece .model")
    check.add_argument("--reference", required=True, type=Path, help="a SentencePiece .model or a Hugging Face tokenizer directory")
    check.add_argument("--text-file", type=Path, help="sample text to encode (default: a built-in sample)")
    check.set_defaults(handler=_cmd_tokenizer_check)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (the usage itself is one --help away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _version() -> str:
    try:
        return metadata.version("llmflow")
    except metadata.PackageNotFoundError:  # a checkout run without installing it
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmflow",
        description="Declarative LLM pretraining and fine-tuning on MindSpore, orchestrated by Prefect, "
        "tracked in MLflow.",
    )
    parser.add_argument("--version", action="version", version=f"llmflow {_version()}")
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
    train.set_defaults(handler=_cmd_train)

    tune = commands.add_parser(
        "finetune",
        help="LoRA fine-tune a pretrained checkpoint on instruction data (no Prefect/MLflow)",
        description="Prepare (or reuse) the instruction data with the pretraining tokenizer, train LoRA adapters "
        "(lora.rank, lora.alpha, lora.target_modules) for lora.steps steps at lora.lr on the frozen base, and "
        "save the adapters alone with the base checkpoint's sha256.",
    )
    _add_params_arguments(tune)
    tune.add_argument("--base", type=Path, help="base checkpoint directory (default: the newest of `llmflow train`)")
    tune.add_argument(
        "--resume",
        metavar="auto|none|DIR",
        help="needed when the fine-tuning directory already holds checkpoints. auto: continue an interrupted "
        "fine-tune (nothing to do when its adapters are written); none: delete its checkpoints and start again",
    )
    tune.add_argument("--metrics-jsonl", metavar="PATH", help="append every logged metrics record to PATH as JSON lines")
    tune.add_argument("--checkpoint-dir", metavar="DIR", help="where fine-tuning checkpoints and adapters/ go")
    tune.set_defaults(handler=_cmd_finetune)

    evaluate = commands.add_parser(
        "eval",
        help="fixed-seed evaluation of a checkpoint (+ adapters): held-out loss, perplexity, generations",
        description="Score the checkpoint on the validation splits of the pretraining and instruction data "
        "(eval.batches batches each) and generate from eval.prompts with eval's decoding settings and seed; "
        "write eval_report.json and eval_report.md.",
    )
    _add_params_arguments(evaluate)
    evaluate.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (model.safetensors)")
    evaluate.add_argument("--adapters", type=Path, help="LoRA adapters directory trained on that checkpoint")
    evaluate.add_argument(
        "--output",
        type=Path,
        help="report directory (default: train.output_dir/eval-<key>, keyed by the checkpoint, the adapters, the "
        "eval params and the held-out sets, so reports of different runs never overwrite each other)",
    )
    evaluate.set_defaults(handler=_cmd_eval)

    lora = commands.add_parser("lora", help="LoRA adapter tools", description="LoRA adapter tools.")
    lora_actions = lora.add_subparsers(dest="lora_command", required=True, metavar="ACTION")
    merge = lora_actions.add_parser(
        "merge",
        help="fold adapters into their base: a plain checkpoint for export or further training",
        description="Write base + (alpha/rank) B A, in fp32, to a new checkpoint directory that `convert ms-to-hf` "
        "and `train` take. Adapters made for another base checkpoint are refused.",
    )
    _add_params_arguments(merge)
    merge.add_argument("--base", required=True, type=Path, help="the base checkpoint the adapters were trained on")
    merge.add_argument("--adapters", required=True, type=Path, help="the adapters directory (adapters.safetensors)")
    merge.add_argument("--output", required=True, type=Path, help="new directory for the merged checkpoint")
    merge.set_defaults(handler=_cmd_lora_merge)

    comparer = commands.add_parser(
        "compare",
        help="pipeline runs side by side: the params that differ, headline metrics, loss curves, MLflow links",
        description="Compare pipeline runs recorded in MLflow: the params that differ between them, their "
        "headline metrics (final and best loss, validation loss, perplexities, tokens/s, MFU, wall time), an "
        "overlay of their pretraining loss curves, and where to open each in MLflow's UI.",
    )
    _add_params_arguments(comparer)
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
    comparer.set_defaults(handler=_cmd_compare)

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
    sweeper.set_defaults(handler=_cmd_sweep)

    planner = commands.add_parser(
        "plan",
        help="estimate per-rank memory of every valid layout and recommend one",
        description="Estimate per-rank bytes (parameters, gradients, optimizer state, activations with and without "
        "recompute, communication buffers) for every dp x tp x pp x ZeRO layout of --devices, and recommend "
        "one: data parallel if the model fits, then tensor parallel inside a node, then pipeline stages. "
        "See docs/planner.md.",
    )
    _add_params_arguments(planner)
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
    planner.set_defaults(handler=_cmd_plan)

    ckpt = commands.add_parser("ckpt", help="checkpoint tools", description="Checkpoint tools.")
    ckpt_actions = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    reshard = ckpt_actions.add_parser(
        "reshard",
        help="rewrite a training checkpoint for another parallel layout (tp2 pp2 -> tp1 pp1 and back), exactly",
        description="Join or split the tensor-parallel blocks and pipeline stages of a step-* checkpoint for another "
        "layout. "
        "Optimizer moments, data position and counters carry over; a round trip gives the same bytes. "
        "Resuming under another tp or pp degree reshards on the fly; this writes it to disk "
        "(for example a tp1 copy that `finetune --base`, `eval` and `convert ms-to-hf` read).",
    )
    reshard.add_argument("--checkpoint", required=True, type=Path, help="a step-* checkpoint directory")
    reshard.add_argument("--tensor-parallel", type=int, required=True, help="target tensor-parallel degree")
    reshard.add_argument("--pipeline-parallel", type=int, default=1, help="target pipeline stages (default 1)")
    reshard.add_argument("--pipeline-layers", help="layers per target stage, comma-separated (default: equal stages)")
    reshard.add_argument("--data-parallel", type=int, default=1, help="target data-parallel degree (default 1)")
    reshard.add_argument("--output", required=True, type=Path, help="directory to write step-*/ into")
    reshard.set_defaults(handler=_cmd_ckpt_reshard)

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
    _add_convert_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    raw_args = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw_args)
    args.raw_args = raw_args
    handler: Callable[[argparse.Namespace], int] = args.handler
    _quiet_prefect_defaults()
    try:
        return handler(args)
    except ParamsError as error:
        print(f"llmflow: {error}", file=sys.stderr)
        note_rank_failure(str(error))  # a rank under msrun: for its launcher to report
        return 2
    except KeyboardInterrupt:
        print(f"llmflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        reason = _reason(error)
        print(f"llmflow {args.command}: {reason}", file=sys.stderr)
        note_rank_failure(reason)
        return 1


def _reason(error: Exception) -> str:
    """What went wrong, for people: llmflow's own message, an OS error's file and cause, or for anything
    unexpected its type, with the way to see where."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    if isinstance(error, (ValueError, ArithmeticError, LaunchError, OSError)):  # bad input, a diverged run, a failed rank
        return str(error)
    return f"{type(error).__name__}: {error} (unexpected; LLMFLOW_DEBUG=1 shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
