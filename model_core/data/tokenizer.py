"""The SentencePiece tokenizer of a dataset: trained on the training documents, or loaded from a file,
and checked against the model's vocabulary size and the configured special-token ids.

Trained tokenizers use identity normalisation and keep whitespace as it is (cleaning already did NFKC
and whitespace), and `\n` is a piece of its own, so decode(encode(text)) == text for cleaned text;
byte fallback covers characters outside the vocabulary. The thread count is cleared from the saved
model, so the same sentences give the same .model bytes on any machine.
"""

from __future__ import annotations

import io
import threading
from itertools import chain
from pathlib import Path

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from model_core.data.errors import DataPrepError
from params.schema import TokenizerParams

_SPECIAL_IDS = ("unk_id", "bos_id", "eos_id", "pad_id")
_BPE = sentencepiece_model_pb2.TrainerSpec.ModelType.BPE
_USER_DEFINED = sentencepiece_model_pb2.ModelProto.SentencePiece.Type.USER_DEFINED


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


def whole_documents(processor: spm.SentencePieceProcessor):
    """An encoder of whole documents with the interface of `LineCachedEncoder.encode`."""

    def encode(texts: list[str], num_threads: int, shared_threads: spm.ThreadPool | None = None):
        pieces = encode_documents(processor, texts, num_threads, shared_threads)
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        return (np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int32)), lengths

    return encode


def document_encoder(model: bytes, processor: spm.SentencePieceProcessor):
    """`encode(texts, num_threads, shared_threads) -> (ids concatenated, ids per text)` for the model: a line
    at a time with a cache where that gives the same ids (`encodes_lines_apart`), else whole documents."""
    return LineCachedEncoder(model, processor).encode if encodes_lines_apart(model) else whole_documents(processor)


def encodes_lines_apart(model: bytes) -> bool:
    """Whether the model's ids of a text are those of its lines, each encoded on its own (the first with the
    dummy prefix, the others without), joined by the id of `\n`: a BPE model never merges a user-defined
    piece with its neighbours, and a normaliser that maps characters one by one (identity, no collapsed
    whitespace) sees nothing of the next line. The tokenizers `train_tokenizer` writes are such models."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    normalizer = proto.normalizer_spec
    return (
        proto.trainer_spec.model_type == _BPE
        and not proto.trainer_spec.treat_whitespace_as_suffix
        and normalizer.name == "identity"
        and not normalizer.precompiled_charsmap
        and not normalizer.remove_extra_whitespaces
        and any(piece.piece == "\n" and piece.type == _USER_DEFINED for piece in proto.pieces)
    )


class LineCachedEncoder:
    """Encodes documents a line at a time, each distinct line once: source code and markup repeat many of
    their lines (in an 8 MiB shard of installed sources, 47% of the lines and 24% of the characters repeat
    an earlier line of the shard), and encoding time follows characters. The ids are those of encoding
    every document whole, for a model where `encodes_lines_apart` holds.

    The cache lives as long as this object (prep holds one per input shard, so its memory follows the
    shard): each distinct line's ids once, in one int32 array, and where they start. Batches may be
    encoded from several threads at once; each encodes the lines that the cache lacks when it looks.
    """

    def __init__(self, model: bytes, processor: spm.SentencePieceProcessor) -> None:
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model)
        proto.normalizer_spec.add_dummy_prefix = False
        self.first_lines = processor  # a text's first line takes the dummy prefix, as the whole text would
        self.later_lines = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.newline = processor.piece_to_id("\n")
        self._known: tuple[dict[str, int], dict[str, int]] = ({}, {})  # line -> its entry, per processor
        self._entries_so_far = 0
        self._starts = np.zeros(1 << 12, dtype=np.int64)  # entry i's ids are ids[starts[i]:starts[i + 1]]
        self._ids = np.empty(1 << 16, dtype=np.int32)
        self._lock = threading.Lock()

    def encode(
        self, texts: list[str], num_threads: int, shared_threads: spm.ThreadPool | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The int32 ids of the texts concatenated, and the number of ids of each."""
        if not texts:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
        # A text that starts with a newline is one line: encoded alone, its empty first line would lose the
        # dummy prefix that the whole text gets.
        lines = [text.split("\n") if not text.startswith("\n") else [text] for text in texts]
        first = [parts[0] for parts in lines]
        later = [line for parts in lines for line in parts[1:]]
        first_entries = self._entries(first, 0, num_threads, shared_threads)
        later_entries = self._entries(later, 1, num_threads, shared_threads)
        counts = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
        entries = np.empty(int(counts.sum()), dtype=np.int64)
        text_starts = np.cumsum(counts) - counts
        is_first = np.zeros(len(entries), dtype=bool)
        is_first[text_starts] = True
        entries[is_first], entries[~is_first] = first_entries, later_entries
        with self._lock:  # views of the arrays as they are now: one grown later keeps its old copy alive
            starts, ids = self._starts[: self._entries_so_far + 1], self._ids
        return _joined_lines(ids, starts[entries], np.diff(starts)[entries], text_starts, self.newline)

    def _entries(
        self, lines: list[str], processor: int, num_threads: int, shared_threads: spm.ThreadPool | None
    ) -> np.ndarray:
        """The cache entry of each line, encoding the distinct lines the cache lacks."""
        known = self._known[processor]
        missing = [line for line in dict.fromkeys(lines) if line not in known]
        if missing:
            shared = {"thread_pool": shared_threads} if shared_threads is not None else {}
            encoder = (self.first_lines, self.later_lines)[processor]
            encoded = encoder.encode(missing, num_threads=num_threads, **shared)
            self._add(known, missing, encoded)
        return np.fromiter(map(known.__getitem__, lines), dtype=np.int64, count=len(lines))

    def _add(self, known: dict[str, int], lines: list[str], encoded: list[list[int]]) -> None:
        lengths = list(map(len, encoded))
        flat = np.fromiter(chain.from_iterable(encoded), dtype=np.int32, count=sum(lengths))
        with self._lock:
            first_entry = self._entries_so_far
            start = int(self._starts[first_entry])
            self._ids = _room_for(self._ids, start, start + len(flat))
            self._ids[start : start + len(flat)] = flat
            self._starts = _room_for(self._starts, first_entry + 1, first_entry + 1 + len(lines))
            np.cumsum(lengths, out=self._starts[first_entry + 1 : first_entry + 1 + len(lines)])
            self._starts[first_entry + 1 : first_entry + 1 + len(lines)] += start
            self._entries_so_far += len(lines)
            # A line that another thread added meanwhile points here from now on: both copies hold its ids.
            known.update(zip(lines, range(first_entry, first_entry + len(lines))))


def _room_for(values: np.ndarray, used: int, needed: int) -> np.ndarray:
    """`values`, or a copy of its first `used` elements twice as large, so that it holds `needed`. A new array,
    never a resize in place: views that other threads took of the old one stay valid."""
    if needed <= len(values):
        return values
    grown = np.empty(max(2 * len(values), needed), dtype=values.dtype)
    grown[:used] = values[:used]
    return grown


def _joined_lines(
    ids: np.ndarray, line_starts: np.ndarray, line_lengths: np.ndarray, text_starts: np.ndarray, newline: int
) -> tuple[np.ndarray, np.ndarray]:
    """The texts' ids, given each line's ids as a run of `ids` (lines in text order; text t's lines begin
    at text_starts[t]): every line but a text's last followed by the newline id."""
    last_line = np.append(text_starts[1:], len(line_starts)) - 1
    out_lengths = line_lengths + 1
    out_lengths[last_line] -= 1
    out_starts = np.cumsum(out_lengths) - out_lengths
    joined = np.full(int(out_lengths.sum()), newline, dtype=np.int32)
    before = np.cumsum(line_lengths) - line_lengths  # of each line's first id, among the lines' ids alone
    within = np.arange(int(line_lengths.sum()), dtype=np.int64)
    joined[np.repeat(out_starts - before, line_lengths) + within] = ids[np.repeat(line_starts - before, line_lengths) + within]
    text_lengths = np.add.reduceat(out_lengths, text_starts) if len(text_starts) else np.empty(0, np.int64)
    return joined, text_lengths
