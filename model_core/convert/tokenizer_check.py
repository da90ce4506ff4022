"""Do two tokenizers agree? Encode one text with ours (a SentencePiece .model) and a reference (another
.model, or a Hugging Face tokenizer directory) and report the first token where they differ, with the
text around it, both id sequences near it, both vocab sizes and both special-token ids.

`check_vocab` is the pipeline's one check that a model's vocabulary fits its tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from model_core.convert.errors import ConversionError

# Prose, code, digits, runs of spaces and newlines, accents, CJK and an emoji: where tokenizers tend to differ.
SAMPLE_TEXT = (
    "Return the number of items in the container.\n\n"
    "    def mean(values: list[float]) -> float:\n"
    "        return sum(values) / len(values)  # 3.14159, 2_048, 0x1F\n\n"
    "Naïve café résumé — déjà vu; Straße, Ελληνικά, русский, 日本語のテキスト, 한국어.\n"
    "Tabs\tand   spaces,   trailing   \n"
    "Emoji 🙂 and symbols: ©®™ ≤ ≥ ∑ √ ∞.\n"
)
SPECIAL_TOKENS = ("unk", "bos", "eos", "pad")
CONTEXT_CHARS = 30
WINDOW_TOKENS = 5


@dataclass(frozen=True)
class TokenizerInfo:
    path: str
    kind: str  # "sentencepiece" or "huggingface"
    vocab_size: int
    special_ids: dict[str, int | None]

    def describe(self) -> str:
        special = " ".join(f"{name}={token_id}" for name, token_id in self.special_ids.items())
        return f"{self.path} ({self.kind}): vocab {self.vocab_size}, {special}"


@dataclass(frozen=True)
class Divergence:
    token_index: int  # first position where the id sequences differ
    char_offset: int  # where that token starts in the text (from our offsets)
    context: str  # the text around it, with the divergence marked
    window_start: int  # token index of the first id in the windows below
    ours_ids: list[int]
    reference_ids: list[int]
    ours_pieces: list[str]
    reference_pieces: list[str]


@dataclass(frozen=True)
class TokenizerReport:
    ours: TokenizerInfo
    reference: TokenizerInfo
    tokens: int  # tokens in our encoding of the text
    divergence: Divergence | None

    @property
    def aligned(self) -> bool:
        return (
            self.divergence is None
            and self.ours.vocab_size == self.reference.vocab_size
            and self.ours.special_ids == self.reference.special_ids
        )

    def format(self) -> str:
        lines = [f"ours:      {self.ours.describe()}", f"reference: {self.reference.describe()}"]
        if self.ours.vocab_size != self.reference.vocab_size:
            lines.append(f"vocab sizes differ: ours {self.ours.vocab_size}, reference {self.reference.vocab_size}")
        for name in SPECIAL_TOKENS:
            ours, theirs = self.ours.special_ids[name], self.reference.special_ids[name]
            if ours != theirs:
                lines.append(f"{name} id differs: ours {ours}, reference {theirs}")
        found = self.divergence
        if found is None:
            lines.append(f"encodings agree on all {self.tokens} tokens of the text")
        else:
            lines += [
                f"first divergence at token {found.token_index} (character {found.char_offset}): {found.context}",
                f"  ours      ids[{found.window_start}:]: {found.ours_ids} {found.ours_pieces}",
                f"  reference ids[{found.window_start}:]: {found.reference_ids} {found.reference_pieces}",
            ]
        lines.append("ALIGNED" if self.aligned else "NOT ALIGNED")
        return "\n".join(lines)


def check_vocab(model_vocab: int, tokenizer_vocab: int, where: str, multiple: int = 1) -> None:
    """The model's vocab must equal the tokenizer's, or that rounded up to `multiple` (tensor-parallel padding)."""
    padded = -(-tokenizer_vocab // multiple) * multiple
    if model_vocab not in (tokenizer_vocab, padded):
        rounded = f" (or {padded}, padded to a multiple of {multiple})" if padded != tokenizer_vocab else ""
        raise ConversionError(
            f"{where}: model vocab_size={model_vocab} does not match the tokenizer's {tokenizer_vocab} pieces{rounded}"
        )


def check_tokenizers(ours: str | Path, reference: str | Path, text: str | None = None) -> TokenizerReport:
    """Compare our SentencePiece model with a reference on `text` (default: SAMPLE_TEXT), without special tokens."""
    text = SAMPLE_TEXT if text is None else text
    our_tokenizer = _SentencePiece(Path(ours))
    reference_tokenizer = _open_reference(Path(reference))
    our_ids, offsets = our_tokenizer.encode_with_offsets(text)
    reference_ids = reference_tokenizer.encode(text)
    index = next(
        (i for i, (a, b) in enumerate(zip(our_ids, reference_ids)) if a != b), min(len(our_ids), len(reference_ids))
    )
    divergence = None
    if our_ids != reference_ids:
        char_offset = offsets[index] if index < len(offsets) else len(text)
        start, end = max(0, index - WINDOW_TOKENS), index + WINDOW_TOKENS
        divergence = Divergence(
            token_index=index,
            char_offset=char_offset,
            context=_context(text, char_offset),
            window_start=start,
            ours_ids=our_ids[start:end],
            reference_ids=reference_ids[start:end],
            ours_pieces=our_tokenizer.pieces(our_ids[start:end]),
            reference_pieces=reference_tokenizer.pieces(reference_ids[start:end]),
        )
    return TokenizerReport(our_tokenizer.info, reference_tokenizer.info, len(our_ids), divergence)


def _context(text: str, offset: int) -> str:
    """The text on both sides of `offset`, the two sides quoted and joined by a `>>>` marker."""
    return f"{text[max(0, offset - CONTEXT_CHARS) : offset]!r} >>> {text[offset : offset + CONTEXT_CHARS]!r}"


class _SentencePiece:
    def __init__(self, path: Path):
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise ConversionError(f"{path} is not a readable SentencePiece model ({error})") from error
        special = {name: getattr(self.processor, f"{name}_id")() for name in SPECIAL_TOKENS}
        self.info = TokenizerInfo(
            str(path),
            "sentencepiece",
            self.processor.get_piece_size(),
            {name: (token_id if token_id >= 0 else None) for name, token_id in special.items()},
        )

    def encode(self, text: str) -> list[int]:
        return list(self.processor.encode(text))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Ids and the character offset where each token's text starts."""
        mapping = self.processor.EncodeAsOffsetMapping(text)
        return list(mapping["ids"]), [begin for begin, _ in mapping["offsets"]]

    def pieces(self, ids: list[int]) -> list[str]:
        return [self.processor.id_to_piece(token_id) for token_id in ids]


class _HuggingFace:
    def __init__(self, path: Path):
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ConversionError(
                f"the reference {path} is a Hugging Face tokenizer directory, which needs the transformers "
                "package; install it or give a SentencePiece .model instead"
            ) from error
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ConversionError(f"{path} is not a loadable Hugging Face tokenizer directory ({error})") from error
        special = {name: getattr(self.tokenizer, f"{name}_token_id") for name in SPECIAL_TOKENS}
        self.info = TokenizerInfo(str(path), "huggingface", len(self.tokenizer), special)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def pieces(self, ids: list[int]) -> list[str]:
        return list(self.tokenizer.convert_ids_to_tokens(ids))


def _open_reference(path: Path) -> _SentencePiece | _HuggingFace:
    if path.is_dir():
        return _HuggingFace(path)
    if path.is_file():
        return _SentencePiece(path)
    raise ConversionError(f"reference tokenizer {path} does not exist")
