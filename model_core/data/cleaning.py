"""Text cleaning applied to every document before deduplication and tokenization.

Line endings become `\n`, control characters other than `\n` and `\t` are dropped, the text is NFKC
normalised (optional), runs of horizontal whitespace collapse to one space, trailing spaces go, three or
more newlines become a blank line, and the result is stripped. A document that is empty afterwards is
dropped by the caller.
"""

from __future__ import annotations

import re
import unicodedata

_LINE_ENDINGS = re.compile(r"\r\n?")
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # Unicode Cc except \t and \n
_HORIZONTAL_SPACE = re.compile(r"[^\S\n]+")
_TRAILING_SPACE = re.compile(r" \n")
_BLANK_LINES = re.compile(r"\n{3,}")


def clean_text(text: str, normalize_unicode: bool = True) -> str:
    text = _LINE_ENDINGS.sub("\n", text)
    text = _CONTROL_CHARACTERS.sub("", text)
    if normalize_unicode and not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    text = _HORIZONTAL_SPACE.sub(" ", text)
    text = _TRAILING_SPACE.sub("\n", text)
    text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()
