"""Data health: each measure on constructed rows, the manifest's `health` section of real preps (a corpus of a few
lines repeated thousands of times beside real text; a tokenizer of a few hundred pieces on English text), the
warnings' wording, and thresholds that change the warnings but never the dataset's key."""

import numpy as np
import pytest

from model_core.data import health, prepare_dataset
from params.schema import DataHealthParams, DataParams, DataSource, ModelParams, TokenizerParams

LINES = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the gate.",
    "A journey of a thousand miles begins with a single step taken on a quiet morning.",
    "All that glitters is not gold, and not all those who wander through the hills are lost.",
    "Early to bed and early to rise makes a man healthy, wealthy and wise, or so they say.",
    "Where there is a will there is a way, even when the road is long and the night is cold.",
]

SEQ_LEN = 512  # a row holds the repeated lines several times over
VOCAB = 512


def prepared(tmp_path, sources, vocab_size, **data):
    values = {"output_dir": str(tmp_path / "out"), "validation_fraction": 0.1, "num_workers": 1, **data}  # in this process
    params = DataParams(sources=sources, **values)
    return prepare_dataset(params, TokenizerParams(), ModelParams(vocab_size=vocab_size, seq_len=SEQ_LEN))


@pytest.fixture(scope="module")
def repeated_lines(tmp_path_factory):
    path = tmp_path_factory.mktemp("repeated") / "repeated.txt"
    path.write_text("\n".join(LINES[:3] * 3000) + "\n")
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, corpus_jsonl, repeated_lines):
    """Real docstrings (source0) beside three lines repeated 3,000 times (source1), neither deduplicated."""
    sources = [
        DataSource(kind="jsonl", paths=[str(corpus_jsonl)]),
        DataSource(kind="text", paths=[str(repeated_lines)], text_unit="line"),
    ]
    return prepared(tmp_path_factory.mktemp("mixed"), sources, VOCAB, dedup_exact=False, near_dup_threshold=None)


def test_repeated_ngrams_count_the_repeats_inside_each_row_only():
    periodic = np.tile(np.arange(5), 20)[None, :]  # 100 ids, period 5: every 4-gram after the first five repeats
    distinct = np.arange(100)[None, :]
    assert health.repeated_ngrams(periodic, 4) == (97, 92)
    assert health.repeated_ngrams(distinct, 4) == (97, 0)
    assert health.repeated_ngrams(np.concatenate([distinct, distinct]), 4) == (194, 0)  # equal rows: no repeat within


def test_the_longest_run_stays_inside_a_row_and_skips_padding():
    rows = np.array([[5, 7, 7, 7], [7, 7, 3, 3], [9, 3, 3, 3]])
    assert health.longest_id_run(rows, pad_id=3) == 3  # the 7s of row 0 (the next row's 7s are a run of their own)
    assert health.longest_id_run(np.array([[3, 3, 3, 3, 4]]), pad_id=3) == 1


def save_rows(directory, name, rows, positions):
    """A shard's band keys and positions, as `measure_shard` saves them."""
    np.save(directory / f"{name}-keys.npy", health.row_band_keys(rows, 5))
    np.save(directory / f"{name}-positions.npy", np.asarray(positions, dtype=np.int64))
    return directory / f"{name}-keys.npy", directory / f"{name}-positions.npy"


def test_near_copies_count_rows_that_repeat_a_row_earlier_in_the_split_across_shards(tmp_path):
    rng = np.random.default_rng(0)
    rows = rng.integers(4, 500, size=(40, 64))
    copied = rows[:10].copy()
    copied[:, :3] = 1  # ten near copies (3 of 64 ids changed) of rows 0-9
    # Shard 0 holds rows 0-24 at positions 10-34; shard 1 holds rows 25-39 at 35-49 and the copies at 0-9, first.
    first = save_rows(tmp_path, "first", rows[:25], range(10, 35))
    second = save_rows(tmp_path, "second", np.concatenate([rows[25:], copied]), [*range(35, 50), *range(10)])
    assert health.near_copies([first[0], second[0]], [first[1], second[1]], tmp_path) == [10, 0]
    unrelated = save_rows(tmp_path, "unrelated", rng.integers(4, 500, size=(40, 64)), [*range(10), *range(35, 65)])
    assert health.near_copies([first[0], unrelated[0]], [first[1], unrelated[1]], tmp_path) == [0, 0]


def test_the_merge_holds_a_partition_of_the_keys_at_a_time(tmp_path, monkeypatch):
    rows = np.random.default_rng(1).integers(4, 500, size=(30, 64))
    keys, positions = save_rows(tmp_path, "shard", np.concatenate([rows, rows[:7]]), range(37))
    monkeypatch.setattr(health, "PARTITION_BYTES", 256)  # dozens of partitions: the same rows found
    assert health.near_copies([keys], [positions], tmp_path) == [7]


def test_a_measure_above_its_threshold_is_one_line_with_the_number_the_threshold_and_the_source():
    measures = dict.fromkeys(health.METRICS, 0.0) | {"longest_id_run": 0}
    section = {
        "dataset": measures | {"fertility": 0.9},
        "sources": {"source0": measures, "source1": measures | {"fertility": 1.5}},
    }
    judged = health.judge(section, DataHealthParams(max_fertility=0.5))
    assert judged["thresholds"]["fertility"] == 0.5
    assert judged["warnings"] == [
        "data health: the dataset has fertility=0.9, above data.health.max_fertility=0.5 (0.9 tokens per character: "
        "the tokenizer cuts this text into small pieces (a vocabulary too small, or trained on other text))",
        "data health: source 'source1' has fertility=1.5, above data.health.max_fertility=0.5 (1.5 tokens per "
        "character: the tokenizer cuts this text into small pieces (a vocabulary too small, or trained on other text))",
    ]
    single = {"dataset": section["sources"]["source1"], "sources": {"source0": section["sources"]["source1"]}}
    assert len(health.judge(single, DataHealthParams())["warnings"]) == 1  # one source: not again for the dataset


def test_repetition_is_measured_per_source_and_warned_with_its_source(mixed):
    section = mixed.manifest["health"]
    assert set(section) == {"dataset", "sources", "thresholds", "warnings"}
    assert set(section["sources"]) == {"source0", "source1"}
    for measures in (section["dataset"], *section["sources"].values()):
        assert tuple(measures) == health.METRICS
    real, repeated = section["sources"]["source0"], section["sources"]["source1"]
    assert repeated["repeated_ngram_rate"] > 0.6 and repeated["near_copy_row_share"] > 0.9
    assert real["repeated_ngram_rate"] < 0.3 and real["near_copy_row_share"] < 0.05
    warned = [line for line in section["warnings"] if "source1" in line]
    assert any("repeated_ngram_rate=" in line and "max_repeated_ngram_rate=0.5" in line for line in warned)
    assert any("near_copy_row_share=" in line for line in warned)
    assert not [line for line in section["warnings"] if "source0" in line and ("ngram" in line or "near_copy" in line)]


def test_thresholds_change_the_warnings_but_not_the_dataset(tmp_path_factory, mixed, corpus_jsonl, repeated_lines):
    sources = [
        DataSource(kind="jsonl", paths=[str(corpus_jsonl)]),
        DataSource(kind="text", paths=[str(repeated_lines)], text_unit="line"),
    ]
    lenient = DataHealthParams(**{f"max_{name}": 1.0 for name in health.METRICS if name != "longest_id_run"})
    params = DataParams(
        sources=sources, output_dir=str(mixed.output_dir.parent), validation_fraction=0.1, dedup_exact=False,
        near_dup_threshold=None, num_workers=1, health=lenient,
    )
    again = prepare_dataset(params, TokenizerParams(), ModelParams(vocab_size=VOCAB, seq_len=SEQ_LEN))
    assert again.reused and again.output_dir == mixed.output_dir
    assert health.judge(again.manifest["health"], lenient)["warnings"] == []


def test_a_tokenizer_of_a_few_hundred_pieces_on_english_text_is_warned_about(tmp_path, corpus_jsonl):
    small = prepared(tmp_path, [DataSource(kind="jsonl", paths=[str(corpus_jsonl)])], 400)
    section = small.manifest["health"]
    assert section["dataset"]["fertility"] > 0.6  # a tokenizer of 4096 pieces gives 0.29 on the stdlib docstrings
    assert [line for line in section["warnings"] if "fertility=" in line and "source 'source0'" in line]


def test_the_summary_line_gives_the_measures_and_the_warnings(mixed):
    line = health.summary_line(mixed.manifest["health"])
    assert line.startswith("data health: fertility ")
    assert "warning(s)" in line and "source1" in line
    assert "not measured" in health.summary_line(None)


def test_the_section_is_the_same_however_the_corpus_is_cut_into_shards(tmp_path, mixed, corpus_jsonl, repeated_lines):
    sources = [
        DataSource(kind="jsonl", paths=[str(corpus_jsonl)]),
        DataSource(kind="text", paths=[str(repeated_lines)], text_unit="line"),
    ]
    cut = prepared(tmp_path, sources, VOCAB, dedup_exact=False, near_dup_threshold=None, shard_bytes=1 << 14)
    assert cut.report["reuse"]["input_shards"] > 4
    assert cut.manifest["health"] == mixed.manifest["health"]


def test_the_data_prep_stage_records_the_health_line_judged_by_this_runs_thresholds(mixed, mlflow_uri, capsys):
    from mlflow.tracking import MlflowClient

    from params import load_params
    from tasks.data import health_of, record_health
    from tasks.tracking import StageRun

    client = MlflowClient(mlflow_uri)
    run = client.create_run(client.create_experiment("data-health"))
    lenient = load_params("tiny", ["data.health.max_fertility=1", "data.health.max_near_copy_row_share=1"])
    section = health_of(mixed.manifest, lenient)
    record_health(StageRun(client, run.info.run_id), section)
    printed = capsys.readouterr().out
    assert printed.startswith("data health: fertility ") and "near_copy_row_share=" not in printed
    assert "repeated_ngram_rate=" in printed  # still above the tiny preset's 0.5
    assert client.get_run(run.info.run_id).data.tags["llmflow.data_health_warnings"] == str(len(section["warnings"]))
    assert open(client.download_artifacts(run.info.run_id, "data_health.txt")).read() == printed
