"""Data-prep throughput against raw SentencePiece encoding, side by side on the same cores.

The corpus is the standard library's docstrings, materialised once (untimed) as a JSONL file, the
normal input format. Timed, alternating run by run so both see the same machine:

- prep: `prepare_dataset` on that JSONL with a tokenizer given by path, end to end (read, clean,
  filter, exact dedup, split, load tokenizer, encode, near dedup, pack, shuffle, write shards and
  manifest).
- raw: `processor.encode(documents, num_threads=cores)` of every cleaned, non-empty document of the
  same corpus (before filtering and deduplication), with the same tokenizer.

Both throughputs count the same tokens, those of the input text (raw's count), so their ratio is raw's
seconds over prep's: what it costs to turn the corpus into shards against only encoding it. Prep drops
documents (too short, exact and near duplicates) and adds BOS and EOS, so the tokens it writes are
another count; they are reported too (`prep_written_tokens_per_s`, `ratio_written`), but dividing them
by prep's time against raw's tokens by raw's time would count every dropped document as slowness.

Reported apart: docstring extraction (cold, and from the cache), tokenizer training, and the default
python_docstrings pipeline with a warm cache. Throughputs and the ratio are given for the median and
for the fastest of `--repeats` runs, with the stage seconds of the median prep run and the load
average. The last line of stdout is one JSON object with the figures.

    python benchmarks/data_prep.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sentencepiece as spm

from model_core.data import prepare_dataset
from model_core.data.cleaning import clean_texts
from model_core.data.prepare import REPORT_NAME
from model_core.data.docstrings import stdlib_docstrings
from params.schema import DataParams, DataSource, ModelParams, TokenizerParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each measurement")
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
            raw_runs.append(_raw_encode(processor, documents, cores))
            data = DataParams(sources=jsonl, output_dir=f"{workdir}/run{repeat}")
            prep_runs.append(_timed(lambda data=data: prepare_dataset(data, tokenizer, model)))
        assert not any(prep.reused for prep, _ in prep_runs)
        prep = sorted(prep_runs, key=lambda run: run[1])[len(prep_runs) // 2][0]  # the median run's stages

        stage_seconds = json.loads((prep.output_dir / REPORT_NAME).read_text())["timings_s"]
        tokenizer_seconds = json.loads((trained.output_dir / REPORT_NAME).read_text())["timings_s"]["tokenizer"]
        default = DataParams(output_dir=f"{workdir}/data")
        _, default_cached_s = _timed(lambda: prepare_dataset(default, tokenizer, model))

    written_tokens = sum(split["tokens"] for split in prep.manifest["splits"].values())
    raw_tokens = raw_runs[0][0]
    prep_seconds = [seconds for _, seconds in prep_runs]
    raw_seconds = [seconds for _, seconds in raw_runs]
    result = {
        "cores": cores,
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "corpus_mb": round(sum(map(len, documents)) / 1e6, 2),
        "documents": len(documents),
        "prep_timed": "prepare_dataset(jsonl, given tokenizer), end to end",
        "prep_seconds": _spread(prep_seconds, min, 3),
        "prep_tokens_per_s": _spread([raw_tokens / seconds for seconds in prep_seconds], max),
        "prep_written_tokens": written_tokens,
        "prep_written_tokens_per_s": _spread([written_tokens / seconds for seconds in prep_seconds], max),
        "prep_stage_seconds": stage_seconds,
        "prep_dropped_documents": prep.manifest["counts"]["dropped"],
        "raw_timed": "processor.encode(all cleaned documents, num_threads=cores)",
        "raw_encode_seconds": _spread(raw_seconds, min, 3),
        "raw_encode_tokens": raw_tokens,
        "raw_encode_tokens_per_s": _spread([raw_tokens / seconds for seconds in raw_seconds], max),
        "docstring_extraction_cold_s": round(extraction_cold_s, 3),
        "docstring_extraction_cached_s": round(extraction_cached_s, 3),
        "tokenizer_training_s": tokenizer_seconds,
        "default_pipeline_cached_docstrings_s": round(default_cached_s, 3),
    }
    for ratio, prep_key in (("ratio", "prep_tokens_per_s"), ("ratio_written", "prep_written_tokens_per_s")):
        result[ratio] = {
            kind: round(result[prep_key][kind] / result["raw_encode_tokens_per_s"][kind], 3)
            for kind in ("median", "best")
        }
    print(json.dumps(result))


def _spread(values: list[float], best: Callable[[list[float]], float], digits: int | None = None) -> dict:
    """The median and the best (min for seconds, max for throughputs) of the runs."""
    return {"median": round(statistics.median(values), digits), "best": round(best(values), digits)}


def _raw_encode(processor: spm.SentencePieceProcessor, documents: list[str], cores: int) -> tuple[int, float]:
    """The tokens and seconds of one raw encoding. Its ids (8.6K Python lists of 497K ints) are dropped
    before the next timed run: kept, the cyclic garbage collector went through them during the prep runs
    that followed (3-8 ms per run in its young-generation passes, and 20-67 ms per full pass)."""
    ids, seconds = _timed(lambda: processor.encode(documents, num_threads=cores))
    return sum(map(len, ids)), seconds


def _timed(run):
    started = time.perf_counter()
    value = run()
    return value, time.perf_counter() - started


if __name__ == "__main__":
    main()
