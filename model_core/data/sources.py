"""Reading raw documents out of the corpus inputs: JSONL, Parquet, text files and the docstrings of the
Python standard library.

`list_inputs` expands the sources into one `InputFile` per file (globs matched, order kept);
`read_input` turns one file into its documents plus a `FileReport` of malformed records (skipped) and
undecodable lines (decoded with replacement characters and kept). `fingerprint` identifies the inputs
by path, size and mtime so that prepared data can be reused while they are unchanged.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import inspect
import json
import os
import platform
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from model_core.data.errors import DataPrepError
from params.schema import DataSource

# Directories of the standard library that hold tests, fixtures or third-party packages, not its docs.
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_PARAGRAPH_BREAK = re.compile(r"\n(?:[^\S\n]*\n)+")


@dataclass(frozen=True)
class InputFile:
    """One file to read, with how to read it."""

    path: Path
    kind: str
    text_field: str = "text"
    text_unit: str = "file"


@dataclass
class FileReport:
    """What went wrong while reading one file; line numbers are 1-based (row numbers for Parquet)."""

    path: Path
    records: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)
    undecodable_lines: list[int] = field(default_factory=list)


def list_inputs(sources: list[DataSource]) -> list[InputFile]:
    inputs: list[InputFile] = []
    for source in sources:
        if source.kind == "python_docstrings":
            inputs += [InputFile(path, source.kind) for path in stdlib_files()]
            continue
        for pattern in source.paths:
            matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
            files = [Path(match).resolve() for match in matches if Path(match).is_file()]
            if not files:
                what = "matches no file" if glob.has_magic(pattern) else "does not exist or is not a file"
                raise DataPrepError(f"data source kind={source.kind}: {pattern!r} {what}")
            inputs += [InputFile(path, source.kind, source.text_field, source.text_unit) for path in files]
    return inputs


def stdlib_files() -> list[Path]:
    """The standard library's own .py files in a fixed order, without tests and installed packages."""
    files = []
    for directory, subdirectories, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirectories[:] = [name for name in subdirectories if name not in _STDLIB_SKIPPED_DIRS]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files)


def fingerprint(inputs: list[InputFile]) -> str:
    """Hash of every input's identity, size and mtime (plus the Python version for stdlib docstrings)."""
    digest = hashlib.sha256()
    if any(item.kind == "python_docstrings" for item in inputs):
        digest.update(f"python {platform.python_version()}\n".encode())
    for item in inputs:
        stat = item.path.stat()
        line = f"{item.kind}\t{item.text_field}\t{item.text_unit}\t{item.path}\t{stat.st_size}\t{stat.st_mtime_ns}\n"
        digest.update(line.encode())
    return digest.hexdigest()


def read_input(item: InputFile) -> tuple[list[str], FileReport]:
    report = FileReport(item.path)
    if item.kind == "parquet":
        return _read_parquet(item.path, item.text_field, report), report
    if item.kind == "jsonl":
        return _read_jsonl(_decode(item.path.read_bytes(), report), item.text_field, report), report
    if item.kind == "python_docstrings":
        texts = _read_docstrings(item.path)
    else:
        texts = _split_text(_decode(item.path.read_bytes(), report), item.text_unit)
    report.records = len(texts)
    return texts, report


def _decode(data: bytes, report: FileReport) -> str:
    """UTF-8 text of the file; lines with invalid bytes are reported and decoded with U+FFFD."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            report.undecodable_lines.append(number)
    return data.decode("utf-8", errors="replace")


def _read_jsonl(text: str, text_field: str, report: FileReport) -> list[str]:
    texts = []
    # Split on \n only: str.splitlines would also break at U+2028 and friends, which JSON allows raw.
    for number, line in enumerate(text.split("\n"), 1):
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


def _read_docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in ast.walk order."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []  # a few stdlib files are deliberately invalid (lib2to3 fixtures, bad encodings)
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_NODES):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                texts.append(inspect.cleandoc(docstring))
    return texts
