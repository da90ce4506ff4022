"""`llmflow finetune`: LoRA on a pretrained checkpoint, without Prefect or MLflow."""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.commands.common import add_params_arguments, load, prepared_pretraining_data, show_warnings
from flows.commands.train import resume_choice
from params import PipelineParams
from params.rules import check_run


def register(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser(
        "finetune",
        help="LoRA fine-tune a pretrained checkpoint on instruction data (no Prefect/MLflow)",
        description="Prepare (or reuse) the instruction data with the pretraining tokenizer, train LoRA adapters "
        "(lora.rank, lora.alpha, lora.target_modules) for lora.steps steps at lora.lr on the frozen base, and "
        "save the adapters alone with the base checkpoint's sha256.",
    )
    add_params_arguments(tune)
    tune.add_argument("--base", type=Path, help="base checkpoint directory (default: the newest of `llmflow train`)")
    tune.add_argument(
        "--resume",
        metavar="auto|none|DIR",
        help="needed when the fine-tuning directory already holds checkpoints. auto: continue an interrupted "
        "fine-tune (nothing to do when its adapters are written); none: delete its checkpoints and start again",
    )
    tune.add_argument("--metrics-jsonl", metavar="PATH", help="append every logged metrics record to PATH as JSON lines")
    tune.add_argument("--checkpoint-dir", metavar="DIR", help="where fine-tuning checkpoints and adapters/ go")
    tune.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.data import prepare_instructions
    from model_core.model.lora import CONFIG
    from model_core.parallel import comm
    from model_core.parallel.launch import hang_watch, launch
    from model_core.train.callbacks import fan_out, jsonl_writer
    from model_core.train.finetune import ADAPTERS_DIR, finetune
    from model_core.train.runs import TrainingRun, finetune_directory
    from tasks.progress import TrainingProgress

    params = load(args)
    warnings = check_run(params, finetunes=True)  # a run that cannot happen fails before anything is prepared
    if not comm.launched_by_msrun():
        show_warnings(warnings)
    dataset = prepared_pretraining_data(params)
    base = args.base or latest_pretrained(params, dataset.output_dir)
    instructions = prepare_instructions(
        params.lora, params.data, dataset.tokenizer_path, params.model, params.tokenizer,
        min_validation_rows=params.train.micro_batch_size,
    )
    checkpoints = Path(args.checkpoint_dir or finetune_directory(params, base, instructions.output_dir))
    resume = args.resume or "none"
    if not comm.launched_by_msrun():  # a launcher decides for its ranks, which run with its choice
        planned = TrainingRun.at(checkpoints, params.lora.steps)
        if (checkpoints / ADAPTERS_DIR / CONFIG).exists() or planned.finished() is None:
            resume = resume_choice(planned, args.resume)
        elif args.resume is None:  # complete but without adapters: the write after the last step did not happen
            resume = "auto"
        if resume is None:
            print(f"adapters: {checkpoints / ADAPTERS_DIR}")
            return 0
    if params.parallel.world_size > 1 and not comm.launched_by_msrun():
        launch(
            ["-m", "flows.cli", *args.raw_args, "--resume", resume], params.parallel.world_size, checkpoints / "logs",
            **hang_watch(params),
        )
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


def latest_pretrained(params: PipelineParams, dataset_dir: Path) -> Path:
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
