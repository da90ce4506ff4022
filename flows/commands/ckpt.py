"""`llmflow ckpt reshard`: a training checkpoint rewritten for another layout."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
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
    reshard.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.parallel.layout import Layout
    from model_core.train.reshard import reshard

    split = tuple(int(n) for n in args.pipeline_layers.split(",")) if args.pipeline_layers else None
    target = Layout(dp=args.data_parallel, tp=args.tensor_parallel, pp=args.pipeline_parallel, pipeline_layers=split)
    written = reshard(args.checkpoint, target, args.output)
    print(f"resharded {args.checkpoint} -> {written.path} ({target})")
    return 0
