"""Each cleaning rule of data prep, one at a time, and the batched cleaning that applies them all."""

import random
import re
import sys

import pytest

from model_core.data import cleaning
from model_core.data.cleaning import clean_text, clean_texts


@pytest.mark.parametrize(
    ("raw", "cleaned"),
    [
        ("a  b\t\tc \t d", "a b c d"),  # runs of spaces and tabs collapse to one space
        ("line one   \nline two\t\n", "line one\nline two"),  # trailing spaces per line go
        ("para one\n\n\n\n\npara two", "para one\n\npara two"),  # 3+ newlines become a blank line
        ("a\n \n \nb", "a\n\nb"),  # whitespace-only lines count as blank
        ("  \n  padded text \n\n ", "padded text"),  # the whole text is stripped
        ("bell\x07 null\x00 del\x7f c1\x85 esc\x1b!", "bell null del c1 esc!"),  # control characters dropped
        ("windows\r\nold mac\rend", "windows\nold mac\nend"),  # line endings become \n
        ("ﬁne ① ＡＢＣ", "fine 1 ABC"),  # NFKC folds ligatures, circled digits, full-width letters
        ("no\u00a0break\u3000space", "no break space"),  # NFKC spaces are collapsed like any other
        ("keep ümlauts and 日本語", "keep ümlauts and 日本語"),  # already-normal text is untouched
    ],
)
def test_cleaning_rules(raw, cleaned):
    assert clean_text(raw) == cleaned


def test_unicode_normalisation_can_be_switched_off():
    assert clean_text("ﬁne ①", normalize_unicode=False) == "ﬁne ①"


@pytest.mark.parametrize("raw", ["", "   \n\t\n  ", "\x00\x01\x02"])
def test_texts_of_only_whitespace_or_control_characters_become_empty(raw):
    assert clean_text(raw) == ""


def test_batched_cleaning_equals_cleaning_each_document():
    alphabet = list(" \t\n\r\x00\x07\x0b\x1c\x85\xa0\u1680\u2000\u2028\u3000\ufb01\u2460\uff21\u0301e\u00e9ab")
    rng = random.Random(0)
    for _ in range(2000):
        docs = ["".join(rng.choices(alphabet, k=rng.randint(0, 12))) for _ in range(rng.randint(1, 6))]
        for normalize in (True, False):
            assert clean_texts(docs, normalize) == [clean_text(doc, normalize) for doc in docs]


def test_a_document_holding_the_batch_separator_is_cleaned_on_its_own():
    docs = ["a\x00b  c", "ﬁne", "plain  ascii"]
    assert clean_texts(docs) == ["ab c", "fine", "plain ascii"]


def test_the_other_horizontal_space_class_is_every_remaining_unicode_space():
    spaces = {chr(code) for code in range(sys.maxunicode + 1) if chr(code).isspace()}
    dropped = {c for c in spaces if re.fullmatch(cleaning._CONTROL_CHARACTERS, c)}
    expected = spaces - dropped - {"\n", "\r", " ", "\t"}
    assert {c for c in spaces if cleaning._OTHER_HORIZONTAL_SPACE.fullmatch(c)} == expected
