"""The one exception of data prep, so callers can tell a bad corpus from a bug."""


class DataPrepError(ValueError):
    """A corpus, input file or tokenizer that cannot become a dataset; the message names the cause
    (the file and line, or both numbers of a mismatch)."""
