"""`llmflow eval`: fixed-seed evaluation of a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.commands.common import add_params_arguments, load, prepared_pretraining_data


def register(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval",
        help="fixed-seed evaluation of a checkpoint (+ adapters): held-out loss, perplexity, generations",
        description="Score the checkpoint on the validation splits of the pretraining and instruction data "
        "(eval.batches batches each) and generate from eval.prompts with eval's decoding settings and seed; "
        "write eval_report.json and eval_report.md.",
    )
    add_params_arguments(evaluate)
    evaluate.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (model.safetensors)")
    evaluate.add_argument("--adapters", type=Path, help="LoRA adapters directory trained on that checkpoint")
    evaluate.add_argument(
        "--output",
        type=Path,
        help="report directory (default: train.output_dir/eval-<key>, keyed by the checkpoint, the adapters, the "
        "eval params and the held-out sets, so reports of different runs never overwrite each other)",
    )
    evaluate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.data import prepare_instructions
    from model_core.eval.evaluate import evaluate_checkpoint
    from model_core.eval.report import write_report
    from model_core.train.runs import eval_directory

    params = load(args)
    dataset = prepared_pretraining_data(params)
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
