"""Tokenizer alignment: identical tokenizers agree, a planted difference is found where it is, vocab
sizes and special ids are reported, Hugging Face directories work as references, and check_vocab."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from conftest import docstring_documents
from model_core.convert import ConversionError, check_tokenizers, check_vocab
from model_core.convert.tokenizer_check import SAMPLE_TEXT


def train_small_tokenizer(path: Path) -> Path:
    """A 600-piece BPE SentencePiece model of the docstring corpus, special ids unk 0, bos 1, eos 2, pad 3."""
    lines = [line for text in docstring_documents() for line in text.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizers") / "ours.model")


def planted(ours: Path, directory: Path) -> Path:
    """Our model with the piece '▁the' renamed (so ' the' encodes differently) and one extra piece."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(ours.read_bytes())
    (piece,) = [p for p in proto.pieces if p.piece == "▁the"]
    piece.piece = "▁thé"
    proto.pieces.add(piece="<extra>", score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
    path = directory / "reference.model"
    path.write_bytes(proto.SerializeToString())
    return path


def test_identical_tokenizers_are_aligned(ours):
    report = check_tokenizers(ours, ours)
    assert report.aligned and report.divergence is None and report.tokens > 50
    assert report.ours.special_ids == {"unk": 0, "bos": 1, "eos": 2, "pad": 3}
    assert "encodings agree on all" in report.format() and report.format().endswith("ALIGNED")


def test_planted_divergence_is_found_where_it_is(ours, tmp_path):
    report = check_tokenizers(ours, planted(ours, tmp_path))
    found = report.divergence
    assert not report.aligned and found is not None
    assert found.char_offset == SAMPLE_TEXT.index(" the")  # "Return| the number"
    assert "'Return' >>> ' the number" in found.context
    assert found.ours_pieces[found.token_index - found.window_start] == "▁the"
    assert found.ours_ids != found.reference_ids
    text = report.format()
    assert (report.ours.vocab_size, report.reference.vocab_size) == (600, 601)
    assert "vocab sizes differ: ours 600, reference 601" in text
    assert f"first divergence at token {found.token_index} (character 6)" in text and "NOT ALIGNED" in text


def test_divergence_in_a_given_text(ours, tmp_path):
    text = "Nothing differs here. Then the end."
    report = check_tokenizers(ours, planted(ours, tmp_path), text=text)
    assert report.divergence.char_offset == text.index(" the ")


def test_hugging_face_directory_as_reference(ours, tmp_path):
    pytest.importorskip("transformers")
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(ours.read_bytes())
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", **special}))
    report = check_tokenizers(ours, directory)
    assert report.reference.kind == "huggingface" and report.aligned, report.format()


def test_hugging_face_reference_without_transformers_is_a_clear_error(ours, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ConversionError, match="needs the transformers package; install it or give a SentencePiece .model"
    ):
        check_tokenizers(ours, tmp_path)


def test_unreadable_or_missing_reference(ours, tmp_path):
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ConversionError, match="bad.model is not a readable SentencePiece model"):
        check_tokenizers(ours, tmp_path / "bad.model")
    with pytest.raises(ConversionError, match="missing.model does not exist"):
        check_tokenizers(ours, tmp_path / "missing.model")


def test_check_vocab_names_both_sizes():
    check_vocab(32000, 32000, "here")
    check_vocab(32002, 32001, "here", multiple=2)
    with pytest.raises(
        ConversionError, match=r"data prep: model vocab_size=32000 does not match the tokenizer's 32001 pieces"
    ):
        check_vocab(32000, 32001, "data prep")
    with pytest.raises(
        ConversionError, match=r"vocab_size=32004 .* 32001 pieces \(or 32002, padded to a multiple of 2\)"
    ):
        check_vocab(32004, 32001, "x", multiple=2)
