"""prepare_dataset end to end: shards, manifest, determinism, reuse, damage, bad input and failures."""

import json
import logging
import multiprocessing
import re
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from model_core.data import DataPrepError, prepare, prepare_dataset, read_shards
from model_core.data.cleaning import clean_text
from model_core.data.docstrings import stdlib_files
from model_core.data.shards import file_sha256
from model_core.data.sources import InputFile, read_input
from params.schema import DataParams, DataSource, ModelParams, TokenizerParams

MODEL = ModelParams(vocab_size=512, seq_len=256)
TOKENIZER = TokenizerParams()


@pytest.fixture(scope="module")
def documents():
    """Distinct real documents (stdlib docstrings), long enough to pass the default filters."""
    files = [path for path in stdlib_files() if path.name in {"argparse.py", "pathlib.py", "textwrap.py", "csv.py"}]
    texts = [text for path in files for text in read_input(InputFile(path, "python_docstrings"))[0]]
    return list(dict.fromkeys(text for text in texts if len(clean_text(text)) >= 64))


@pytest.fixture
def corpus(tmp_path, documents):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return path


def params(tmp_path, corpus, **overrides):
    values = {
        "sources": [DataSource(kind="jsonl", paths=[str(corpus)])],
        "output_dir": str(tmp_path / "out"),
        "validation_fraction": 0.2,
        "rows_per_shard": 16,
        "near_dup_threshold": None,
    }
    return DataParams(**{**values, **overrides})


class SpyContexts:
    """Stands in for multiprocessing.get_context and records which start methods were asked for."""

    def __init__(self):
        self.methods = []
        self.real = multiprocessing.get_context

    def __call__(self, method):
        self.methods.append(method)
        return self.real(method)


def complete_documents(result, split):
    """Texts of every document that starts and ends inside one row of the split."""
    processor = spm.SentencePieceProcessor(model_file=str(result.tokenizer_path))
    texts = []
    for shard in read_shards(result.output_dir, split):
        for row in range(len(shard)):
            tokens = shard.tokens[row]
            for start in shard.doc_starts(row):
                ends = np.flatnonzero(tokens[start:] == TOKENIZER.eos_id)
                if tokens[start] == TOKENIZER.bos_id and len(ends):
                    texts.append(processor.decode(tokens[start + 1 : start + ends[0]].tolist()))
    return texts


def test_shards_hold_the_encoded_documents_and_match_the_manifest(tmp_path, corpus, documents):
    result = prepare_dataset(params(tmp_path, corpus, last_row="pad"), TOKENIZER, MODEL)
    manifest = result.manifest
    assert not result.reused and result.output_dir.parent == tmp_path / "out"
    assert manifest["counts"]["kept_documents"] == len(documents)
    processor = spm.SentencePieceProcessor(model_file=str(result.tokenizer_path))
    expected_tokens = sum(len(processor.encode(clean_text(text))) + 2 for text in documents)
    assert sum(manifest["splits"][split]["packed_tokens"] for split in ("train", "validation")) == expected_tokens
    for split, entry in manifest["splits"].items():
        rows = list(read_shards(result.output_dir, split))
        assert [len(shard) for shard in rows] == [shard["rows"] for shard in entry["shards"]]
        assert all(len(shard) <= 16 for shard in rows) and sum(map(len, rows)) == entry["rows"]
        assert all(shard.tokens.shape[1] == MODEL.seq_len + 1 for shard in rows)
        for shard in entry["shards"]:
            path = result.output_dir / shard["file"]
            assert file_sha256(path) == shard["sha256"]
            assert pq.read_schema(path).names == ["tokens", "doc_starts"]
            assert "BYTE_STREAM_SPLIT" in pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    assert file_sha256(result.tokenizer_path) == manifest["tokenizer"]["sha256"]
    cleaned = {clean_text(text) for text in documents}
    found = complete_documents(result, "train") + complete_documents(result, "validation")
    assert len(found) > len(documents) / 3 and set(found) <= cleaned


def test_no_document_is_in_both_splits(tmp_path, corpus):
    result = prepare_dataset(params(tmp_path, corpus, validation_fraction=0.3), TOKENIZER, MODEL)
    train, validation = complete_documents(result, "train"), complete_documents(result, "validation")
    assert validation and train and not set(train) & set(validation)
    counts = result.manifest["splits"]
    assert counts["validation"]["documents"] == round(0.3 * result.manifest["counts"]["kept_documents"])


def test_two_runs_write_identical_shards(tmp_path, corpus):
    first = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "a")), TOKENIZER, MODEL).manifest
    second = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "b")), TOKENIZER, MODEL).manifest
    assert first["splits"] == second["splits"] and first["tokenizer"]["sha256"] == second["tokenizer"]["sha256"]
    assert first["key"] == second["key"]


def test_an_unchanged_request_is_reused_and_any_change_recomputes(tmp_path, corpus):
    data = params(tmp_path, corpus)
    first = prepare_dataset(data, TOKENIZER, MODEL)
    shard = first.output_dir / first.manifest["splits"]["train"]["shards"][0]["file"]
    written = shard.stat().st_mtime_ns
    again = prepare_dataset(data, TOKENIZER, MODEL)
    assert shard.stat().st_mtime_ns == written
    assert again.reused and again.output_dir == first.output_dir and again.manifest == first.manifest
    assert prepare_dataset(data.model_copy(update={"num_workers": 1}), TOKENIZER, MODEL).reused

    other_param = prepare_dataset(data.model_copy(update={"min_chars": 100}), TOKENIZER, MODEL)
    other_model = prepare_dataset(data, TOKENIZER, ModelParams(vocab_size=512, seq_len=32))
    corpus.write_text(corpus.read_text() + json.dumps({"text": "A new document. " * 10}) + "\n")
    other_input = prepare_dataset(data, TOKENIZER, MODEL)
    results = [other_param, other_model, other_input]
    assert not any(result.reused for result in results)
    assert len({first.output_dir, *(result.output_dir for result in results)}) == 4


def test_a_damaged_shard_is_rebuilt_with_a_warning(tmp_path, corpus, caplog):
    data = params(tmp_path, corpus)
    first = prepare_dataset(data, TOKENIZER, MODEL)
    shard = first.output_dir / first.manifest["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING):
        rebuilt = prepare_dataset(data, TOKENIZER, MODEL)
    assert not rebuilt.reused and "damaged" in caplog.text and shard.name in caplog.text
    assert file_sha256(shard) == first.manifest["splits"]["train"]["shards"][0]["sha256"]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [first.output_dir.name]


def test_a_given_tokenizer_is_used_and_its_size_checked(tmp_path, corpus):
    trained = prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL)
    given = TokenizerParams(model_path=str(trained.tokenizer_path))
    reused_tokenizer = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "b")), given, MODEL)
    assert not reused_tokenizer.manifest["tokenizer"]["trained"]
    assert reused_tokenizer.manifest["splits"] == trained.manifest["splits"]
    with pytest.raises(DataPrepError, match="has 512 pieces but model.vocab_size=640"):
        prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "c")), given, ModelParams(vocab_size=640))
    assert list((tmp_path / "c").iterdir()) == []


def test_bad_records_below_the_threshold_are_reported_and_skipped(tmp_path, corpus, caplog):
    lines = corpus.read_text().splitlines()
    lines[3] = "{broken json"
    corpus.write_bytes("\n".join(lines).encode() + b'\n{"text": "undecodable \xff byte ' + b"padding " * 10 + b'"}\n')
    with caplog.at_level(logging.WARNING):
        result = prepare_dataset(params(tmp_path, corpus, max_bad_record_fraction=0.05), TOKENIZER, MODEL)
    counts = result.manifest["counts"]
    assert counts["malformed"] == 1 and counts["undecodable"] == 1 and counts["records"] == len(lines) + 1
    assert result.manifest["bad_records"][0].startswith(f"{corpus}:4: invalid JSON")
    assert f"{corpus}:{len(lines) + 1}: undecodable" in result.manifest["bad_records"][1]
    assert f"{corpus}:4" in caplog.text


def test_too_many_bad_records_stop_the_run_and_leave_nothing(tmp_path, corpus):
    lines = corpus.read_text().splitlines()
    lines[:10] = ["not json"] * 10
    corpus.write_text("\n".join(lines))
    message = rf"10 of {len(lines)} records \(.*%\) are malformed, more than data.max_bad_record_fraction=0.01"
    with pytest.raises(DataPrepError, match=message):
        prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL)
    assert list((tmp_path / "out").iterdir()) == []


def test_an_empty_corpus_after_filtering_stops_the_run(tmp_path, corpus):
    with pytest.raises(DataPrepError, match=r"no document is left .*too_short=\d+"):
        prepare_dataset(params(tmp_path, corpus, min_chars=10**6, max_chars=10**7), TOKENIZER, MODEL)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_missing_input_stops_the_run(tmp_path):
    data = params(tmp_path, tmp_path / "missing.jsonl")
    with pytest.raises(DataPrepError, match="missing.jsonl"):
        prepare_dataset(data, TOKENIZER, MODEL)


def test_filters_and_dedup_are_counted_per_reason(tmp_path, documents):
    long_doc = documents[0] * 30
    # 354 words: one word changed in place keeps the token-shingle Jaccard near 0.97.
    word = re.compile(r"\S+")
    hundredth = list(word.finditer(documents[9]))[100]
    near_copy = documents[9][: hundredth.start()] + "changed" + documents[9][hundredth.end() :]
    texts = [documents[1], documents[1], "short", "\x00\x01", long_doc, documents[9], near_copy] + documents[10:60]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    data = params(tmp_path, corpus, near_dup_threshold=0.9, max_chars=len(clean_text(long_doc)) - 1)
    counts = prepare_dataset(data, TOKENIZER, MODEL).manifest["counts"]
    assert counts["dropped"] == {
        "empty": 1,
        "too_short": 1,
        "too_long": 1,
        "exact_duplicate": 1,
        "near_duplicate": 1,
    }
    assert counts["kept_documents"] == len(texts) - 5


def test_progress_is_reported_per_stage(tmp_path, corpus):
    calls = []
    prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL, progress=lambda *call: calls.append(call))
    last_call = {stage: (done, total) for stage, done, total in calls}
    assert {"read", "filter and dedup", "tokenize", "write train", "write validation"} <= set(last_call)
    assert all(done == total for done, total in last_call.values())


def test_several_large_files_are_read_in_spawned_workers_with_the_same_result(tmp_path, documents, monkeypatch):
    halves = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path, part in zip(halves, (documents[::2], documents[1::2])):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in part))
    data = params(tmp_path, halves[0], sources=[DataSource(kind="jsonl", paths=[str(path) for path in halves])])
    serial = prepare_dataset(data.model_copy(update={"output_dir": str(tmp_path / "serial")}), TOKENIZER, MODEL)
    monkeypatch.setattr(prepare, "_PARALLEL_READ_BYTES", 0)
    contexts = SpyContexts()
    monkeypatch.setattr(prepare.multiprocessing, "get_context", contexts)
    parallel = prepare_dataset(data.model_copy(update={"num_workers": 2}), TOKENIZER, MODEL)
    assert contexts.methods == ["spawn"]
    assert parallel.manifest["splits"] == serial.manifest["splits"]


def test_streaming_in_tiny_chunks_gives_the_same_dataset(tmp_path, corpus, monkeypatch):
    from model_core.data import dedup, sources

    lines = corpus.read_text().splitlines()
    lines[5] = "{broken json"
    near_copy = json.dumps({"text": json.loads(lines[11])["text"] + " One more sentence at the end."})
    corpus.write_text("\n".join([*lines, lines[7], lines[9], near_copy]) + "\n")  # a bad line, repeats, a near copy
    trained = prepare_dataset(
        params(tmp_path, corpus, max_bad_record_fraction=0.05, near_dup_threshold=0.8), TOKENIZER, MODEL
    )
    given = TokenizerParams(model_path=str(trained.tokenizer_path))
    streamed = prepare_dataset(
        params(tmp_path, corpus, max_bad_record_fraction=0.05, near_dup_threshold=0.8, output_dir=str(tmp_path / "b")),
        given,
        MODEL,
    )
    monkeypatch.setattr(sources, "_JSONL_CHUNK_BYTES", 300)
    monkeypatch.setattr(prepare, "_CLEAN_CHUNK_DOCS", 3)
    monkeypatch.setattr(prepare, "_ENCODE_BATCH_DOCS", 5)
    monkeypatch.setattr(dedup, "_MAX_PAIRS_PER_DOCUMENT", 0)  # near dedup by its bucket loop, not candidate pairs
    calls = []
    tiny = prepare_dataset(
        params(tmp_path, corpus, max_bad_record_fraction=0.05, near_dup_threshold=0.8, output_dir=str(tmp_path / "c")),
        given,
        MODEL,
        progress=lambda stage, done, total: calls.append((stage, done, total)),
    )
    assert tiny.manifest["splits"] == streamed.manifest["splits"] == trained.manifest["splits"]
    assert tiny.manifest["counts"] == trained.manifest["counts"]
    assert trained.manifest["counts"]["dropped"]["exact_duplicate"] == 2
    assert trained.manifest["counts"]["dropped"]["near_duplicate"] == 1 and trained.manifest["counts"]["malformed"] == 1
    _, done, total = [call for call in calls if call[0] == "read and tokenize"][-1]
    assert done == total


def test_writing_shards_does_not_import_pandas(tmp_path):
    # pa.array(ndarray) imports pandas on its first call (175 ms, once per process); shards need no pandas.
    script = f"""
import sys
import numpy as np
from model_core.data.packing import pack_documents
from model_core.data.shards import write_shards
rows = pack_documents(np.arange(4, 100, dtype=np.int32), np.array([40, 56]), 17, 1, 2, 3, "pad")
write_shards(rows, __import__("pathlib").Path({str(tmp_path)!r}), "train", 2, 3)
assert "pandas" not in sys.modules, "writing shards imported pandas"
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    assert len(list(tmp_path.glob("train-*.parquet"))) == 3
