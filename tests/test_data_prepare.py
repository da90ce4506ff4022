"""prepare_dataset end to end: shards, manifest, determinism, reuse, damage, bad input and failures, and the
map -> reduce -> map steps against a one-pass reference (the same result whatever the shards and workers)."""

import gzip
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from model_core.data import DataPrepError, dedup, open_split, prepare, prepare_dataset, read_shards
from model_core.data.cleaning import clean_text
from model_core.data.docstrings import stdlib_files
from model_core.data.identity import InputDigest, split_identities
from model_core.data.packing import pack_documents
from model_core.data.permutation import KeyedPermutation
from model_core.data.shard_map import is_validation, text_hashes
from model_core.data.sources import InputFile, read_input
from model_core.storage import file_sha256
from params.schema import DataParams, DataSource, ModelParams, TokenizerParams

MODEL = ModelParams(vocab_size=512, seq_len=256)
TOKENIZER = TokenizerParams()


@pytest.fixture(scope="module")
def documents():
    """Distinct real documents (stdlib docstrings), long enough to pass the default filters."""
    files = [path for path in stdlib_files() if path.name in {"argparse.py", "pathlib.py", "textwrap.py", "csv.py"}]
    texts = [text for path in files for text in read_input(InputFile(path, "python_docstrings"))[0]]
    return list(dict.fromkeys(text for text in texts if len(clean_text(text)) >= 64))


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


@pytest.fixture
def corpus(tmp_path, documents):
    return write_jsonl(tmp_path / "corpus.jsonl", documents)


def params(tmp_path, corpus, **overrides):
    values = {
        "sources": [DataSource(kind="jsonl", paths=[str(corpus)])],
        "output_dir": str(tmp_path / "out"),
        "validation_fraction": 0.2,
        "rows_per_shard": 16,
        "near_dup_threshold": None,
    }
    return DataParams(**{**values, **overrides})


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
    assert not result.reused and result.output_dir.parent == (tmp_path / "out").resolve()
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
            assert file_sha256(result.output_dir / shard["file"]) == shard["sha256"]
    assert file_sha256(result.tokenizer_path) == manifest["tokenizer"]["sha256"]
    cleaned = {clean_text(text) for text in documents}
    found = complete_documents(result, "train") + complete_documents(result, "validation")
    assert len(found) > len(documents) / 3 and set(found) <= cleaned


def test_the_split_is_decided_by_each_documents_keyed_hash(tmp_path, corpus, documents):
    result = prepare_dataset(params(tmp_path, corpus, validation_fraction=0.3), TOKENIZER, MODEL)
    train, validation = complete_documents(result, "train"), complete_documents(result, "validation")
    assert validation and train and not set(train) & set(validation)
    held_out = result.manifest["splits"]["validation"]["documents"]
    kept = result.manifest["counts"]["kept_documents"]
    assert abs(held_out - 0.3 * kept) < 4 * (0.3 * 0.7 * kept) ** 0.5  # a binomial share of the documents
    data = params(tmp_path, corpus, validation_fraction=0.3)
    expected = is_validation(text_hashes([clean_text(text) for text in documents]), data)
    assert held_out == int(expected.sum())
    assert set(validation) <= {clean_text(text) for text, flag in zip(documents, expected) if flag}


def test_two_runs_write_identical_shards(tmp_path, corpus):
    first = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "a")), TOKENIZER, MODEL)
    second = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "b")), TOKENIZER, MODEL)
    assert first.manifest_path.read_bytes() == second.manifest_path.read_bytes()


def test_an_unchanged_request_is_reused_and_any_change_recomputes(tmp_path, corpus):
    data = params(tmp_path, corpus)
    first = prepare_dataset(data, TOKENIZER, MODEL)
    shard = first.output_dir / first.manifest["splits"]["train"]["shards"][0]["file"]
    written = shard.stat().st_mtime_ns
    again = prepare_dataset(data, TOKENIZER, MODEL)
    assert shard.stat().st_mtime_ns == written
    assert again.reused and again.output_dir == first.output_dir and again.manifest == first.manifest
    for how in ({"num_workers": 1}, {"shard_bytes": 1 << 13}):
        assert prepare_dataset(data.model_copy(update=how), TOKENIZER, MODEL).reused

    other_param = prepare_dataset(data.model_copy(update={"min_chars": 100}), TOKENIZER, MODEL)
    other_model = prepare_dataset(data, TOKENIZER, ModelParams(vocab_size=512, seq_len=32))
    corpus.write_text(corpus.read_text() + json.dumps({"text": "A new document. " * 10}) + "\n")
    other_input = prepare_dataset(data, TOKENIZER, MODEL)
    results = [other_param, other_model, other_input]
    assert not any(result.reused for result in results)
    assert len({first.output_dir, *(result.output_dir for result in results)}) == 4
    # A dataset's digests change with the rows it holds, and only with them (not with a new input that the filters
    # drop, or a document dropped from the tail that packing leaves out anyway).
    for result in results:
        digests = [[identity.digest for identity in split_identities(r.output_dir)] for r in (first, result)]
        rows = [[shard["sha256"] for split in r.manifest["splits"].values() for shard in split["shards"]] for r in (first, result)]
        assert (digests[0] == digests[1]) == (rows[0] == rows[1])
    assert split_identities(other_model.output_dir)[0].digest != split_identities(first.output_dir)[0].digest


def test_a_damaged_shard_is_rebuilt_with_a_warning(tmp_path, corpus, caplog):
    data = params(tmp_path, corpus)
    first = prepare_dataset(data, TOKENIZER, MODEL)
    shard = first.output_dir / first.manifest["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING):
        rebuilt = prepare_dataset(data, TOKENIZER, MODEL)
    assert not rebuilt.reused and "damaged" in caplog.text and shard.name in caplog.text
    assert file_sha256(shard) == first.manifest["splits"]["train"]["shards"][0]["sha256"]
    datasets = [path.name for path in (tmp_path / "out").iterdir() if not path.name.startswith(".")]
    assert datasets == [first.output_dir.name]


def test_a_given_tokenizer_is_used_and_its_size_checked(tmp_path, corpus):
    trained = prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL)
    given = TokenizerParams(model_path=str(trained.tokenizer_path))
    reused_tokenizer = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "b")), given, MODEL)
    assert not reused_tokenizer.manifest["tokenizer"]["trained"]
    assert reused_tokenizer.manifest["splits"] == trained.manifest["splits"]
    with pytest.raises(DataPrepError, match="has 512 pieces but model.vocab_size=640"):
        prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "c")), given, ModelParams(vocab_size=640))
    assert [path for path in (tmp_path / "c").iterdir() if not path.name.startswith(".")] == []


def test_the_tokenizer_trains_on_a_bounded_sample_of_training_lines(tmp_path, corpus):
    small = TokenizerParams(training_sentences=300)
    one = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "a")), small, MODEL)
    split = prepare_dataset(params(tmp_path, corpus, output_dir=str(tmp_path / "b"), shard_bytes=1 << 13), small, MODEL)
    assert one.manifest["tokenizer"]["sha256"] == split.manifest["tokenizer"]["sha256"]
    assert one.manifest["tokenizer"]["sha256"] != prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL).manifest[
        "tokenizer"
    ]["sha256"]


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


def test_a_bad_line_deep_in_a_large_file_is_reported_with_its_line_from_any_worker(tmp_path, documents):
    lines = [json.dumps({"text": text}) for text in documents]
    bad = len(lines) - 7
    lines[bad] = '{"text": 12}'
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes("\n".join(lines).encode() + b'\n{"text": "bad \xff' + b" padding" * 10 + b'"}\n')
    data = params(tmp_path, corpus, max_bad_record_fraction=0.05, shard_bytes=1 << 13, num_workers=2)
    result = prepare_dataset(data, TOKENIZER, MODEL)
    assert result.report["reuse"]["input_shards"] >= 3
    assert result.manifest["bad_records"] == [
        f"{corpus}:{bad + 1}: 'text' is int, not a string",
        f"{corpus}:{len(lines) + 1}: undecodable bytes replaced",
    ]


def test_too_many_bad_records_stop_the_run_and_leave_nothing(tmp_path, corpus):
    lines = corpus.read_text().splitlines()
    lines[:10] = ["not json"] * 10
    corpus.write_text("\n".join(lines))
    message = rf"10 of {len(lines)} records \(.*%\) are malformed, more than data.max_bad_record_fraction=0.01"
    with pytest.raises(DataPrepError, match=message):
        prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL)
    assert [path for path in (tmp_path / "out").iterdir() if not path.name.startswith(".")] == []


def test_an_empty_corpus_after_filtering_stops_the_run(tmp_path, corpus):
    with pytest.raises(DataPrepError, match=r"no document is left .*too_short=\d+"):
        prepare_dataset(params(tmp_path, corpus, min_chars=10**6, max_chars=10**7), TOKENIZER, MODEL)


def test_a_missing_input_stops_the_run(tmp_path):
    data = params(tmp_path, tmp_path / "missing.jsonl")
    with pytest.raises(DataPrepError, match="missing.jsonl"):
        prepare_dataset(data, TOKENIZER, MODEL)


def test_filters_and_dedup_are_counted_per_reason_across_shards(tmp_path, documents):
    long_doc = documents[0] * 30
    # 354 words: one word changed in place keeps the token-shingle Jaccard near 0.97.
    word = re.compile(r"\S+")
    hundredth = list(word.finditer(documents[9]))[100]
    near_copy = documents[9][: hundredth.start()] + "changed" + documents[9][hundredth.end() :]
    texts = [documents[1], "short", "\x00\x01", long_doc, documents[9]] + documents[10:60] + [near_copy, documents[1]]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    data = params(tmp_path, corpus, near_dup_threshold=0.9, max_chars=len(clean_text(long_doc)) - 1)
    whole = prepare_dataset(data, TOKENIZER, MODEL).manifest
    assert whole["counts"]["dropped"] == {
        "empty": 1,
        "too_short": 1,
        "too_long": 1,
        "exact_duplicate": 1,
        "near_duplicate": 1,
    }
    assert whole["counts"]["kept_documents"] == len(texts) - 5
    assert [step["out"] for step in whole["steps"]] == [len(texts) - 1, len(texts) - 2, len(texts) - 3, len(texts) - 4, len(texts) - 5]
    # The repeat and the near copy sit in other shards than their originals.
    sharded = prepare_dataset(data.model_copy(update={"shard_bytes": 1 << 13, "output_dir": str(tmp_path / "b")}), TOKENIZER, MODEL)
    assert sharded.report["reuse"]["input_shards"] >= 3
    assert sharded.manifest == whole


def test_progress_is_reported_per_stage(tmp_path, corpus):
    calls = []
    prepare_dataset(params(tmp_path, corpus), TOKENIZER, MODEL, progress=lambda *call: calls.append(call))
    last_call = {stage: (done, total) for stage, done, total in calls}
    assert {"sample", "map", "pack", "write"} <= set(last_call)
    assert all(done == total for done, total in last_call.values())


def test_the_workers_start_while_a_new_input_is_hashed_and_not_on_a_reuse(tmp_path, corpus):
    steps = []

    def recording_mapper(step, function, jobs):
        steps.append((step, len(jobs)))
        return list(map(function, jobs))

    data = params(tmp_path, corpus, shard_bytes=1 << 13, num_workers=2)
    first = prepare_dataset(data, TOKENIZER, MODEL, mapper=recording_mapper)
    assert steps[:2] == [("start workers", 2), ("hash inputs", 1)]
    steps.clear()
    assert prepare_dataset(data, TOKENIZER, MODEL, mapper=recording_mapper).reused
    assert steps == [("hash inputs", 0)]
    steps.clear()
    one_shard = params(tmp_path, corpus, output_dir=str(tmp_path / "one"), num_workers=2)
    assert prepare_dataset(one_shard, TOKENIZER, MODEL, mapper=recording_mapper).manifest["splits"] == first.manifest["splits"]
    assert "start workers" not in [step for step, _ in steps]  # one shard maps in this process


def test_progress_lines_give_rates_and_an_eta_as_map_results_land_not_when_the_mapper_returns_them(
    tmp_path, corpus, caplog, monkeypatch
):
    # A batched mapper (Prefect's, a Ray cluster's) returns a batch's results only when the whole batch is
    # done; progress must move while the batch runs, and count each job once when the batch comes back.
    monkeypatch.setattr(prepare, "_PROGRESS_POLL_SECONDS", 0.01)
    monkeypatch.setattr(prepare, "_PROGRESS_LOG_SECONDS", 0.0)
    counted = {"map": 0}
    before_return, map_results = [], []

    def progress(stage, done, total):
        counted[stage] = done

    def one_batch_mapper(step, function, jobs):
        results = []
        for job in jobs:
            results.append(function(job))
            if step == "map":
                deadline = time.monotonic() + 30
                while counted["map"] < len(results) and time.monotonic() < deadline:
                    time.sleep(0.005)
                before_return.append(counted["map"])
        if step == "map":
            map_results.extend(results)
        return results

    data = params(tmp_path, corpus, shard_bytes=1 << 13)
    with caplog.at_level(logging.INFO, logger="model_core.data.prepare"):
        prepare_dataset(data, TOKENIZER, MODEL, progress=progress, mapper=one_batch_mapper)
    assert len(before_return) >= 3 and before_return == list(range(1, len(before_return) + 1))
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("map:")]
    counts = [int(re.match(r"map: (\d+)/", line).group(1)) for line in lines]
    assert counts == sorted(counts) and counts[-1] == len(before_return)
    # A poll may log "map: 0/N" before the first job lands (every poll logs here, and a busy machine is slow to
    # finish a job): the first line that counts one is the one to read.
    first = lines[counts.index(1)]
    assert re.search(r"map: 1/\d+ jobs, [\d,]+ documents \([\d,]+/s\), [\d,]+ tokens \([\d,]+/s\), [\d.]+ MB read", first)
    assert "ETA" in first and "ETA" not in lines[-1]
    map_documents = int(re.search(r"([\d,]+) documents", lines[-1]).group(1).replace(",", ""))
    assert map_documents == sum(r["documents"] for r in map_results)  # each job counted once


def reference_dataset(texts, data, processor):
    """The dataset's rows computed in one pass over the whole corpus in memory: clean, filter, exact dedup
    (first occurrence kept), split by keyed hash, tokenize, near dedup over all documents in corpus order,
    pack each split's documents in corpus order, put stream row forward(p) at position p (one source: the
    training rows are shuffled within its range, keyed by the source too)."""
    cleaned = [clean_text(text) for text in texts]
    kept = [text for text in cleaned if data.min_chars <= len(text) <= data.max_chars]
    kept = list(dict.fromkeys(kept))
    ids = [np.asarray(processor.encode(text), dtype=np.int32) for text in kept]
    lengths = np.array([len(i) for i in ids])
    token_ids = np.concatenate(ids)
    signatures = dedup.minhash_signatures(token_ids, lengths, data.shingle_words, data.minhash_permutations)
    near = dedup.near_duplicate_mask(signatures, data.near_dup_threshold)
    validation = is_validation(text_hashes(kept), data)
    splits = {}
    for split, chosen in (("train", ~validation & ~near), ("validation", validation & ~near)):
        rows = pack_documents(token_ids, lengths, MODEL.seq_len + 1, 1, 2, 3, data.last_row, np.flatnonzero(chosen))
        key = (data.shuffle_seed, 1, 0) if split == "train" else (data.shuffle_seed, 2)
        order = KeyedPermutation(len(rows), key).forward(np.arange(len(rows), dtype=np.uint64))
        splits[split] = rows.take(order.astype(np.int64))
    return splits, int(near.sum())


@pytest.mark.parametrize("last_row, partitioned", [("drop", False), ("pad", True)])
def test_sharded_prep_equals_a_one_pass_reference(tmp_path, documents, last_row, partitioned, monkeypatch):
    if partitioned:  # several dedup partitions and write buckets, as a corpus far larger than this one has
        monkeypatch.setattr(prepare.global_dedup, "PARTITION_BYTES", 2000)
        monkeypatch.setattr(prepare.row_shuffle, "BUCKET_TOKENS", 16 * (MODEL.seq_len + 1))
    texts = documents + documents[5:40:3]  # repeats across shards
    edited = [text.replace("the", "a", 1) for text in documents[60:90]]  # near copies
    corpus = write_jsonl(tmp_path / "c.jsonl", texts + edited)
    data = params(tmp_path, corpus, near_dup_threshold=0.8, shard_bytes=1 << 13, last_row=last_row, num_workers=2)
    result = prepare_dataset(data, TOKENIZER, MODEL)
    processor = spm.SentencePieceProcessor(model_file=str(result.tokenizer_path))
    expected, near = reference_dataset(texts + edited, data, processor)
    assert result.report["reuse"]["input_shards"] >= 4 and result.manifest["counts"]["dropped"]["near_duplicate"] == near > 0
    if partitioned:
        timings = json.loads((result.output_dir / prepare.REPORT_NAME).read_text())["jobs"]
        assert timings["exact dedup"] > 1 and timings["near dedup"] > 1
        assert len(result.manifest["splits"]["train"]["shards"]) > prepare.row_shuffle.shards_per_bucket(16, MODEL.seq_len + 1)
    for split, rows in expected.items():
        written = open_split(result.output_dir, split).take(np.arange(len(rows)))
        assert len(open_split(result.output_dir, split)) == len(rows)
        np.testing.assert_array_equal(written.tokens, rows.tokens)
        np.testing.assert_array_equal(written.doc_start_values, rows.doc_start_values)
        np.testing.assert_array_equal(written.doc_start_offsets, rows.doc_start_offsets)


def test_one_worker_and_two_worker_processes_write_byte_identical_manifests(tmp_path, documents):
    halves = [write_jsonl(tmp_path / "a.jsonl", documents[::2]), write_jsonl(tmp_path / "b.jsonl", documents[1::2])]
    data = params(tmp_path, halves[0], sources=[DataSource(kind="jsonl", paths=[str(path) for path in halves])])
    manifests = []
    for workers in (1, 2):
        update = {"num_workers": workers, "output_dir": str(tmp_path / f"w{workers}"), "shard_bytes": 1 << 13}
        manifests.append(prepare_dataset(data.model_copy(update=update), TOKENIZER, MODEL).manifest_path.read_bytes())
    assert manifests[0] == manifests[1]


def test_compressed_jsonl_and_parquet_row_groups_give_the_same_documents(tmp_path, documents):
    plain = write_jsonl(tmp_path / "c.jsonl", documents)
    compressed = tmp_path / "c.jsonl.gz"
    compressed.write_bytes(gzip.compress(plain.read_bytes()))
    zstd = tmp_path / "c.jsonl.zst"
    with pa.CompressedOutputStream(str(zstd), "zstd") as sink:
        sink.write(plain.read_bytes())
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": documents}), parquet, row_group_size=40)
    splits, digests = [], set()
    for path, kind in ((plain, "jsonl"), (compressed, "jsonl"), (zstd, "jsonl"), (parquet, "parquet")):
        data = params(tmp_path, plain, sources=[DataSource(kind=kind, paths=[str(path)])], shard_bytes=1 << 13)
        result = prepare_dataset(data.model_copy(update={"output_dir": str(tmp_path / f"out-{path.name}")}), TOKENIZER, MODEL)
        splits.append(result.manifest["splits"])
        if kind == "parquet":
            assert result.report["reuse"]["input_shards"] > 1
        # The same content from other files, in another directory: the same digests; the source names the file.
        identities = split_identities(result.output_dir)
        digests.add(tuple(identity.digest for identity in identities))
        assert identities[0].inputs == (InputDigest(str(path.resolve()), file_sha256(path)),)
    assert all(entry == splits[0] for entry in splits[1:])
    assert len(digests) == 1


def test_a_run_after_a_new_file_maps_only_that_file_and_equals_a_fresh_run(tmp_path, documents):
    first, second = write_jsonl(tmp_path / "a.jsonl", documents[:80]), tmp_path / "b.jsonl"
    pattern = str(tmp_path / "*.jsonl")
    data = params(tmp_path, first, sources=[DataSource(kind="jsonl", paths=[pattern])], shard_bytes=1 << 13)
    before = prepare_dataset(data, TOKENIZER, MODEL).report
    write_jsonl(second, documents[80:] + documents[:3])  # new documents and repeats of old ones
    grown = prepare_dataset(data, TOKENIZER, MODEL)
    fresh = prepare_dataset(data.model_copy(update={"output_dir": str(tmp_path / "fresh")}), TOKENIZER, MODEL)
    assert grown.report["reuse"]["map_shards_reused"] == before["reuse"]["input_shards"]
    assert grown.report["reuse"]["input_shards"] > grown.report["reuse"]["map_shards_reused"]
    assert fresh.report["reuse"]["map_shards_reused"] == 0
    assert grown.manifest["counts"]["dropped"]["exact_duplicate"] == 3
    assert grown.manifest_path.read_bytes() == fresh.manifest_path.read_bytes()


def test_a_killed_prep_leaves_no_final_directory_and_a_rerun_finishes_it(tmp_path, corpus, monkeypatch):
    data = params(tmp_path, corpus, shard_bytes=1 << 13, num_workers=1)
    marker = tmp_path / "packing"
    script = f"""
import time
from pathlib import Path
from model_core.data import prepare, row_shuffle
from params.schema import DataParams, ModelParams, TokenizerParams
def stall(job):
    Path({str(marker)!r}).touch()
    time.sleep(600)
prepare.row_shuffle.pack_shards = stall
prepare.prepare_dataset(DataParams.model_validate_json({data.model_dump_json()!r}), TokenizerParams(), ModelParams(**{MODEL.model_dump()!r}))
"""
    process = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the prep never reached packing"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    output = tmp_path / "out"
    assert [path for path in output.iterdir() if not path.name.startswith(".")] == []
    result = prepare_dataset(data, TOKENIZER, MODEL)
    assert result.report["reuse"]["map_shards_reused"] == result.report["reuse"]["input_shards"]
    assert [path.name for path in output.iterdir() if not path.name.startswith(".")] == [result.output_dir.name]
    assert [path.name for path in output.iterdir() if ".building-" in path.name] == []
    assert "tokenizer_peak_rss_bytes" not in result.report  # a sample this small trains in the prep process
    # The fresh build trains its tokenizer in a child process; this process's trainer must not run.
    monkeypatch.setattr(prepare, "TRAIN_HERE_LINES", 0)
    monkeypatch.setattr(prepare, "train_tokenizer", lambda *args: pytest.fail("trained in the prep process"))
    fresh = prepare_dataset(data.model_copy(update={"output_dir": str(tmp_path / "fresh")}), TOKENIZER, MODEL)
    assert fresh.report["reuse"]["map_shards_reused"] == 0 and fresh.report["tokenizer_peak_rss_bytes"] > 10 * 2**20
    # Built from cached map results or from nothing, its tokenizer trained here or apart, the same content: the
    # same manifest, byte for byte.
    assert result.manifest_path.read_bytes() == fresh.manifest_path.read_bytes()


def test_reuse_checks_shard_sizes_and_on_request_their_sha256(tmp_path, corpus):
    data = params(tmp_path, corpus)
    first = prepare_dataset(data, TOKENIZER, MODEL)
    shard = first.output_dir / first.manifest["splits"]["train"]["shards"][0]["file"]
    damaged = bytearray(shard.read_bytes())
    damaged[-1] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(damaged))
    assert prepare_dataset(data, TOKENIZER, MODEL).reused
    assert prepare.verify_dataset(first.output_dir, full=True) == f"{shard.name} does not match its sha256 in the manifest"
    rebuilt = prepare_dataset(data.model_copy(update={"verify_on_reuse": "sha256"}), TOKENIZER, MODEL)
    assert not rebuilt.reused and rebuilt.output_dir == first.output_dir
    assert file_sha256(shard) == first.manifest["splits"]["train"]["shards"][0]["sha256"]
    # The manifest is always checked, against manifest.sha256: a changed byte there is found by either check.
    manifest = rebuilt.manifest_path
    manifest.write_bytes(manifest.read_bytes().replace(b'"seq_len": 256', b'"seq_len": 257'))
    for full in (False, True):
        assert prepare.verify_dataset(first.output_dir, full=full).startswith(f"{manifest} has sha256 ")
