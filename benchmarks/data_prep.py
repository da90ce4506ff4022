"""Data-prep throughput against raw SentencePiece encoding, side by side on the same cores.

The corpus is the standard library's docstrings, materialised once (untimed) as a JSONL file, the
normal input format. Timed, alternating run by run so both see the same machine:

- prep: `prepare_dataset` on that JSONL with a tokenizer given by path, end to end (read, clean,
  filter, exact dedup, split, load tokenizer, encode, near dedup, pack, shuffle, write shards and
  manifest); tokens are those written to the shards (BOS and EOS included).
- raw: `processor.encode(documents, num_threads=cores)` of every cleaned, non-empty document of the
  same corpus (before filtering and deduplication), with the same tokenizer.

Reported apart: docstring extraction (cold, and from the cache), tokenizer training, and the default
python_docstrings pipeline with a warm cache. The fastest of `--repeats` runs counts. The last line
of stdout is one JSON object with the figures.

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
from model_core.data.cleaning import clean_texts
from model_core.data.docstrings import stdlib_docstrings
from params.schema import DataParams, DataSource, ModelParams, TokenizerParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the fastest counts")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    model = ModelParams()

    with tempfile.TemporaryDirectory() as workdir:
        cache_dir = Path(workdir, "data", ".cache")
        texts, extraction_cold_s = _timed(lambda: stdlib_docstrings(cache_dir))
        extraction_cached_s = min(_timed(lambda: stdlib_docstrings(cache_dir))[1] for _ in range(args.repeats))
        corpus = Path(workdir, "corpus.jsonl")
        corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        jsonl = [DataSource(kind="jsonl", paths=[str(corpus)])]

        trained = prepare_dataset(DataParams(sources=jsonl, output_dir=f"{workdir}/trained"), TokenizerParams(), model)
        tokenizer = TokenizerParams(model_path=str(trained.tokenizer_path))
        processor = spm.SentencePieceProcessor(model_file=str(trained.tokenizer_path))
        documents = [text for text in clean_texts(texts) if text]

        prep_runs, raw_runs = [], []
        for repeat in range(args.repeats):
            raw_runs.append(_timed(lambda: processor.encode(documents, num_threads=cores)))
            data = DataParams(sources=jsonl, output_dir=f"{workdir}/run{repeat}")
            prep_runs.append(_timed(lambda: prepare_dataset(data, tokenizer, model)))
        prep, prep_seconds = min(prep_runs, key=lambda run: run[1])
        assert not prep.reused
        raw_ids, raw_seconds = min(raw_runs, key=lambda run: run[1])

        default = DataParams(output_dir=f"{workdir}/data")
        _, default_cached_s = _timed(lambda: prepare_dataset(default, tokenizer, model))

    prep_tokens = sum(split["tokens"] for split in prep.manifest["splits"].values())
    raw_tokens = sum(map(len, raw_ids))
    result = {
        "cores": cores,
        "corpus_mb": round(sum(map(len, documents)) / 1e6, 2),
        "documents": len(documents),
        "prep_timed": "prepare_dataset(jsonl, given tokenizer), end to end",
        "prep_seconds": round(prep_seconds, 3),
        "prep_tokens": prep_tokens,
        "prep_tokens_per_s": round(prep_tokens / prep_seconds),
        "prep_stage_seconds": prep.manifest["timings_s"],
        "raw_timed": "processor.encode(all cleaned documents, num_threads=cores)",
        "raw_encode_seconds": round(raw_seconds, 3),
        "raw_encode_tokens": raw_tokens,
        "raw_encode_tokens_per_s": round(raw_tokens / raw_seconds),
        "docstring_extraction_cold_s": round(extraction_cold_s, 3),
        "docstring_extraction_cached_s": round(extraction_cached_s, 3),
        "tokenizer_training_s": trained.manifest["tokenizer"]["seconds"],
        "default_pipeline_cached_docstrings_s": round(default_cached_s, 3),
    }
    result["ratio"] = round(result["prep_tokens_per_s"] / result["raw_encode_tokens_per_s"], 3)
    print(json.dumps(result))


def _timed(run):
    started = time.perf_counter()
    value = run()
    return value, time.perf_counter() - started


if __name__ == "__main__":
    main()
