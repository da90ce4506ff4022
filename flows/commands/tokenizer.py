"""`llmflow tokenizer check`: two tokenizers compared on a sample."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
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
    check.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from model_core.convert import check_tokenizers

    text = args.text_file.read_text(encoding="utf-8") if args.text_file else None
    report = check_tokenizers(args.ours, args.reference, text)
    print(report.format())
    return 0 if report.aligned else 1
