"""`llmflow convert`: weights between Hugging Face Llama and llmflow."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
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
    to_ms.set_defaults(handler=run_hf_to_ms)
    to_hf = directions.add_parser(
        "ms-to-hf",
        help="an llmflow checkpoint -> a directory transformers loads",
        description="Write config.json, model.safetensors and (with --tokenizer) the tokenizer files.",
    )
    to_hf.add_argument("--src", required=True, type=Path, help="llmflow checkpoint (converted or training step-*)")
    to_hf.add_argument("--dst", required=True, type=Path, help="output Hugging Face directory")
    to_hf.add_argument("--tokenizer", type=Path, help="SentencePiece .model to ship with the export")
    to_hf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    to_hf.set_defaults(handler=run_ms_to_hf)


def run_hf_to_ms(args: argparse.Namespace) -> int:
    from model_core.convert import hf_to_ms

    result = hf_to_ms(args.src, args.dst, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
    print(f"converted {args.src} -> {result.path} (vocab {result.vocab_size}, padded to {result.params.vocab_size})")
    print(f"model params for this checkpoint: {result.params_path}")
    return 0


def run_ms_to_hf(args: argparse.Namespace) -> int:
    from model_core.convert import ms_to_hf

    result = ms_to_hf(args.src, args.dst, tokenizer=args.tokenizer, dtype=args.dtype)
    print(f"exported {args.src} -> {result.path} (loads with transformers.AutoModelForCausalLM)")
    return 0
