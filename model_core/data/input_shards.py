"""The corpus cut into input shards: the unit of work of data prep's map steps.

An uncompressed JSONL file, or a text file read a line a document, larger than data.shard_bytes is cut
into byte ranges of about that size, each ending at a line end (found by reading a few bytes at each
cut, never the file). A Parquet file is cut between row groups. A compressed JSONL file (.gz, .zst),
any other text file and the standard library's docstrings are one shard each: they cannot be entered in
the middle. A shard is read a chunk of documents at a time, so a map task holds one shard at most.

Reports of bad records give line numbers in the whole file: a shard counts its own lines, and only when
it has something to report does it count the lines of the file before it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from model_core.data.errors import DataPrepError
from model_core.data.sources import FileReport, InputFile, read_input_chunks, read_jsonl_stream

_COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_LINE_SEARCH_BYTES = 1 << 16


@dataclass(frozen=True)
class InputShard:
    """A part of one input: bytes [start, stop) of a file (stop None: to the end), or row groups
    [start, stop) of a Parquet file."""

    input: InputFile
    start: int = 0
    stop: int | None = None
    content_sha256: str = ""  # of the whole file, so a cached result is reused only for the same bytes

    @property
    def name(self) -> str:
        part = "" if self.start == 0 and self.stop is None else f"[{self.start}:{self.stop}]"
        return f"{self.input.path}{part}"

    def identity(self) -> str:
        """What decides this shard's documents: the file's content and where in it the shard lies."""
        fields = [self.input.kind, self.input.text_field, self.input.text_unit, self.start, self.stop]
        return hashlib.sha256(json.dumps([*fields, self.content_sha256]).encode()).hexdigest()


def compression(path: Path) -> str | None:
    return _COMPRESSED.get(path.suffix.lower())


def plan_shards(inputs: list[InputFile], shard_bytes: int, content_sha256: dict[Path, str]) -> list[InputShard]:
    """Every input's shards, in corpus order."""
    shards: list[InputShard] = []
    for item in inputs:
        base = InputShard(item, content_sha256=content_sha256.get(item.path, ""))
        if item.kind == "parquet":
            shards += [replace(base, start=a, stop=b) for a, b in _row_group_ranges(item.path, shard_bytes)]
        elif _splits_at_lines(item) and item.path.stat().st_size > shard_bytes:
            shards += [replace(base, start=a, stop=b) for a, b in _line_ranges(item.path, shard_bytes)]
        else:
            shards.append(base)
    return shards


def read_shard(shard: InputShard, report: FileReport, cache_dir: Path | None) -> Iterator[list[str]]:
    """The documents of one shard a chunk at a time, adding to `report` as it goes."""
    item = shard.input
    if item.kind == "parquet":
        yield _read_row_groups(shard, report)
    elif item.kind == "jsonl":
        with _open(item.path) as file:
            if shard.start:
                file.seek(shard.start)
            limit = None if shard.stop is None else shard.stop - shard.start
            yield from read_jsonl_stream(file, item.text_field, report, limit)
    elif shard.start or shard.stop is not None:  # text, a line a document
        with open(item.path, "rb") as file:
            file.seek(shard.start)
            data = file.read(shard.stop - shard.start)
        texts = [line for line in _decode_lines(data, report) if line.strip()]
        report.records += len(texts)
        yield texts
    else:
        yield from read_input_chunks(item, report, cache_dir)
    if shard.start and item.kind != "parquet" and (report.malformed or report.undecodable_lines):
        _shift_lines(report, _lines_before(item.path, shard.start))


def _splits_at_lines(item: InputFile) -> bool:
    if compression(item.path) is not None:
        return False
    return item.kind == "jsonl" or (item.kind == "text" and item.text_unit == "line")


def _open(path: Path):
    codec = compression(path)
    return pa.input_stream(str(path), compression=codec) if codec else open(path, "rb")


def _line_ranges(path: Path, shard_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about `shard_bytes`, each starting at a line start."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as file:
        while cuts[-1] + shard_bytes < size:
            cut = _next_line_start(file, cuts[-1] + shard_bytes, size)
            if cut >= size:
                break
            cuts.append(cut)
    return list(zip(cuts, [*cuts[1:], size]))


def _next_line_start(file, position: int, size: int) -> int:
    """The first line start at or after `position` > 0 (a line starts after a newline); size when none."""
    file.seek(position - 1)
    while position < size:
        block = file.read(_LINE_SEARCH_BYTES)
        if not block:
            break
        found = block.find(b"\n")
        if found >= 0:
            return position + found
        position += len(block)
    return size


def _row_group_ranges(path: Path, shard_bytes: int) -> list[tuple[int, int]]:
    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException) as error:
        raise DataPrepError(f"{path}: not a readable Parquet file ({error})") from error
    ranges, first, size = [], 0, 0
    for group in range(metadata.num_row_groups):
        size += metadata.row_group(group).total_byte_size
        if size >= shard_bytes:
            ranges.append((first, group + 1))
            first, size = group + 1, 0
    if first < metadata.num_row_groups or not ranges:
        ranges.append((first, metadata.num_row_groups))
    return ranges


def _read_row_groups(shard: InputShard, report: FileReport) -> list[str]:
    path, column = shard.input.path, shard.input.text_field
    try:
        file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise DataPrepError(f"{path}: not a readable Parquet file ({error})") from error
    schema = file.schema_arrow
    if column not in schema.names:
        raise DataPrepError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataPrepError(f"{path}: column {column!r} holds {kind}, not strings")
    groups = range(shard.start, file.metadata.num_row_groups if shard.stop is None else shard.stop)
    first_row = sum(file.metadata.row_group(group).num_rows for group in range(shard.start))
    values = file.read_row_groups(list(groups), columns=[column]).column(column).to_pylist()
    report.records += len(values)
    report.malformed += [(first_row + row, f"{column!r} is null") for row, value in enumerate(values, 1) if value is None]
    return [value for value in values if value is not None]


def _decode_lines(data: bytes, report: FileReport) -> list[str]:
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = data.split(b"\n")
        texts = []
        for number, line in enumerate(lines, 1):
            try:
                texts.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                report.undecodable_lines.append(number)
                texts.append(line.decode("utf-8", errors="replace"))
        return texts


def _lines_before(path: Path, offset: int) -> int:
    count = 0
    with open(path, "rb") as file:
        while offset > 0:
            block = file.read(min(offset, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def _shift_lines(report: FileReport, lines: int) -> None:
    report.malformed[:] = [(line + lines, reason) for line, reason in report.malformed]
    report.undecodable_lines[:] = [line + lines for line in report.undecodable_lines]


def file_identity(path: Path) -> str:
    """Path, size, mtime and inode: a file whose identity is unchanged keeps its cached content hash."""
    stat = path.stat()
    return f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\t{stat.st_ino}"
