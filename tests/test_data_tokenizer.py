"""Training, loading and checking the SentencePiece tokenizer."""

import functools
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from model_core.data import tokenizer as tokenizer_module
from model_core.data.cleaning import clean_text
from model_core.data.docstrings import stdlib_files
from model_core.data.errors import DataPrepError
from model_core.data.sources import InputFile, read_input
from model_core.data.tokenizer import (
    encode_documents,
    encoding_threads,
    open_tokenizer,
    train_tokenizer,
    train_tokenizer_apart,
)
from params.schema import TokenizerParams

VOCAB = 512


@pytest.fixture(scope="module")
def texts():
    files = [path for path in stdlib_files() if path.name in {"argparse.py", "pathlib.py", "textwrap.py"}]
    return [clean_text(text) for path in files for text in read_input(InputFile(path, "python_docstrings"))[0]]


@pytest.fixture(scope="module")
def model(texts):
    return train_tokenizer(texts, TokenizerParams(), VOCAB, seed=0, num_threads=2)


def test_training_is_deterministic_across_runs_and_thread_counts(texts, model):
    assert train_tokenizer(texts, TokenizerParams(), VOCAB, seed=0, num_threads=2) == model
    assert train_tokenizer(texts, TokenizerParams(), VOCAB, seed=0, num_threads=1) == model


def test_training_apart_gives_the_same_model_from_another_process(texts, model, monkeypatch):
    def here(*args, **kwargs):
        raise AssertionError("trained in the calling process")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", here)  # a spawned child imports the real one
    trained, peak_bytes = train_tokenizer_apart(functools.partial(list, texts), TokenizerParams(), VOCAB, 0, 2)
    assert trained == model and peak_bytes > 10 * 2**20


def test_a_training_process_that_dies_is_named_with_its_signal():
    die = functools.partial(signal.raise_signal, signal.SIGKILL)
    with pytest.raises(DataPrepError, match=r"exit code -9 \(killed by SIGKILL\) before it returned a model; when "
                       r"memory ran out, lower tokenizer.training_sentences=2000000$"):
        train_tokenizer_apart(die, TokenizerParams(training_sentences=2_000_000), VOCAB, 0, 1)


def test_decode_of_encode_gives_the_cleaned_text_back(texts, model):
    processor = open_tokenizer(model, TokenizerParams(), VOCAB, "test")
    samples = texts[:50] + [clean_text("Grüße, 日本語 and emoji 🙂\n\n  indented\tline  ✓")]
    for text in samples:
        assert processor.decode(processor.encode(text)) == text
    assert processor.unk_id() not in processor.encode(samples[-1])  # byte fallback, not <unk>


def test_batches_sharing_native_threads_encode_as_one_text_at_a_time(texts, model):
    processor = open_tokenizer(model, TokenizerParams(), VOCAB, "test")
    expected = [processor.encode(text) for text in texts]
    threads = encoding_threads(2)
    batches = [texts[first : first + 7] for first in range(0, len(texts), 7)]
    with ThreadPoolExecutor(2) as callers:  # two batches in flight on the same native threads
        encoded = list(callers.map(lambda batch: encode_documents(processor, batch, 2, threads), batches))
    ids = [document for batch in encoded for document in batch]
    assert all(document.dtype == np.int32 for document in ids)
    assert [document.tolist() for document in ids] == expected


def test_sampled_training_sentences_still_train(texts):
    params = TokenizerParams(training_sentences=2000)
    assert open_tokenizer(train_tokenizer(texts, params, VOCAB, 0, 2), params, VOCAB, "test")


def test_a_vocabulary_mismatch_names_both_sizes(model):
    with pytest.raises(DataPrepError, match="has 512 pieces but model.vocab_size=600"):
        open_tokenizer(model, TokenizerParams(), 600, "tokenizer x.model")


def test_a_special_id_mismatch_names_both_ids(model):
    with pytest.raises(DataPrepError, match="has pad_id=3 but tokenizer.pad_id=7"):
        open_tokenizer(model, TokenizerParams(pad_id=7), VOCAB, "tokenizer x.model")


def test_a_vocabulary_too_large_for_the_corpus_is_a_data_prep_error():
    with pytest.raises(DataPrepError, match="model.vocab_size=5000"):
        train_tokenizer(["tiny corpus"] * 3, TokenizerParams(), 5000, 0, 1)
