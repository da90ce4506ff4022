"""Instruction data for LoRA: records, the template and its loss mask, masked packing and shards,
prepare_instructions (reports, reuse, split) and the bundled set."""

import io
import itertools
import json
import logging

import numpy as np
import pytest
import sentencepiece as spm

from model_core.data import DataPrepError, PackedRows, open_split, prepare_instructions, read_shards
from model_core.data.docstrings import stdlib_files
from model_core.data.instruction_set import MIN_OUTPUT_CHARS, bundled_records
from model_core.data.instructions import Record, TemplateEncoder, Turn, parse_records, render_prompt
from model_core.data.packing import first_fit_rows, pack_documents, pack_examples
from model_core.data.shards import write_manifest, write_shards
from model_core.data.sources import InputFile, read_input
from model_core.data.tokenizer import train_tokenizer
from model_core.train.loader import make_batch
from params.schema import DataParams, LoraParams, ModelParams, TokenizerParams

VOCAB = 512
TOKENIZER = TokenizerParams()
BOS, EOS, PAD = TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.pad_id
MODEL = ModelParams(vocab_size=VOCAB, seq_len=128)


@pytest.fixture(scope="module")
def docstrings():
    files = [path for path in stdlib_files() if path.name in {"argparse.py", "textwrap.py", "csv.py", "pathlib.py"}]
    return [text for path in files for text in read_input(InputFile(path, "python_docstrings"))[0]]


@pytest.fixture(scope="module")
def tokenizer_model(docstrings):
    return train_tokenizer(docstrings, TOKENIZER, VOCAB, seed=0, num_threads=1)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, tokenizer_model):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
    path.write_bytes(tokenizer_model)
    return path


@pytest.fixture(scope="module")
def processor(tokenizer_model):
    return spm.SentencePieceProcessor(model_proto=tokenizer_model)


@pytest.fixture(scope="module")
def alpaca_lines(docstrings):
    """Alpaca records made of real docstring sentences, every third one with an input."""
    paragraphs = [" ".join(text.split("\n\n")[0].split()) for text in docstrings]
    paragraphs = [text for text in dict.fromkeys(paragraphs) if 20 <= len(text) <= 120]
    lines = []
    for index, text in enumerate(paragraphs):
        record = {"instruction": f"Explain item {index} of the documentation.", "output": text}
        if index % 3 == 0:
            record["input"] = f"item {index}"
        lines.append(json.dumps(record))
    return lines


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def data_params(tmp_path, **overrides):
    return DataParams(**{"output_dir": str(tmp_path / "out"), "validation_fraction": 0.1, "rows_per_shard": 8, **overrides})


def encode(tokenizer_model, records):
    return TemplateEncoder(tokenizer_model, LoraParams(), BOS, EOS, num_threads=1).encode(records)


def runs(mask):
    """(start, end) of each run of ones."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


# ------------------------------------------------------------------------------------ template and masks


def test_the_prompt_follows_the_documented_template():
    lora = LoraParams()
    assert render_prompt("Sort it.", "", lora) == "### Instruction:\nSort it.\n\n### Response:\n"
    assert render_prompt("Sort it.", "3 1 2", lora) == "### Instruction:\nSort it.\n\n### Input:\n3 1 2\n\n### Response:\n"
    custom = LoraParams(instruction_header="Q:", input_header="Given:", response_header="A:")
    assert render_prompt("Why?", "x", custom) == "Q:\nWhy?\n\nGiven:\nx\n\nA:\n"


@pytest.mark.parametrize("input_text", ["", "a list of three numbers, 3 1 2"])
def test_the_mask_covers_exactly_the_response_and_its_eos(tokenizer_model, processor, input_text):
    turn = Turn("Explain what `sorted` returns.", input_text, "Return a new list containing all items in ascending order.")
    ids, lengths, mask = encode(tokenizer_model, [Record("t:1", (turn,))])
    prompt = render_prompt(turn.instruction, turn.input, LoraParams())
    assert lengths.tolist() == [len(ids)] and mask.dtype == np.int8 and len(mask) == len(ids)
    assert ids.tolist() == [BOS, *processor.encode(prompt + turn.response), EOS]
    [(start, end)] = runs(mask)
    assert end == len(ids) and ids[-1] == EOS
    assert ids[0] == BOS and processor.decode(ids[1:start].tolist()) == prompt
    assert processor.decode(ids[start : end - 1].tolist()) == turn.response
    assert ids[1:start].tolist() == processor.encode(prompt)  # what a prompt given at inference encodes to


def test_a_conversation_trains_on_every_assistant_turn(tokenizer_model, processor, tmp_path):
    messages = [
        {"role": "user", "content": "What does `csv.reader` return?"},
        {"role": "assistant", "content": "A reader object that iterates over lines of the file."},
        {"role": "user", "content": "And `csv.writer`?"},
        {"role": "assistant", "content": "A writer object that converts data into delimited strings."},
    ]
    records, report = parse_records(tmp_path / "chat.jsonl", json.dumps({"messages": messages}).encode())
    assert not report.malformed and len(records[0].turns) == 2
    ids, lengths, mask = encode(tokenizer_model, records)
    assert lengths.tolist() == [len(ids)]
    responses = [processor.decode(ids[start : end - 1].tolist()) for start, end in runs(mask)]
    assert responses == [messages[1]["content"], messages[3]["content"]]
    assert [int(ids[end - 1]) for _, end in runs(mask)] == [EOS, EOS]
    second_turn = runs(mask)[0][1]
    assert ids[second_turn] == BOS and processor.decode(ids[second_turn + 1 : runs(mask)[1][0]].tolist()) == (
        render_prompt(messages[2]["content"], "", LoraParams())
    )


def bad_tokenizer(docstrings) -> bytes:
    """A SentencePiece model trained on text with raw newlines and no "\\n" piece of its own: it learns
    pieces such as ".\\n\\n###" that span the template's boundaries."""
    lines = [line.strip() for text in docstrings for line in text.split("\n") if line.strip()]
    sentences = [f"{a}\n\n### Response:\n{b}" for a, b in itertools.pairwise(lines)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=VOCAB, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        num_threads=1, minloglevel=2,
    )
    return model.getvalue()


def test_a_separator_that_merges_with_its_neighbour_stops_the_run(docstrings, tokenizer_model, tmp_path):
    record = Record("chat.jsonl:7", (Turn("Explain this.", "", "Return the value."),))
    with pytest.raises(DataPrepError) as caught:
        encode(bad_tokenizer(docstrings), [record])
    message = str(caught.value)
    assert message.startswith("chat.jsonl:7: the template separator lora.response_header ('\\n\\n### Response:\\n')")
    assert "tokenizes as ['\\n\\n###', '▁Response', ':\\n'] alone but as ['.\\n\\n###', '▁Response', ':\\n']" in message
    encode(tokenizer_model, [record])  # the same template with a tokenizer that keeps "\n" apart


# -------------------------------------------------------------------------------------------- records


def test_bad_records_are_reported_with_file_and_line(tmp_path):
    lines = [
        json.dumps({"instruction": "Say hi.", "output": "Hi."}),
        "{not json",
        json.dumps({"instruction": "Say hi."}),
        json.dumps({"instruction": "Say hi.", "input": 3, "output": "Hi."}),
        json.dumps({"messages": [{"role": "assistant", "content": "Hi."}]}),
        json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}),
        json.dumps(["instruction", "output"]),
        json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": ""}]}),
    ]
    path = write(tmp_path / "mixed.jsonl", lines)
    records, report = parse_records(path, path.read_bytes())
    assert [record.source for record in records] == [f"{path}:1"] and report.records == 8
    assert report.malformed == [
        (2, "invalid JSON (Expecting property name enclosed in double quotes)"),
        (3, "no 'output' field"),
        (4, "'input' is int, not a string"),
        (5, "messages[0] has role 'assistant', not 'user' (user and assistant alternate, user first)"),
        (6, "the last message is the user's; a conversation ends with an assistant turn"),
        (7, "a JSON list, not an object"),
        (8, "messages[1].'content' is empty"),
    ]


def test_bad_records_under_the_threshold_are_skipped_and_over_it_stop_the_run(
    tmp_path, tokenizer_path, alpaca_lines, caplog
):
    path = write(tmp_path / "data.jsonl", [alpaca_lines[0], '{"instruction": 1, "output": "x"}', *alpaca_lines[1:]])
    with caplog.at_level(logging.WARNING):
        result = prepare_instructions(
            LoraParams(data_paths=[str(path)]), data_params(tmp_path, max_bad_record_fraction=0.1), tokenizer_path,
            MODEL, TOKENIZER,
        )
    assert f"{path}:2: 'instruction' is int, not a string" in caplog.text
    assert result.manifest["counts"]["malformed"] == 1
    assert result.manifest["bad_records"] == [f"{path}:2: 'instruction' is int, not a string"]

    strict = data_params(tmp_path / "strict", max_bad_record_fraction=0.001)
    with pytest.raises(DataPrepError, match=rf"1 of {len(alpaca_lines) + 1} records .* more than data.max_bad_record_fraction=0.001; first: {path}:2"):
        prepare_instructions(LoraParams(data_paths=[str(path)]), strict, tokenizer_path, MODEL, TOKENIZER)
    assert not list((tmp_path / "strict" / "out").iterdir())  # only the removed temporary build was there


def test_missing_and_empty_files_are_named(tmp_path, tokenizer_path, alpaca_lines):
    present = write(tmp_path / "present.jsonl", alpaca_lines)
    paths = [str(tmp_path / "gone.jsonl"), str(present), str(tmp_path / "also-gone.jsonl")]
    with pytest.raises(DataPrepError, match=r"lora.data_paths: '.*/gone.jsonl', '.*/also-gone.jsonl' does not exist"):
        prepare_instructions(LoraParams(data_paths=paths), data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER)
    empty = write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataPrepError, match=r"no instruction record to prepare in .*/empty.jsonl"):
        prepare_instructions(LoraParams(data_paths=[str(empty)]), data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER)


# ------------------------------------------------------------------------------------ packing and shards


def test_examples_are_packed_whole_with_their_mask():
    lengths = np.random.default_rng(0).integers(3, 40, size=60)
    ids = np.repeat(np.arange(100, 160, dtype=np.int32), lengths)  # example i is all 100 + i
    mask = np.concatenate([np.arange(length) >= length // 2 for length in lengths]).astype(np.int8)
    rows = pack_examples(ids, lengths, mask, 41, PAD)
    seen = []
    for row in range(len(rows)):
        starts = rows.doc_starts(row).tolist()
        assert starts[0] == 0
        for start, end in zip(starts, starts[1:] + [41]):
            example = int(rows.tokens[row, start]) - 100
            stop = start + lengths[example]
            assert (rows.tokens[row, start:stop] == 100 + example).all() and (rows.tokens[row, stop:end] == PAD).all()
            assert rows.loss_mask[row, start:stop].tolist() == mask[ids == 100 + example].tolist()
            assert not rows.loss_mask[row, stop:end].any()
            seen.append(example)
    assert sorted(seen) == list(range(60))
    used = np.sort(np.count_nonzero(rows.tokens != PAD, axis=1))
    assert used[0] + used[1] > 41  # first fit: a row's examples would have gone into any emptier earlier row


def test_first_fit_places_a_prefix_as_in_the_whole():
    lengths = np.random.default_rng(1).integers(1, 30, size=50)
    rows, offsets = first_fit_rows(lengths, 32)
    prefix_rows, prefix_offsets = first_fit_rows(lengths[:20], 32)
    assert np.array_equal(rows[:20], prefix_rows) and np.array_equal(offsets[:20], prefix_offsets)
    assert (np.diff(np.maximum.accumulate(rows)) <= 1).all()
    with pytest.raises(ValueError, match="an example of 33 tokens does not fit in a row of 32"):
        first_fit_rows(np.array([3, 33]), 32)


def all_rows(directory, split: str) -> PackedRows:
    rows = open_split(directory, split)
    return rows.take(np.arange(len(rows)))


def test_masked_rows_round_trip_through_shards_and_narrow_the_batch_mask(tmp_path):
    ids = np.arange(10, 36, dtype=np.int32)
    mask = np.array([0] * 6 + [1] * 4 + [0] * 3 + [1] * 3 + [0] * 6 + [1] * 4, dtype=np.int8)
    rows = pack_examples(ids, np.array([10, 6, 10]), mask, 16, PAD)
    assert [rows.doc_starts(row).tolist() for row in range(len(rows))] == [[0, 10], [0]]
    shards = write_shards(rows, tmp_path, "train", rows_per_shard=1, pad_id=PAD, vocab_size=VOCAB)
    assert [shard["file"] for shard in shards] == [f"train-{index:05d}.tokens" for index in range(len(rows))]
    write_manifest(tmp_path, {"seq_len": 15, "splits": {"train": {"shards": shards}}})
    loaded = all_rows(tmp_path, "train")
    assert np.array_equal(loaded.loss_mask, rows.loss_mask) and np.array_equal(loaded.tokens, rows.tokens)
    assert all(shard["loss_mask"] for shard in shards) and loaded.loss_mask.dtype == np.int8
    batch = make_batch(loaded, PAD, reset_at_documents=True)
    assert np.array_equal(batch.loss_mask, rows.loss_mask[:, 1:].astype(np.float32))
    assert batch.counted_tokens == 4 + 3 + 4
    assert batch.segment_ids[0].tolist() == [0] * 10 + [1] * 5


def test_pretraining_rows_have_no_mask_and_batch_as_before(tmp_path):
    lengths = np.array([5, 9, 4, 12])
    rows = pack_documents(np.arange(10, 40, dtype=np.int32), lengths, 8, BOS, EOS, PAD, "pad")
    shards = write_shards(rows, tmp_path, "train", rows_per_shard=64, pad_id=PAD, vocab_size=VOCAB)
    assert shards[0]["loss_mask"] is False
    assert "response_tokens" not in shards[0]
    write_manifest(tmp_path, {"seq_len": 7, "splits": {"train": {"shards": shards}}})
    [read] = read_shards(tmp_path, "train")
    assert read.loss_mask is None and read.take(np.array([1, 0])).loss_mask is None
    batch = make_batch(read, PAD, reset_at_documents=False)
    assert np.array_equal(batch.loss_mask, (rows.tokens[:, 1:] != PAD).astype(np.float32))


# ---------------------------------------------------------------------------------- prepare_instructions


def test_prepared_shards_hold_the_examples_and_the_manifest_counts_them(tmp_path, tokenizer_path, alpaca_lines):
    too_long = json.dumps({"instruction": "Go on.", "output": " ".join(["word"] * 200)})
    path = write(tmp_path / "data.jsonl", alpaca_lines + alpaca_lines[:3] + [too_long])
    result = prepare_instructions(LoraParams(data_paths=[str(path)]), data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER)
    manifest = result.manifest
    assert manifest["kind"] == "instructions" and (manifest["vocab_size"], manifest["seq_len"]) == (VOCAB, 128)
    assert manifest["counts"]["dropped"] == {"duplicate": 3, "too_long": 1}
    assert manifest["counts"]["examples"] == len(alpaca_lines)
    splits = manifest["splits"]
    assert splits["train"]["examples"] + splits["validation"]["examples"] == manifest["counts"]["examples"]
    for split, summary in splits.items():
        assert {shard["token_dtype"] for shard in summary["shards"]} == {"uint16"}  # VOCAB ids fit in 16 bits
        rows = all_rows(result.output_dir, split)
        assert len(rows) == summary["rows"]
        assert int(rows.loss_mask.sum()) == summary["response_tokens"]
        assert int(np.count_nonzero(rows.tokens != PAD)) == summary["tokens"]
        assert make_batch(rows, PAD, True).counted_tokens == summary["response_tokens"]
        assert int(np.count_nonzero(rows.tokens == BOS)) == summary["examples"]
    processor = spm.SentencePieceProcessor(model_file=str(result.tokenizer_path))
    outputs = {json.loads(line)["output"] for line in alpaca_lines}
    rows = all_rows(result.output_dir, "train")
    for row in range(3):
        for start, end in runs(rows.loss_mask[row]):
            assert processor.decode(rows.tokens[row, start : end - 1].tolist()) in outputs


def test_an_unchanged_request_is_reused_and_any_change_recomputes(tmp_path, tokenizer_path, alpaca_lines, docstrings):
    path = write(tmp_path / "data.jsonl", alpaca_lines)
    lora, data = LoraParams(data_paths=[str(path)]), data_params(tmp_path)
    first = prepare_instructions(lora, data, tokenizer_path, MODEL, TOKENIZER)
    again = prepare_instructions(lora, data, tokenizer_path, MODEL, TOKENIZER)
    assert not first.reused and again.reused and again.output_dir == first.output_dir
    other_tokenizer = tmp_path / "other.model"
    other_tokenizer.write_bytes(train_tokenizer(docstrings[::2], TOKENIZER, VOCAB, seed=1, num_threads=1))
    changes = [
        (LoraParams(data_paths=[str(path)], response_header="### Answer:"), data, tokenizer_path, MODEL),
        (lora, data.model_copy(update={"shuffle_seed": 7}), tokenizer_path, MODEL),
        (lora, data, other_tokenizer, MODEL),
        (lora, data, tokenizer_path, ModelParams(vocab_size=VOCAB, seq_len=160)),
    ]
    directories = {first.output_dir}
    for change in changes:
        result = prepare_instructions(*change, TOKENIZER)
        assert not result.reused
        directories.add(result.output_dir)
    write(path, alpaca_lines[1:])
    edited = prepare_instructions(lora, data, tokenizer_path, MODEL, TOKENIZER)
    assert not edited.reused and edited.output_dir not in directories
    assert len(directories) == len(changes) + 1


def test_a_damaged_dataset_is_rebuilt(tmp_path, tokenizer_path, alpaca_lines, caplog):
    lora = LoraParams(data_paths=[str(write(tmp_path / "data.jsonl", alpaca_lines))])
    first = prepare_instructions(lora, data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER)
    shard = first.output_dir / first.manifest["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING):
        rebuilt = prepare_instructions(lora, data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER)
    assert not rebuilt.reused and "is damaged" in caplog.text
    assert rebuilt.manifest["splits"] == first.manifest["splits"]


def test_validation_holds_at_least_the_rows_asked_for(tmp_path, tokenizer_path, alpaca_lines):
    lora = LoraParams(data_paths=[str(write(tmp_path / "data.jsonl", alpaca_lines))])
    data = data_params(tmp_path, validation_fraction=0.01)
    result = prepare_instructions(lora, data, tokenizer_path, MODEL, TOKENIZER, min_validation_rows=6)
    assert result.manifest["splits"]["validation"]["rows"] >= 6
    assert len(all_rows(result.output_dir, "validation")) >= 6
    with pytest.raises(DataPrepError, match=r"cannot hold out data.validation_fraction=0.01 and at least 10000 validation rows"):
        prepare_instructions(lora, data, tokenizer_path, MODEL, TOKENIZER, min_validation_rows=10_000)


# -------------------------------------------------------------------------------------------- bundled set


def test_the_bundled_set_is_real_distinct_and_prepares(tmp_path, tokenizer_path):
    records = bundled_records()
    assert 1000 <= len(records) <= 5000
    assert all(len(record["output"]) >= MIN_OUTPUT_CHARS for record in records)
    assert len({(r["instruction"], r.get("input", "")) for r in records}) == len(records)
    assert len({r["output"] for r in records}) == len(records)
    assert sum("input" in record for record in records) > 100  # the signature phrasing
    dumps = next(record for record in records if "`json.dumps`" in record["instruction"])
    assert dumps["output"].startswith("Serialize ``obj`` to a JSON formatted ``str``")
    result = prepare_instructions(LoraParams(), data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER)
    counts = result.manifest["counts"]
    assert counts["records"] == len(records) and counts["malformed"] == 0
    assert counts["examples"] + counts["dropped"]["too_long"] == len(records) and counts["dropped"]["duplicate"] == 0
    assert counts["examples"] > len(records) / 2  # most fit 129 tokens even with this 512-piece vocabulary
    assert prepare_instructions(LoraParams(), data_params(tmp_path), tokenizer_path, MODEL, TOKENIZER).reused
