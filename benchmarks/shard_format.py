"""Token shard formats on a prepared dataset: the flat files of model_core/data/shards.py against the zstd
Parquet shards they replaced: size on disk, write time, random-row and sequential read speed, and the
loader's resident memory as the split grows.

The dataset's train split is read once, shard by shard, and written again in each format with the same
rows per shard: flat with uint16 ids (what prep writes for a vocabulary of at most 65,536), flat with int32
ids, and Parquet as llmflow wrote it before (list<int32> columns `tokens` and `doc_starts`, zstd, token ids
byte-stream split, no dictionary; the file hashed after writing). Reads, all from the page cache (warm):

- random batches: `--batches` batches of B uniformly random rows of the split, for B in --batch-rows. Flat:
  `SplitRows.take` (reads those rows). Parquet keeps no row index inside its compressed pages, so a row
  costs decoding the shard holding it: every shard a batch touches is read whole and its rows taken.
- whole split: every row, shard by shard (flat: `read_shards`; Parquet: `pq.read_table` per shard, which
  is how the old loader loaded a split into memory on every rank before training).
- loader memory: in a fresh process, peak RSS after `--loader-batches` batches of `ShuffledBatches` over
  the split, and over a split listing the same shards `--replicas` times (a split that many times larger,
  with no more disk), against the RSS right after imports.

    flock /tmp/cpu.lock python benchmarks/shard_format.py --dataset /path/to/prepared/<key>
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model_core.data import PackedRows, open_split, read_shards, write_shard  # noqa: E402
from model_core.data.shards import MANIFEST_NAME, shard_name, write_manifest  # noqa: E402
from model_core.storage import file_sha256  # noqa: E402

_PARQUET_ENCODINGS = {"tokens.list.element": "BYTE_STREAM_SPLIT"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", type=Path, required=True, help="a prepared dataset directory (manifest.json)")
    parser.add_argument("--batch-rows", default="8,64", help="rows per random batch, comma-separated")
    parser.add_argument("--batches", type=int, default=200, help="random batches timed per batch size")
    parser.add_argument("--loader-batches", type=int, default=2000, help="ShuffledBatches batches in the memory check")
    parser.add_argument("--replicas", type=int, default=80, help="times the split is listed in the larger split")
    args = parser.parse_args()
    manifest = json.loads((args.dataset / MANIFEST_NAME).read_text())
    vocab_size = manifest["vocab_size"]
    pad_id = manifest["tokenizer"]["pad_id"]
    shards = list(read_shards(args.dataset, "train"))
    rows = sum(map(len, shards))
    tokens = sum(int(np.count_nonzero(shard.tokens != pad_id)) for shard in shards)
    print(f"dataset {args.dataset}: train split {rows:,} rows of {shards[0].tokens.shape[1]} tokens in "
          f"{len(shards)} shards, {tokens:,} tokens (vocab {vocab_size})", flush=True)

    work = Path(tempfile.mkdtemp(prefix="shard-format-"))
    try:
        formats = {
            "flat_uint16": _write_flat(shards, work / "flat_uint16", manifest, vocab_size, pad_id),
            "flat_int32": _write_flat(shards, work / "flat_int32", manifest, None, pad_id),
            "parquet_zstd": _write_parquet(shards, work / "parquet_zstd"),
        }
        batch_sizes = [int(size) for size in args.batch_rows.split(",")]
        rng = np.random.default_rng(0)
        batches = {size: [rng.integers(0, rows, size) for _ in range(args.batches)] for size in batch_sizes}
        flat_rows = open_split(work / "flat_uint16", "train")
        for size, indices in batches.items():  # the same rows come back, whatever the format
            for name, figures in formats.items():
                got = flat_rows.take(indices[0]) if name.startswith("flat") else _parquet_take(figures, indices[0])
                assert np.array_equal(got.tokens, _take(shards, indices[0]).tokens), name
        for name, figures in formats.items():
            directory = work / name
            figures["bytes_per_token"] = round(figures["bytes"] / tokens, 3)
            for size, indices in batches.items():
                seconds = _time_random(directory, figures, indices)
                figures[f"random_{size}_rows_ms_per_batch"] = round(1000 * seconds / len(indices), 3)
                figures[f"random_{size}_rows_per_s"] = round(size * len(indices) / seconds)
            started = time.perf_counter()
            if name.startswith("flat"):
                sum(len(part) for part in read_shards(directory, "train"))
            else:
                sum(len(_read_parquet(path)) for path in figures["paths"])
            figures["whole_split_s"] = round(time.perf_counter() - started, 3)
            del figures["paths"]
            figures.pop("first_rows", None)
            print(f"{name}: {json.dumps(figures)}", flush=True)
        memory = {
            "one": _loader_memory(work / "flat_uint16", args.loader_batches, pad_id),
            f"x{args.replicas}": _loader_memory(
                _replicated(work / "flat_uint16", args.replicas), args.loader_batches, pad_id
            ),
        }
        print(f"loader memory: {json.dumps(memory)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"rows": rows, "tokens": tokens, "formats": formats, "loader_memory": memory}))


def _write_flat(shards: list[PackedRows], directory: Path, manifest: dict, vocab_size: int | None, pad_id: int) -> dict:
    directory.mkdir()
    started = time.perf_counter()
    entries = [
        write_shard(directory / shard_name("train", index), shard, pad_id, vocab_size)
        for index, shard in enumerate(shards)
    ]
    seconds = time.perf_counter() - started
    write_manifest(directory, _rows_manifest(manifest, entries))
    paths = [directory / entry["file"] for entry in entries]
    return {"bytes": sum(path.stat().st_size for path in paths), "write_s": round(seconds, 3), "paths": paths}


def _rows_manifest(manifest: dict, entries: list[dict]) -> dict:
    """The dataset's manifest over these train shards, without its tokenizer (not copied: only rows are read)."""
    return {**{key: value for key, value in manifest.items() if key != "tokenizer"}, "splits": {"train": {"shards": entries}}}


def _write_parquet(shards: list[PackedRows], directory: Path) -> dict:
    """The shards as llmflow wrote them up to issue 13, hashed after writing as it did."""
    directory.mkdir()
    started, paths = time.perf_counter(), []
    for index, shard in enumerate(shards):
        path = directory / f"train-{index:05d}.parquet"
        pq.write_table(
            _parquet_table(shard), path, compression="zstd", use_dictionary=False, column_encoding=_PARQUET_ENCODINGS
        )
        file_sha256(path)
        paths.append(path)
    seconds = time.perf_counter() - started
    return {"bytes": sum(path.stat().st_size for path in paths), "write_s": round(seconds, 3), "paths": paths,
            "first_rows": np.cumsum([0] + [len(shard) for shard in shards])}


def _parquet_table(rows: PackedRows) -> pa.Table:
    row_len = rows.tokens.shape[1]
    token_offsets = _arrow(np.arange(len(rows) + 1, dtype=np.int32) * row_len)
    tokens = pa.ListArray.from_arrays(token_offsets, _arrow(rows.tokens.reshape(-1)))
    doc_start_offsets = _arrow(rows.doc_start_offsets.astype(np.int32))
    doc_starts = pa.ListArray.from_arrays(doc_start_offsets, _arrow(rows.doc_start_values))
    return pa.table({"tokens": tokens, "doc_starts": doc_starts})


def _arrow(values: np.ndarray) -> pa.Array:
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _read_parquet(path: Path) -> PackedRows:
    table = pq.read_table(path)
    tokens = table.column("tokens").combine_chunks()
    doc_starts = table.column("doc_starts").combine_chunks()
    row_len = len(tokens.values) // len(tokens)
    return PackedRows(
        tokens.values.to_numpy().reshape(-1, row_len),
        doc_starts.values.to_numpy(),
        doc_starts.offsets.to_numpy().astype(np.int64),
    )


def _parquet_take(figures: dict, indices: np.ndarray) -> PackedRows:
    """The rows at split-wide indices: each shard holding one is decoded whole (no row index inside pages)."""
    first_rows = figures["first_rows"]
    shard_of = np.searchsorted(first_rows, indices, side="right") - 1
    tokens = np.empty((len(indices), 0), np.int32)
    for shard in np.unique(shard_of):
        where = np.flatnonzero(shard_of == shard)
        part = _read_parquet(figures["paths"][shard]).take(indices[where] - first_rows[shard])
        if tokens.shape[1] == 0:
            tokens = np.empty((len(indices), part.tokens.shape[1]), np.int32)
        tokens[where] = part.tokens
    return PackedRows(tokens, np.zeros(0, np.int32), np.zeros(len(indices) + 1, np.int64))


def _take(shards: list[PackedRows], indices: np.ndarray) -> PackedRows:
    first_rows = np.cumsum([0] + [len(shard) for shard in shards])
    shard_of = np.searchsorted(first_rows, indices, side="right") - 1
    tokens = np.stack([shards[shard].tokens[index - first_rows[shard]] for shard, index in zip(shard_of, indices)])
    return PackedRows(tokens, np.zeros(0, np.int32), np.zeros(len(indices) + 1, np.int64))


def _time_random(directory: Path, figures: dict, batches: list[np.ndarray]) -> float:
    if "first_rows" in figures:
        started = time.perf_counter()
        for indices in batches:
            _parquet_take(figures, indices)
        return time.perf_counter() - started
    split = open_split(directory, "train")
    started = time.perf_counter()
    for indices in batches:
        split.take(indices)
    return time.perf_counter() - started


def _replicated(directory: Path, replicas: int) -> Path:
    """A dataset whose train split lists the shards of `directory` `replicas` times over."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    shards = manifest["splits"]["train"]["shards"]
    target = directory.parent / f"{directory.name}_x{replicas}"
    target.mkdir()
    entries = []
    for copy in range(replicas):
        for entry in shards:
            name = f"copy{copy:03d}-{entry['file']}"
            (target / name).symlink_to(directory / entry["file"])
            entries.append({**entry, "file": name})
    write_manifest(target, _rows_manifest(manifest, entries))
    return target


def _loader_memory(directory: Path, batches: int, pad_id: int) -> dict:
    """In a fresh process: RSS after imports, and peak RSS after `batches` batches of 8 rows."""
    script = f"""
import json, resource, sys, time
sys.path.insert(0, {str(REPO)!r})
from model_core.data import open_split
from model_core.train.loader import ShuffledBatches, make_batch
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = rss_mb()
rows = open_split({str(directory)!r}, "train")
loader = ShuffledBatches(rows, global_batch_rows=8, seed=1)
started = time.perf_counter()
for _ in range({batches}):
    make_batch(loader.next_rows(), {pad_id}, True)
seconds = time.perf_counter() - started
print(json.dumps({{"rows": len(rows), "rss_after_imports_mb": round(before, 1), "peak_rss_mb": round(rss_mb(), 1),
                  "ms_per_batch": round(1000 * seconds / {batches}, 3)}}))
"""
    output = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    return json.loads(output.splitlines()[-1])


if __name__ == "__main__":
    main()
