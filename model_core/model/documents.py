"""Positions and segment ids that restart at document boundaries inside a packed row."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def document_positions(doc_starts: Sequence[int] | np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids, segment_ids) for one row of `length` input tokens, both int32 of shape [length].

    `doc_starts` are the offsets where documents start in the packed row, as data prep records them (rows
    are seq_len + 1 tokens, so a start at or beyond `length` only touches the shifted targets and is
    ignored). Tokens before the first start, if it is not 0, continue a document from an earlier row and
    form segment 0 too. Positions count from 0 within each segment; segment ids number the segments in order.
    """
    starts = np.asarray(doc_starts, dtype=np.int64)
    if starts.ndim != 1 or (starts < 0).any() or (np.diff(starts) <= 0).any():
        raise ValueError(f"doc_starts must be increasing offsets >= 0, got {starts.tolist()}")
    starts = np.union1d([0], starts[starts < length])
    token = np.arange(length)
    segment_ids = np.searchsorted(starts, token, side="right") - 1
    position_ids = token - starts[segment_ids]
    return position_ids.astype(np.int32), segment_ids.astype(np.int32)
