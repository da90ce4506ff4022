"""Each cleaning rule of data prep, one at a time."""

import pytest

from model_core.data.cleaning import clean_text


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
