"""Reading the corpus inputs: formats, globs, the stdlib docstrings and their cache, bad records, and
change detection."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from model_core.data import docstrings
from model_core.data.docstrings import stdlib_docstrings, stdlib_files
from model_core.data.errors import DataPrepError
from model_core.data.sources import InputFile, fingerprint, list_inputs, read_input
from params.schema import DataSource


def read(path, kind, **options):
    return read_input(InputFile(path, kind, **options))


def test_jsonl_reads_the_configured_field(tmp_path):
    path = tmp_path / "a.jsonl"
    records = [{"body": "first", "text": "no"}, {"body": "second\u2028line"}]
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")
    texts, report = read(path, "jsonl", text_field="body")
    assert texts == ["first", "second\u2028line"]
    assert report.records == 2 and not report.malformed


def test_malformed_jsonl_records_are_reported_with_their_line_and_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = ['{"text": "good"}', "{not json", '{"other": "x"}', '{"text": 5}', "[1, 2]", '{"text": "also good"}']
    path.write_text("\n".join(lines))
    texts, report = read(path, "jsonl")
    assert texts == ["good", "also good"]
    assert report.records == 6
    assert [line for line, _ in report.malformed] == [2, 3, 4, 5]
    reasons = [reason for _, reason in report.malformed]
    assert "invalid JSON" in reasons[0] and "no 'text' field" in reasons[1] and "int, not a string" in reasons[2]


def test_undecodable_bytes_are_reported_by_line_and_replaced(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    texts, report = read(path, "jsonl")
    assert texts == ["ok", "caf\ufffd"]
    assert report.undecodable_lines == [2] and not report.malformed


def test_parquet_reads_the_text_column_and_reports_nulls(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": ["one", None, "three"], "id": [1, 2, 3]}), path)
    texts, report = read(path, "parquet", text_field="content")
    assert texts == ["one", "three"]
    assert report.records == 3 and report.malformed == [(2, "'content' is null")]


def test_parquet_without_the_text_column_names_file_and_column(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(DataPrepError, match=r"docs\.parquet: no column 'text' \(columns: body\)"):
        read(path, "parquet")


@pytest.mark.parametrize(
    ("unit", "expected"),
    [
        ("file", ["Para one\nstill one.\n\n \nPara two.\n"]),
        ("paragraph", ["Para one\nstill one.", "Para two.\n"]),
        ("line", ["Para one", "still one.", "Para two."]),
    ],
)
def test_text_units(tmp_path, unit, expected):
    path = tmp_path / "doc.txt"
    path.write_text("Para one\nstill one.\n\n \nPara two.\n")
    texts, report = read(path, "text", text_unit=unit)
    assert texts == expected and report.records == len(expected)


def test_globs_expand_in_sorted_order_across_sources(tmp_path):
    for name in ["b.txt", "a.txt", "c.md"]:
        (tmp_path / name).write_text(name)
    sources = [
        DataSource(kind="text", paths=[str(tmp_path / "*.txt")]),
        DataSource(kind="text", paths=[str(tmp_path / "c.md")], text_unit="line"),
    ]
    inputs = list_inputs(sources)
    assert [item.path.name for item in inputs] == ["a.txt", "b.txt", "c.md"]
    assert inputs[2].text_unit == "line"


@pytest.mark.parametrize("pattern", ["missing.jsonl", "*.nothing"])
def test_missing_files_and_empty_globs_stop_the_run(tmp_path, pattern):
    source = DataSource(kind="jsonl", paths=[str(tmp_path / pattern)])
    with pytest.raises(DataPrepError, match=pattern.replace("*", r"\*")):
        list_inputs([source])


def test_stdlib_docstrings_are_real_text_without_tests_or_site_packages():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any({"test", "tests", "site-packages"} & set(path.parts) for path in files)
    json_init = next(path for path in files if path.parts[-2:] == ("json", "__init__.py"))
    texts, report = read(json_init, "python_docstrings")
    assert texts[0].startswith("JSON (JavaScript Object Notation)")
    assert report.records == len(texts) > 3
    assert all(text == text.strip() for text in texts)


def test_fingerprint_changes_with_content_and_not_without(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    inputs = [InputFile(path, "text")]
    first = fingerprint(inputs)
    assert fingerprint(inputs) == first
    path.write_text("one two")
    assert fingerprint(inputs) != first


def test_an_edit_that_keeps_size_and_mtime_still_changes_the_fingerprint(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n')
    stat = path.stat()
    first = fingerprint([InputFile(path, "jsonl")])
    path.write_text('{"text": "two"}\n')
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert fingerprint([InputFile(path, "jsonl")]) != first


def test_the_standard_library_is_one_input_read_through_the_cache(tmp_path, monkeypatch):
    (item,) = list_inputs([DataSource()])
    assert item.kind == "python_docstrings" and item.path.is_dir()
    few = [path for path in stdlib_files() if path.name in {"csv.py", "textwrap.py"}]
    monkeypatch.setattr(docstrings, "stdlib_files", lambda: few)
    texts, report = read_input(item, cache_dir=tmp_path)
    assert texts and report.records == len(texts)
    (cache,) = tmp_path.iterdir()
    assert cache.suffix == ".parquet"
    monkeypatch.setattr(docstrings, "file_docstrings", lambda path: pytest.fail("parsed despite the cache"))
    assert stdlib_docstrings(tmp_path) == texts


def test_a_damaged_docstring_cache_is_rebuilt(tmp_path, monkeypatch, caplog):
    few = [path for path in stdlib_files() if path.name == "csv.py"]
    monkeypatch.setattr(docstrings, "stdlib_files", lambda: few)
    texts = stdlib_docstrings(tmp_path)
    (cache,) = tmp_path.iterdir()
    cache.write_bytes(b"not parquet")
    assert stdlib_docstrings(tmp_path) == texts and "unreadable" in caplog.text
    assert [path.name for path in tmp_path.iterdir()] == [cache.name]
