"""The SentencePiece tokenizer of a dataset: trained on the training documents, or loaded from a file,
and checked against the model's vocabulary size and the configured special-token ids.

Trained tokenizers use identity normalisation and keep whitespace as it is (cleaning already did NFKC
and whitespace), and `\n` is a piece of its own, so decode(encode(text)) == text for cleaned text;
byte fallback covers characters outside the vocabulary. The thread count is cleared from the saved
model, so the same sentences give the same .model bytes on any machine.

SentencePiece's trainer takes memory in proportion to its sample and the allocator keeps it after training,
so `train_tokenizer_apart` trains in a fresh process that ends with the training: the process that goes on
to the map step keeps none of it.
"""

from __future__ import annotations

import io
import multiprocessing
import resource
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from model_core.data.errors import DataPrepError
from params.schema import TokenizerParams

_SPECIAL_IDS = ("unk_id", "bos_id", "eos_id", "pad_id")


def train_tokenizer(
    texts: list[str], params: TokenizerParams, vocab_size: int, seed: int, num_threads: int
) -> bytes:
    """Serialized SentencePiece model trained on the lines of `texts` (at most params.training_sentences)."""
    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    if len(lines) > params.training_sentences:
        chosen = np.sort(np.random.default_rng(seed).choice(len(lines), params.training_sentences, replace=False))
        lines = [lines[index] for index in chosen]
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=params.model_type,
            byte_fallback=params.byte_fallback,
            character_coverage=params.character_coverage,
            unk_id=params.unk_id,
            bos_id=params.bos_id,
            eos_id=params.eos_id,
            pad_id=params.pad_id,
            user_defined_symbols=["\n"],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            input_sentence_size=0,  # sampling happened above, with our seed
            shuffle_input_sentence=False,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as error:
        raise DataPrepError(
            f"cannot train a tokenizer with model.vocab_size={vocab_size} on {len(lines)} lines: {error}"
        ) from error
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    proto.trainer_spec.ClearField("num_threads")
    return proto.SerializeToString()


def train_tokenizer_apart(
    lines: Callable[[], list[str]], params: TokenizerParams, vocab_size: int, seed: int, num_threads: int
) -> tuple[bytes, int]:
    """`train_tokenizer(lines(), ...)` in a "spawn" child process (never "fork": the caller may run threads);
    the model and the child's peak resident memory in bytes. `lines` must pickle (a module-level function or
    a partial of one), and makes the sample in the child, so this process never holds it."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(  # a daemon: a prep that is interrupted or fails ends its training too
        target=_train_and_send, args=(send, lines, params, vocab_size, seed, num_threads), name="tokenizer training",
        daemon=True,
    )
    child.start()
    send.close()  # the child holds the only sending end: its death ends the pipe
    try:
        outcome, value = receive.recv()
    except EOFError:
        child.join()
        killed = f" (killed by {signal.Signals(-child.exitcode).name})" if child.exitcode and child.exitcode < 0 else ""
        raise DataPrepError(
            f"the tokenizer's training process ended with exit code {child.exitcode}{killed} before it returned a "
            f"model; when memory ran out, lower tokenizer.training_sentences={params.training_sentences}"
        ) from None
    finally:
        receive.close()
    child.join()
    if outcome == "error":
        raise value
    return value


def _train_and_send(
    send: Connection, lines: Callable[[], list[str]], params: TokenizerParams, vocab_size: int, seed: int, threads: int
) -> None:
    try:
        model = train_tokenizer(lines(), params, vocab_size, seed, threads)
        send.send(("model", (model, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))  # Linux: KiB
    except Exception as error:  # noqa: BLE001 - handed to the parent, which raises it
        send.send(("error", error))
    finally:
        send.close()


def load_tokenizer(path: Path) -> bytes:
    if not path.is_file():
        raise DataPrepError(f"tokenizer.model_path={path} does not exist")
    return path.read_bytes()


def open_tokenizer(
    model: bytes, params: TokenizerParams, vocab_size: int, origin: str, vocab_padding: int = 0
) -> spm.SentencePieceProcessor:
    """The processor of a serialized model, after checking its size (the model's vocabulary less its padding
    rows) and special ids against the params."""
    try:
        processor = spm.SentencePieceProcessor(model_proto=model)
    except (RuntimeError, OSError) as error:
        raise DataPrepError(f"{origin} is not a SentencePiece model ({error})") from error
    if processor.get_piece_size() != vocab_size - vocab_padding:
        padding = f" less model.vocab_padding={vocab_padding}" if vocab_padding else ""
        raise DataPrepError(
            f"{origin} has {processor.get_piece_size()} pieces but model.vocab_size={vocab_size}{padding}"
        )
    for name in _SPECIAL_IDS:
        actual, expected = getattr(processor, name)(), getattr(params, name)
        if actual != expected:
            raise DataPrepError(f"{origin} has {name}={actual} but tokenizer.{name}={expected}")
    return processor


def encoding_threads(num_threads: int) -> spm.ThreadPool:
    """Native threads for `encode_documents` calls to share."""
    return spm.ThreadPool(num_threads)


def encode_documents(
    processor: spm.SentencePieceProcessor,
    texts: list[str],
    num_threads: int,
    shared_threads: spm.ThreadPool | None = None,
) -> list[np.ndarray]:
    """The int32 token ids of each text, encoded on the native `shared_threads` when given (each takes
    the next text as it finishes one, so the texts end together), else on `num_threads` of its own.
    return_type="numpy" hands each text's ids back as one int32 array instead of a Python int per token."""
    shared = {"thread_pool": shared_threads} if shared_threads is not None else {}
    return processor.encode(texts, num_threads=num_threads, return_type="numpy", **shared)
