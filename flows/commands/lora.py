"""`llmflow lora merge`: fold adapters into their base checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.commands.common import add_params_arguments, load


def register(commands: argparse._SubParsersAction) -> None:
    lora = commands.add_parser("lora", help="LoRA adapter tools", description="LoRA adapter tools.")
    lora_actions = lora.add_subparsers(dest="lora_command", required=True, metavar="ACTION")
    merge = lora_actions.add_parser(
        "merge",
        help="fold adapters into their base: a plain checkpoint for export or further training",
        description="Write base + (alpha/rank) B A, in fp32, to a new checkpoint directory that `convert ms-to-hf` "
        "and `train` take. Adapters made for another base checkpoint are refused.",
    )
    add_params_arguments(merge)
    merge.add_argument("--base", required=True, type=Path, help="the base checkpoint the adapters were trained on")
    merge.add_argument("--adapters", required=True, type=Path, help="the adapters directory (adapters.safetensors)")
    merge.add_argument("--output", required=True, type=Path, help="new directory for the merged checkpoint")
    merge.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.convert import merge_into_checkpoint

    params = load(args)
    merged = merge_into_checkpoint(args.base, args.adapters, args.output, params.model)
    print(f"merged {args.adapters} into {args.base} -> {merged}")
    return 0
