"""Reading raw documents out of the corpus inputs: JSONL, Parquet, text files and the docstrings of the
Python standard library.

`list_inputs` expands the sources into one `InputFile` per file (globs matched, order kept; the
standard library is one input); `read_input` turns one input into its documents plus a `FileReport` of
malformed records (skipped) and undecodable lines (decoded with replacement characters and kept).
`fingerprint` identifies the inputs by the sha256 of their content (the standard library by its
`stdlib_fingerprint`) so that prepared data is reused exactly while they are unchanged.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from model_core.data.docstrings import file_docstrings, stdlib_dir, stdlib_docstrings, stdlib_fingerprint
from model_core.data.errors import DataPrepError
from model_core.storage import file_sha256
from params.schema import DataSource

_PARAGRAPH_BREAK = re.compile(r"\n(?:[^\S\n]*\n)+")
_JSONL_CHUNK_BYTES = 1 << 18


@dataclass(frozen=True)
class InputFile:
    """One file to read, with how to read it (for python_docstrings: the standard library directory, or
    one of its files)."""

    path: Path
    kind: str
    text_field: str = "text"
    text_unit: str = "file"
    source: int = 0  # its place in data.sources: a row packs the documents of one source


@dataclass
class FileReport:
    """What went wrong while reading one file; line numbers are 1-based (row numbers for Parquet)."""

    path: Path
    records: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)
    undecodable_lines: list[int] = field(default_factory=list)


def list_inputs(sources: list[DataSource]) -> list[InputFile]:
    inputs: list[InputFile] = []
    for index, source in enumerate(sources):
        if source.kind == "python_docstrings":
            inputs.append(InputFile(stdlib_dir(), source.kind, source=index))
            continue
        for pattern in source.paths:
            matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
            files = [Path(match).resolve() for match in matches if Path(match).is_file()]
            if not files:
                what = "matches no file" if glob.has_magic(pattern) else "does not exist or is not a file"
                raise DataPrepError(f"data source kind={source.kind}: {pattern!r} {what}")
            inputs += [InputFile(path, source.kind, source.text_field, source.text_unit, index) for path in files]
    return inputs


def fingerprint(inputs: list[InputFile], contents: dict[Path, str] | None = None) -> str:
    """Hash of every input's identity and content (for the standard library, its `stdlib_fingerprint`);
    `contents` gives content hashes already known by path, the others are hashed here."""
    digest = hashlib.sha256()
    for item in inputs:
        if contents is not None and item.path in contents:
            content = contents[item.path]
        else:
            content = stdlib_fingerprint() if item.path.is_dir() else file_sha256(item.path)
        digest.update(f"{item.kind}\t{item.text_field}\t{item.text_unit}\t{item.path}\t{content}\n".encode())
    return digest.hexdigest()


def read_input(item: InputFile, cache_dir: Path | None = None) -> tuple[list[str], FileReport]:
    """The documents of one input; `cache_dir` holds the extracted standard-library docstrings."""
    report = FileReport(item.path)
    return list(chain.from_iterable(read_input_chunks(item, report, cache_dir))), report


def read_input_chunks(item: InputFile, report: FileReport, cache_dir: Path | None = None) -> Iterator[list[str]]:
    """The documents of one input a chunk at a time, adding to `report` as it goes: JSONL in runs of
    whole lines of about _JSONL_CHUNK_BYTES, so that the first documents are ready long before the last
    line is parsed; other kinds at once."""
    if item.kind == "parquet":
        yield _read_parquet(item.path, item.text_field, report)
    elif item.kind == "jsonl":
        yield from _read_jsonl_chunks(item.path, item.text_field, report)
    else:
        if item.kind == "python_docstrings":
            texts = stdlib_docstrings(cache_dir) if item.path.is_dir() else file_docstrings(item.path)
        else:
            texts = _split_text(_decode(item.path.read_bytes(), report), item.text_unit)
        report.records = len(texts)
        yield texts


def _read_jsonl_chunks(path: Path, text_field: str, report: FileReport) -> Iterator[list[str]]:
    with open(path, "rb") as file:
        yield from read_jsonl_stream(file, text_field, report)


def read_jsonl_stream(
    file: BinaryIO, text_field: str, report: FileReport, limit: int | None = None, first_line: int = 1
) -> Iterator[list[str]]:
    """Runs of whole lines of a binary stream (at most `limit` bytes of it), read as they are needed:
    each parsed by Arrow when it is well formed, else line by line with its problems reported; either
    way the same texts (see `_read_wellformed_jsonl`). Reading the whole input first would delay the
    first run by the time that read takes, page faults included. `first_line` is the line
    number of the stream's first line, for reports."""
    size, rest = _JSONL_CHUNK_BYTES >> 4, b""  # a small first run, so that its documents are ready soon
    left = limit
    while True:
        block = file.read(size if left is None else min(size, left))
        if left is not None:
            left -= len(block)
        data = rest + block
        end = data.rfind(b"\n") + 1 if block else len(data)  # a line longer than the block waits for more
        chunk, rest = data[:end], data[end:]
        if chunk:
            texts = _read_wellformed_jsonl(chunk, text_field)
            if texts is None:
                texts = _read_jsonl(_decode(chunk, report, first_line), text_field, report, first_line)
            else:
                report.records += len(texts)
            yield texts
            first_line += chunk.count(b"\n")
        if not block:
            return
        size = min(2 * size, _JSONL_CHUNK_BYTES)


def _decode(data: bytes, report: FileReport, first_line: int = 1) -> str:
    """UTF-8 text of the file (or of its lines from `first_line` on); lines with invalid bytes are
    reported and decoded with U+FFFD."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    lines = data.split(b"\n")
    for number, line in enumerate(lines, first_line):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            report.undecodable_lines.append(number)
    return data.decode("utf-8", errors="replace")


def _read_wellformed_jsonl(data: bytes, text_field: str) -> list[str] | None:
    """The texts of JSONL lines of which every non-blank one is an object with a string `text_field`,
    parsed by Arrow's native reader; None for any other lines, which `_read_jsonl` then reads one by
    one and reports on.

    Arrow is stricter than Python's json module (raw control characters, duplicate keys, lone
    surrogates, invalid UTF-8 all fail) except on a leading BOM and on several values in one line,
    which are checked here, so whenever this returns texts the line-by-line reader would return the
    same ones and report nothing.
    """
    if data.startswith(codecs.BOM_UTF8):
        return None
    try:
        data.decode("utf-8")  # rejects invalid UTF-8, which Arrow keeps
        lines = _nonblank_lines(data)
        options = pa_json.ParseOptions(
            explicit_schema=pa.schema([(text_field, pa.string())]), unexpected_field_behavior="ignore"
        )
        # One thread: a run of lines is a block or two, and waking Arrow's pool costs more than it gains.
        reading = pa_json.ReadOptions(use_threads=False)
        column = pa_json.read_json(pa.BufferReader(data), reading, options).column(text_field)
    except (UnicodeDecodeError, pa.ArrowException):
        return None
    if len(column) != lines or column.null_count:
        return None
    return column.to_pylist()


def _nonblank_lines(data: bytes) -> int:
    """The lines of UTF-8 `data` that hold more than whitespace; the newlines are found by numpy, in a
    sixth of the time of counting them in the decoded text."""
    chars = np.frombuffer(data, dtype=np.uint8)
    line_starts = np.flatnonzero(chars[:-1] == ord("\n")) + 1
    if len(chars) and chars[0] == ord("{") and (chars[line_starts] == ord("{")).all():
        return len(line_starts) + 1  # every line opens an object (as json.dumps writes them): none is blank
    return sum(1 for line in data.decode("utf-8").split("\n") if line.strip())


def _read_jsonl(text: str, text_field: str, report: FileReport, first_line: int = 1) -> list[str]:
    texts = []
    # Split on \n only: str.splitlines would also break at U+2028 and friends, which JSON allows raw.
    for number, line in enumerate(text.split("\n"), first_line):
        if not line.strip():
            continue
        report.records += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            report.malformed.append((number, f"invalid JSON ({error.msg})"))
            continue
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(record, dict) or text_field not in record:
            report.malformed.append((number, f"no {text_field!r} field"))
        elif not isinstance(value, str):
            report.malformed.append((number, f"{text_field!r} is {type(value).__name__}, not a string"))
        else:
            texts.append(value)
    return texts


def _read_parquet(path: Path, column: str, report: FileReport) -> list[str]:
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as error:
        raise DataPrepError(f"{path}: not a readable Parquet file ({error})") from error
    if column not in schema.names:
        raise DataPrepError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataPrepError(f"{path}: column {column!r} holds {kind}, not strings")
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    report.records = len(values)
    report.malformed += [(row, f"{column!r} is null") for row, value in enumerate(values, 1) if value is None]
    return [value for value in values if value is not None]


def _split_text(text: str, unit: str) -> list[str]:
    if unit == "file":
        parts = [text]
    elif unit == "paragraph":
        parts = _PARAGRAPH_BREAK.split(text)
    else:
        parts = text.split("\n")
    return [part for part in parts if part.strip()]
