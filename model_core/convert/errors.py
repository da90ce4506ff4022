"""The one exception of conversion, so callers can tell a bad checkpoint, config or tokenizer from a bug."""


class ConversionError(ValueError):
    """A checkpoint, config or tokenizer that cannot be converted; the message names the key or field and
    both shapes or sizes."""
