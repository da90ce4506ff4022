"""Data health: what a prepared dataset tells about whether a model can learn from it, measured by data prep
for each source and for the whole dataset, written to the manifest under `health`, and judged against the
thresholds of data.health (a warning per measure above its threshold, never a refusal).

The measures, all but fertility over the training split's packed rows (padding left out):

- `fertility`: tokens per character of the kept documents (both splits, after deduplication). High when the
  tokenizer cuts the text into small pieces.
- `rare_token_share`: share of tokens whose id occurs fewer than RARE_MIN_COUNT times in the dataset's training
  rows: their embeddings see too few examples to learn.
- `unknown_rate`: share of tokens that are the unknown piece or SentencePiece byte-fallback pieces (<0x..>).
- `repeated_ngram_rate`: share of a row's NGRAM-grams of ids that already occurred earlier in the same row.
- `longest_id_run`: the longest run of one id inside a row.
- `near_copy_row_share`: share of rows that share a MinHash LSH band with an earlier row of the shuffled split
  (the order training reads them in, which no cut into shards changes): the signature and banding of dedup.py
  over data.shingle_words-token shingles, the bands chosen to catch a pair at Jaccard similarity
  NEAR_COPY_SIMILARITY 99 times in 100. Candidates are not verified against the whole signature, so a pair of
  rows half alike counts about one time in three.

Every measure is a sum, a maximum or a count merged from per-shard parts, so prep keeps its memory: a job holds
one input shard's rows a block at a time and writes their id counts (one entry per vocabulary id), band keys and
positions;
the merge sums the counts per source and finds shared band keys in partitions of at most PARTITION_BYTES,
marking the rows in a memory-mapped byte a row. Nothing here depends on the thresholds, which are params and
do not enter the dataset's key: `judge` applies them, at build and again whenever a later run reads the
manifest with other thresholds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from model_core.data import dedup, global_dedup, row_shuffle
from model_core.data.input_shards import InputShard
from model_core.data.sources import InputFile, list_inputs
from params.rules import source_names
from params.schema import DataHealthParams, DataSource

METRICS = (
    "fertility",
    "rare_token_share",
    "unknown_rate",
    "repeated_ngram_rate",
    "longest_id_run",
    "near_copy_row_share",
)
RARE_MIN_COUNT = 10  # an id used fewer times than this in the training rows is a rare piece
NGRAM = 4  # ids per n-gram of repeated_ngram_rate
NEAR_COPY_SIMILARITY = 0.8  # the Jaccard similarity of shingle sets at which rows are near copies
PERMUTATIONS = 64  # MinHash signature positions of a row
PARTITION_BYTES = 32 << 20  # band-key entries (key and row number) the merge holds at once
_BLOCK_TOKENS = 1 << 20  # tokens of rows measured at once: their n-gram hashes take 8 bytes each
_WHAT = {
    "fertility": "tokens per character: the tokenizer cuts this text into small pieces (a vocabulary too small, "
    "or trained on other text)",
    "rare_token_share": f"of tokens are pieces used fewer than {RARE_MIN_COUNT} times in the dataset, too rare to learn",
    "unknown_rate": "of tokens are the unknown piece or byte-fallback pieces: text the vocabulary does not cover",
    "repeated_ngram_rate": f"of the {NGRAM}-grams in a row repeat earlier in the row: repetitive text",
    "longest_id_run": "tokens of one id in a row inside a packed row: a separator line, a blob of whitespace",
    "near_copy_row_share": "of the rows nearly copy an earlier row: repeated content",
}


@dataclass(frozen=True)
class HealthJob:
    """Measure the training rows that packing wrote for input shards [first_shard, end_shard)."""

    scratch: Path
    packing: row_shuffle.Packing
    first_shard: int
    end_shard: int
    shingle_tokens: int


def measure_shards(job: HealthJob) -> list[dict]:
    """`measure_shard` of each input shard of the job."""
    return [measure_shard(job, shard) for shard in range(job.first_shard, job.end_shard)]


def measure_shard(job: HealthJob, shard: int) -> dict:
    """The shard's sums and maxima; its id counts, band keys and row positions go to files (`_counts_path`, ...)."""
    positions, rows = row_shuffle.packed_rows(job.scratch, job.packing, shard)
    measured = measure_rows(rows, job.packing.pad_id, job.packing.vocab_size, job.shingle_tokens)
    plan = global_dedup.Plan.load(job.scratch / "plan.json")
    kept = np.load(plan.keep_path(job.scratch, shard))  # after deduplication, in both splits
    measured["tokens"] = int(np.load(plan.directories[shard] / "lengths.npy")[kept].sum(dtype=np.int64))
    measured["characters"] = int(np.load(plan.directories[shard] / "characters.npy")[kept].sum())
    np.save(_counts_path(job.scratch, shard), measured.pop("counts"))
    np.save(_keys_path(job.scratch, shard), measured.pop("band_keys"))
    np.save(_positions_path(job.scratch, shard), positions)
    return measured


def measure_rows(rows: np.ndarray, pad_id: int, vocab_size: int, shingle_tokens: int) -> dict:
    """Per-row measures of (rows, row_len) token ids, a block of rows at a time: id counts, n-grams and their
    repeats within a row, the longest run of one id, and each row's LSH band keys."""
    rows = np.asarray(rows)
    counts = np.zeros(vocab_size, dtype=np.int64)
    ngrams = repeated = longest = 0
    keys = []
    block = max(1, _BLOCK_TOKENS // max(rows.shape[1], 1))
    for first in range(0, len(rows), block):
        part = rows[first : first + block].astype(np.int64)
        counts += np.bincount(part.reshape(-1), minlength=vocab_size)[:vocab_size]
        windows, repeats = repeated_ngrams(part, NGRAM)
        ngrams, repeated = ngrams + windows, repeated + repeats
        longest = max(longest, longest_id_run(part, pad_id))
        keys.append(row_band_keys(part, shingle_tokens))
    counts[pad_id] = 0
    bands = PERMUTATIONS // dedup.rows_per_band(PERMUTATIONS, NEAR_COPY_SIMILARITY)
    return {
        "rows": len(rows),
        "ngrams": ngrams,
        "repeated_ngrams": repeated,
        "longest_id_run": longest,
        "counts": counts,
        "band_keys": np.concatenate(keys) if keys else np.empty((0, bands), dtype=np.uint64),
    }


def repeated_ngrams(rows: np.ndarray, n: int) -> tuple[int, int]:
    """(n-grams, n-grams equal to an earlier one in the same row) over the rows."""
    width = rows.shape[1] - n + 1
    if width < 2 or not len(rows):
        return max(width, 0) * len(rows), 0
    hashes = np.zeros((len(rows), width), dtype=np.uint64)
    for offset in range(n):
        hashes *= np.uint64(0x9E3779B97F4A7C15)
        hashes += rows[:, offset : offset + width].astype(np.uint64)
    hashes.sort(axis=1)
    return hashes.size, int((hashes[:, 1:] == hashes[:, :-1]).sum())


def longest_id_run(rows: np.ndarray, pad_id: int) -> int:
    """The longest run of one id inside any row; runs of padding do not count."""
    if not rows.size:
        return 0
    flat = rows.reshape(-1)
    starts_run = np.ones(len(flat), dtype=bool)
    starts_run[1:] = flat[1:] != flat[:-1]
    starts_run[:: rows.shape[1]] = True  # a run ends with its row
    starts = np.flatnonzero(starts_run)
    lengths = np.diff(np.append(starts, len(flat)))
    lengths[flat[starts] == pad_id] = 0
    return int(lengths.max())


def row_band_keys(rows: np.ndarray, shingle_tokens: int) -> np.ndarray:
    """(rows, bands) LSH band keys of the rows' MinHash signatures, tagged with their band as the near-dedup
    reduce tags them (equal keys: same band, same values)."""
    lengths = np.full(len(rows), rows.shape[1], dtype=np.int64)
    signatures = dedup.minhash_signatures(rows.reshape(-1), lengths, shingle_tokens, PERMUTATIONS)
    return global_dedup._tagged_band_keys(signatures, NEAR_COPY_SIMILARITY)


def near_copies(key_files: list[Path], position_files: list[Path], scratch: Path) -> list[int]:
    """Per shard, how many of its rows share a band key with a row before them in the shuffled split (rows are
    numbered by their position there, which no cut of the corpus into shards changes). Keys are read in
    partitions of the key space of at most PARTITION_BYTES; a row found in several partitions is marked once, in
    a memory-mapped byte per row."""
    shapes = [np.load(path, mmap_mode="r").shape for path in key_files]
    rows = sum(shape[0] for shape in shapes)
    if rows == 0:
        return [0] * len(key_files)
    entries = sum(math.prod(shape) for shape in shapes)
    partitions = max(1, math.ceil(entries * global_dedup.NEAR_ENTRY_BYTES / PARTITION_BYTES))
    marked = np.lib.format.open_memmap(scratch / "near-copy-rows.npy", mode="w+", dtype=bool, shape=(rows,))
    for partition in range(partitions):
        keys, numbers = [], []
        for keys_path, positions_path in zip(key_files, position_files):
            band_keys = np.load(keys_path)
            mine = band_keys % np.uint64(partitions) == np.uint64(partition)
            keys.append(band_keys[mine])
            numbers.append(np.broadcast_to(np.load(positions_path)[:, None], band_keys.shape)[mine])
        key, number = np.concatenate(keys), np.concatenate(numbers)
        order = np.lexsort((number, key))
        key, number = key[order], number[order]
        repeat = np.zeros(len(key), dtype=bool)
        repeat[1:] = key[1:] == key[:-1]
        marked[number[repeat]] = True
    counts = [int(marked[np.load(path)].sum()) for path in position_files]
    del marked
    return counts


def unknown_ids(tokenizer_path: Path) -> np.ndarray:
    """The ids of the unknown piece and the byte-fallback pieces of a SentencePiece model."""
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    return np.array(
        [i for i in range(processor.get_piece_size()) if processor.is_unknown(i) or processor.is_byte(i)], dtype=np.int64
    )


def summarize(
    shard_results: list[dict],
    shard_sources: list[str],
    scratch: Path,
    unknown: np.ndarray,
    thresholds: DataHealthParams,
) -> dict:
    """The manifest's `health` section from the shards' measures (`measure_shard`, in corpus order), each
    shard's source and the tokenizer's unknown ids."""
    shards = range(len(shard_results))
    near = near_copies([_keys_path(scratch, s) for s in shards], [_positions_path(scratch, s) for s in shards], scratch)
    totals: dict[str, dict] = {}
    for shard, (measured, source) in enumerate(zip(shard_results, shard_sources)):
        total = totals.setdefault(source, {"counts": 0, "near_copies": 0, "longest_id_run": 0})
        total["counts"] = total["counts"] + np.load(_counts_path(scratch, shard))
        for name in ("rows", "ngrams", "repeated_ngrams", "characters", "tokens"):
            total[name] = total.get(name, 0) + measured[name]
        total["longest_id_run"] = max(total["longest_id_run"], measured["longest_id_run"])
        total["near_copies"] += near[shard]
    whole = {
        "counts": sum(total["counts"] for total in totals.values()),
        "longest_id_run": max(total["longest_id_run"] for total in totals.values()),
        **{name: sum(t[name] for t in totals.values()) for name in ("rows", "ngrams", "repeated_ngrams", "near_copies", "characters", "tokens")},
    }
    rare = (whole["counts"] > 0) & (whole["counts"] < RARE_MIN_COUNT)
    health = {
        "dataset": _measures(whole, rare, unknown),
        "sources": {source: _measures(total, rare, unknown) for source, total in totals.items()},
    }
    return {**health, **judge(health, thresholds)}


def _measures(total: dict, rare: np.ndarray, unknown: np.ndarray) -> dict:
    counts = total["counts"]
    tokens = max(int(counts.sum()), 1)
    return {
        "fertility": _ratio(total["tokens"], total["characters"]),
        "rare_token_share": _ratio(int(counts[rare].sum()), tokens),
        "unknown_rate": _ratio(int(counts[unknown[unknown < len(counts)]].sum()), tokens),
        "repeated_ngram_rate": _ratio(total["repeated_ngrams"], total["ngrams"]),
        "longest_id_run": int(total["longest_id_run"]),
        "near_copy_row_share": _ratio(total["near_copies"], total["rows"]),
    }


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0


def judge(health: dict, thresholds: DataHealthParams) -> dict:
    """The thresholds and a warning per measure above its threshold: for each source, and for the whole dataset
    when it has several (one source's warning would otherwise come twice)."""
    limits = {name: getattr(thresholds, f"max_{name}") for name in METRICS}
    scopes = [(f"source {name!r}", measures) for name, measures in health["sources"].items()]
    if len(scopes) > 1:
        scopes.insert(0, ("the dataset", health["dataset"]))
    warnings = [
        f"data health: {scope} has {name}={measures[name]:.4g}, above data.health.max_{name}={limits[name]:g} "
        f"({measures[name]:.4g} {_WHAT[name]})"
        for scope, measures in scopes
        for name in METRICS
        if measures.get(name) is not None and measures[name] > limits[name]
    ]
    return {"thresholds": limits, "warnings": warnings}


def summary_line(health: dict | None) -> str:
    """One line for a console or a log: the dataset's measures, then its warnings, if any."""
    if not health:
        return "data health: not measured (a dataset prepared before data health existed)"
    measures = ", ".join(f"{name} {value:.4g}" for name, value in health["dataset"].items())
    warnings = health.get("warnings", [])
    found = f"; {len(warnings)} warning(s):\n  " + "\n  ".join(warnings) if warnings else "; no warning"
    return f"data health: {measures}{found}"


def _counts_path(scratch: Path, shard: int) -> Path:
    return scratch / f"health-counts-{shard:06d}.npy"


def _keys_path(scratch: Path, shard: int) -> Path:
    return scratch / f"health-keys-{shard:06d}.npy"


def _positions_path(scratch: Path, shard: int) -> Path:
    return scratch / f"health-positions-{shard:06d}.npy"



def shard_sources(sources: list[DataSource], shards: list[InputShard]) -> list[str]:
    """The source of each input shard, by its name (params/rules.py `source_names`)."""
    names: dict[tuple, str] = {}
    for name, source in zip(source_names(sources), sources):
        for item in list_inputs([source]):
            names.setdefault(_input_key(item), name)
    return [names[_input_key(shard.input)] for shard in shards]


def _input_key(item: InputFile) -> tuple:
    return (str(item.path), item.kind, item.text_field, item.text_unit)
