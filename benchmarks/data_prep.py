"""Data-prep throughput against raw SentencePiece encoding, side by side on the same cores.

Prepares the default corpus (the standard library's docstrings) end to end with a tokenizer trained
beforehand (its training time is reported separately), and encodes the same cleaned documents with the
same tokenizer using all cores. The last line of stdout is one JSON object with the figures.

    python benchmarks/data_prep.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import sentencepiece as spm

from model_core.data import prepare_dataset
from model_core.data.cleaning import clean_text
from model_core.data.sources import list_inputs, read_input
from params.schema import DataParams, ModelParams, TokenizerParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the fastest counts")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    model = ModelParams()

    with tempfile.TemporaryDirectory() as workdir:
        trained = prepare_dataset(DataParams(output_dir=f"{workdir}/trained"), TokenizerParams(), model)
        tokenizer = TokenizerParams(model_path=str(trained.tokenizer_path))
        prep_seconds = min(_time_prep(Path(workdir, f"run{i}"), tokenizer, model) for i in range(args.repeats))
        processor = spm.SentencePieceProcessor(model_file=str(trained.tokenizer_path))

    documents = [clean_text(text) for item in list_inputs(DataParams().sources) for text in read_input(item)[0]]
    documents = [text for text in documents if text]
    raw_seconds, raw_tokens = min(_time_raw_encode(processor, documents, cores) for _ in range(args.repeats))

    splits = trained.manifest["splits"].values()
    prep_tokens = sum(split["tokens"] for split in splits)
    result = {
        "cores": cores,
        "corpus_mb": round(sum(map(len, documents)) / 1e6, 2),
        "tokenizer_training_s": trained.manifest["tokenizer"]["seconds"],
        "prep_seconds": round(prep_seconds, 3),
        "prep_tokens": prep_tokens,
        "prep_tokens_per_s": round(prep_tokens / prep_seconds),
        "prep_stage_seconds": trained.manifest["timings_s"],
        "raw_encode_seconds": round(raw_seconds, 3),
        "raw_encode_tokens": raw_tokens,
        "raw_encode_tokens_per_s": round(raw_tokens / raw_seconds),
    }
    result["ratio"] = round(result["prep_tokens_per_s"] / result["raw_encode_tokens_per_s"], 3)
    print(json.dumps(result))


def _time_prep(output_dir: Path, tokenizer: TokenizerParams, model: ModelParams) -> float:
    started = time.perf_counter()
    result = prepare_dataset(DataParams(output_dir=str(output_dir)), tokenizer, model)
    assert not result.reused
    return time.perf_counter() - started


def _time_raw_encode(processor: spm.SentencePieceProcessor, documents: list[str], cores: int) -> tuple[float, int]:
    started = time.perf_counter()
    token_ids = processor.encode(documents, num_threads=cores)
    return time.perf_counter() - started, sum(map(len, token_ids))


if __name__ == "__main__":
    main()
