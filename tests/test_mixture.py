"""Data mixtures: prep packs each source into rows of its own, the sampler meets the sources' weights over the
run (repeating a source it used up, in a new order), the mixture is refused when the data cannot give it,
and the data position counts samples, so a run resumes under another dp and global batch without repeating
or skipping one."""

import json
import logging

import numpy as np
import pytest
import sentencepiece as spm
from conftest import PARALLEL_RUN, docstring_documents

from model_core.data import open_split, prepare_dataset, read_manifest
from model_core.data.cleaning import clean_text
from model_core.data.mixture import Mixture, MixtureError, MixtureSource, mixture_sources
from model_core.data.permutation import KeyedPermutation
from model_core.train.loader import ShuffledBatches, make_batch
from params import load_params
from params.schema import DataParams, DataSource, ModelParams, TokenizerParams

MODEL = ModelParams(vocab_size=512, seq_len=32)
WEIGHTS = (0.6, 0.3, 0.1)
PAD = TokenizerParams().pad_id


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Three jsonl sources (weights 0.6/0.3/0.1, the last one far too small to fill its share without repeats)
    prepared together; (data params, prep result, each source's cleaned texts)."""
    directory = tmp_path_factory.mktemp("mixture")
    documents = docstring_documents()
    parts = [documents[:35], documents[35:70], documents[70:76]]
    sources = []
    for index, (texts, weight) in enumerate(zip(parts, WEIGHTS)):
        path = directory / f"source{index}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        sources.append(DataSource(kind="jsonl", paths=[str(path)], weight=weight, name=("web", "code", "books")[index]))
    data = DataParams(
        sources=sources, output_dir=str(directory / "out"), near_dup_threshold=None, validation_fraction=0.1,
        rows_per_shard=16, num_workers=1,
    )
    result = prepare_dataset(data, TokenizerParams(), MODEL)
    return data, result, [{clean_text(text) for text in texts} for texts in parts]


def _loader(mixed, global_batch_rows=8, seed=5, rank=0, world=1):
    data, result, _ = mixed
    split = result.manifest["splits"]["train"]
    sources = mixture_sources(data.sources, split, str(result.output_dir))
    return ShuffledBatches(open_split(result.output_dir, "train"), global_batch_rows, seed, rank, world, sources)


def test_each_training_row_holds_documents_of_one_source_and_the_manifest_counts_them(mixed):
    _, result, texts = mixed
    processor = spm.SentencePieceProcessor(model_file=str(result.tokenizer_path))
    for split in ("train", "validation"):
        entry = result.manifest["splits"][split]
        counted = entry["sources"]
        assert [sum(c[key] for c in counted) for key in ("documents", "tokens", "rows")] == [
            entry["documents"], entry["tokens"], entry["rows"]
        ]
    rows = open_split(result.output_dir, "train")
    for index, source in enumerate(result.manifest["splits"]["train"]["sources"]):
        assert source["rows"] > 0
        documents = [np.asarray(processor.encode(text), np.int32).tobytes() for text in texts[index]]
        taken = rows.take(np.arange(source["first_row"], source["first_row"] + source["rows"]))
        for row in range(len(taken)):
            bounds = [*taken.doc_starts(row).tolist(), taken.tokens.shape[1]]
            for start, end in zip(bounds, bounds[1:]):  # each piece of a document the row holds
                piece = taken.tokens[row, start:end]
                piece = piece[(piece != 1) & (piece != 2)].astype(np.int32).tobytes()
                assert any(piece in document for document in documents), f"row {row} of source {index} holds other text"


def test_three_weighted_sources_meet_their_shares_repeat_the_small_one_and_follow_the_seed(mixed):
    steps, batch = 400, 8
    loader = _loader(mixed, batch)
    window_tokens = []  # per step, per source
    rows_read = []
    for _ in range(steps):
        rows = loader.next_rows()
        sources = loader.mixture.rows(loader.last_samples)[1]
        counted = make_batch(rows, PAD, False).loss_mask.sum(axis=1)
        window_tokens.append(np.bincount(sources, weights=counted, minlength=3))
        rows_read.append(rows.tokens)
    tokens = np.sum(window_tokens, axis=0)
    np.testing.assert_allclose(tokens / tokens.sum(), WEIGHTS, atol=0.01)
    window = np.cumsum(np.concatenate([np.zeros((1, 3)), window_tokens]), axis=0)
    for start in range(0, steps - 250, 25):  # every window of 250 steps
        part = window[start + 250] - window[start]
        np.testing.assert_allclose(part / part.sum(), WEIGHTS, atol=0.01)
    consumed = loader.consumed()
    assert consumed["books"][1] > 2 and consumed["web"][1] < consumed["books"][1]  # the small source is repeated
    books = loader.mixture.sources[2]
    rows, sources = loader.mixture.rows(np.arange(steps * batch))
    one, two = rows[sources == 2][: books.rows].tolist(), rows[sources == 2][books.rows : 2 * books.rows].tolist()
    assert sorted(one) == sorted(two) == list(range(books.first_row, books.first_row + books.rows)) and one != two

    again = _loader(mixed, batch)
    for want in rows_read:
        np.testing.assert_array_equal(again.next_rows().tokens, want)
    other = _loader(mixed, batch, seed=6)
    assert not all(np.array_equal(other.next_rows().tokens, want) for want in rows_read[:20])


def test_a_stop_under_dp2_batch16_and_a_resume_under_dp1_batch8_see_every_sample_once(mixed):
    halves = [_loader(mixed, 16, rank=rank, world=2) for rank in (0, 1)]
    seen, tokens = [], []
    for _ in range(7):  # stopped at step 7
        for half in halves:
            tokens.append(half.next_rows().tokens)
            seen.append(half.last_samples)
    state = json.loads(json.dumps(halves[0].state_dict()))  # rank 0 writes it
    resumed = _loader(mixed, 8)
    resumed.load_state_dict(state)
    for _ in range(9):
        tokens.append(resumed.next_rows().tokens)
        seen.append(resumed.last_samples)
    samples = np.concatenate(seen)
    assert sorted(samples.tolist()) == list(range(7 * 16 + 9 * 8))  # every sample id once, none skipped
    straight = _loader(mixed, 8)
    expected = np.concatenate([straight.next_rows().tokens for _ in range(len(samples) // 8)])
    np.testing.assert_array_equal(np.concatenate(tokens), expected)


def test_a_weight_on_a_source_without_rows_is_refused_naming_it(mixed):
    data, result, _ = mixed
    split = json.loads(json.dumps(result.manifest["splits"]["train"]))
    split["sources"][2].update(rows=0, documents=3, tokens=20)
    with pytest.raises(MixtureError, match="data source books has weight 0.1 but no training rows"):
        mixture_sources(data.sources, split, "d")
    unweighted = [source.model_copy(update={"weight": None}) for source in data.sources]
    unweighted[0] = unweighted[0].model_copy(update={"weight": 0.5})
    split["sources"][1]["rows"] = 0
    with pytest.raises(MixtureError, match="data sources code, books .* have no training rows"):
        mixture_sources(unweighted, split, "d")
    with pytest.raises(MixtureError, match="prepared with 3 sources but data.sources lists 2"):
        mixture_sources(data.sources[:2], split, "d")


def test_weights_that_cannot_sum_to_a_mixture_are_refused_with_the_params():
    text = {"kind": "text", "paths": ["a.txt"]}
    with pytest.raises(ValueError, match=r"weights \(web=0.6, code=0.3\) sum to 0.9, not 1"):
        DataParams(sources=[{**text, "name": "web", "weight": 0.6}, {**text, "name": "code", "weight": 0.3}])
    with pytest.raises(ValueError, match="leaving no share for source1"):
        DataParams(sources=[{**text, "weight": 1.0}, {**text, "epochs": 2}])
    with pytest.raises(ValueError, match="weight=0.5 and epochs=2.0 are both set"):
        DataSource(**text, weight=0.5, epochs=2)


def test_epochs_sources_take_their_passes_and_weights_the_rest():
    sources = [
        DataSource(kind="text", paths=["a"], weight=0.5),
        DataSource(kind="text", paths=["b"], epochs=2),
        DataSource(kind="text", paths=["c"]),
    ]
    split = {"sources": [{"rows": 10, "first_row": 0}, {"rows": 30, "first_row": 10}, {"rows": 40, "first_row": 40}]}
    shares = [source.share for source in mixture_sources(sources, split, "d")]
    np.testing.assert_allclose(shares, [0.5, 0.5 * 60 / 100, 0.5 * 40 / 100])
    by_size = [DataSource(kind="text", paths=["a"]), DataSource(kind="text", paths=["b"])]
    np.testing.assert_allclose([s.share for s in mixture_sources(by_size, split | {"sources": split["sources"][:2]}, "d")], [0.25, 0.75])


def test_any_prefix_of_the_stream_keeps_every_source_within_two_samples_of_its_share():
    rng = np.random.default_rng(0)
    for _ in range(5):
        shares = rng.dirichlet(np.ones(5))
        mixture = Mixture([MixtureSource(str(i), 0, 1000, float(share)) for i, share in enumerate(shares)], seed=1)
        _, sources = mixture.rows(np.arange(20_000))
        counts = np.cumsum(np.eye(5)[sources], axis=0)
        expected = np.arange(1, 20_001)[:, None] * np.asarray(mixture.quotas) / mixture.period
        assert np.abs(counts - expected).max() <= 2
        assert mixture.consumed(12_345) == np.bincount(sources[:12_345], minlength=5).tolist()


def test_a_trainer_resumed_under_another_global_batch_continues_at_its_sample_and_says_so(
    single_process, dataset_dir, tmp_path, caplog
):
    from model_core.train.checkpoint import Checkpoint
    from model_core.train.trainer import Trainer

    saved = Checkpoint(single_process["checkpoints"] / "step-00000010", 10).state()["data"]
    assert saved["global_batch_rows"] == 8 and saved["samples"] == 80
    params = load_params("tiny", [*PARALLEL_RUN, "parallel.micro_batches=4", "train.grad_accum_steps=2", "train.steps=12"])
    trainer = Trainer(params, dataset_dir, tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="model_core.train.trainer"):
        result = trainer.run(resume=single_process["checkpoints"] / "step-00000010")
    assert "saved under a global batch of 8 rows, continuing with 16" in caplog.text
    first = result.history[0]
    assert (first["resumed_global_batch_rows_before"], first["resumed_global_batch_rows_after"]) == (8, 16)
    assert "resumed_global_batch_rows_before" not in result.history[1]
    assert trainer.batches.state_dict()["samples"] == 80 + 2 * 16
    assert first["data/source0/tokens_seen"] == (80 + 16) * params.model.seq_len
    assert read_manifest(dataset_dir)["splits"]["train"]["rows"] * result.history[-1]["data/source0/epochs"] == pytest.approx(112)


def test_the_weights_are_not_in_the_datasets_key_but_in_the_runs():
    from model_core.data.prepare import data_params
    from params.identity import training_inputs

    sources = [{"kind": "text", "paths": ["a"], "weight": 0.7}, {"kind": "text", "paths": ["b"], "name": "code"}]
    other = [{**sources[0], "weight": 0.2}, {**sources[1], "epochs": 3}]
    params = [load_params("tiny", [f"data.sources={json.dumps(chosen)}"]) for chosen in (sources, other)]
    assert data_params(params[0].data, params[0].tokenizer, params[0].model) == data_params(params[1].data, params[1].tokenizer, params[1].model)
    assert training_inputs(params[0]) != training_inputs(params[1])


def test_a_continued_run_carries_each_sources_epochs_and_reads_it_in_an_order_not_yet_used(mixed):
    earlier = _loader(mixed)
    for _ in range(100):
        earlier.next_rows()
    read = earlier.state_dict()["epochs"]
    assert 1 < read["books"] < 2  # in its second epoch
    continued = _loader(mixed)
    continued.mixture.carry(read)
    assert continued.consumed()["books"][1] == read["books"]
    books = continued.mixture.sources[2]
    rows, sources = continued.mixture.rows(np.arange(2000))
    first = rows[sources == 2][: books.rows]
    used = [KeyedPermutation(books.rows, (5, 2, epoch)).forward(np.arange(books.rows)) + books.first_row for epoch in (0, 1)]
    assert sorted(first.tolist()) == sorted(used[0].tolist()) and all(not np.array_equal(first, u) for u in used)
    np.testing.assert_array_equal(first, KeyedPermutation(books.rows, (5, 2, 2)).forward(np.arange(books.rows)) + books.first_row)
    resumed = _loader(mixed)
    resumed.load_state_dict(json.loads(json.dumps(continued.state_dict())))
    assert resumed.consumed() == continued.consumed()
