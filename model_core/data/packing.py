"""Packing tokenized documents into fixed-length rows, keeping where each document starts.

Pretraining (`pack_documents`): each document becomes [BOS] + ids + [EOS] (BOS optional); the documents
are concatenated into one stream and cut into rows of `row_len` tokens (seq_len + 1: inputs and shifted
targets). A row records the offsets at which documents start inside it, always including 0, so training
can reset attention and positions there. The last partial row is dropped or padded with pad_id; padding
is not a document.

Instruction tuning (`pack_examples`): examples are never cut. Each goes whole into the first row with
room for it (first fit, in the given order), the rest of a row is padding, and a per-token loss mask
travels with the tokens. Examples longer than a row are the caller's to drop beforehand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

_BLOCK_TOKENS = 1 << 16  # rows filled at a time: their index (int64) stays within the L2 cache


@dataclass(frozen=True)
class PackedRows:
    """Rows of tokens and, per row, the offsets where documents start (a ragged array, CSR style);
    instruction rows also say which tokens are trained on."""

    tokens: np.ndarray  # (rows, row_len) int32
    doc_start_values: np.ndarray  # int32, all rows' start offsets concatenated
    doc_start_offsets: np.ndarray  # (rows + 1,) int64: row i's starts are values[offsets[i]:offsets[i + 1]]
    loss_mask: np.ndarray | None = None  # (rows, row_len) int8, 1 where the token is a training target

    def __len__(self) -> int:
        return len(self.tokens)

    def doc_starts(self, row: int) -> np.ndarray:
        return self.doc_start_values[self.doc_start_offsets[row] : self.doc_start_offsets[row + 1]]

    def take(self, order: np.ndarray) -> PackedRows:
        """The rows in the given order (a permutation or a slice of row indices)."""
        values, offsets = _ragged_rows(self.doc_start_values, self.doc_start_offsets, order)
        loss_mask = None if self.loss_mask is None else self.loss_mask[order]
        return PackedRows(self.tokens[order], values, offsets, loss_mask)


def _ragged_rows(values: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The values and offsets of a CSR ragged array with its rows in the given order."""
    lengths = np.diff(offsets)[order]
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    gather = np.repeat(offsets[:-1][order] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return values[gather], new_offsets


def pack_documents(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    row_len: int,
    bos_id: int | None,
    eos_id: int,
    pad_id: int,
    last_row: Literal["drop", "pad"],
    order: np.ndarray | None = None,
    shuffle: np.random.Generator | None = None,
) -> PackedRows:
    """Pack documents given as their token ids concatenated and the number of tokens of each.

    With `order` (indices into `lengths`), only the documents at `order`, in that order, as
    `select_documents` would give them; with `shuffle`, the rows in the order of
    `shuffle.permutation(rows)`, as `take` would put them. Either way the rows are filled straight from
    `token_ids` a block at a time, with no array of the whole stream in between (each would be four bytes
    a token of new pages to fault in, on data prep's single-threaded tail).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    sources = np.cumsum(lengths) - lengths
    if order is not None:
        lengths, sources = lengths[order], sources[order]
    has_bos = bos_id is not None
    doc_lengths = lengths + 1 + has_bos
    doc_starts = np.cumsum(doc_lengths) - doc_lengths
    total = int(doc_lengths.sum())
    rows, remainder = divmod(total, row_len)
    if remainder and last_row == "pad":
        rows += 1
    used = min(total, rows * row_len)  # stream positions that hold documents, not padding
    row_order = None if shuffle is None else shuffle.permutation(rows)

    tokens = np.empty((rows, row_len), dtype=np.int32)
    destination = None if row_order is None else np.argsort(row_order)  # where each row of the stream goes
    shift = sources - doc_starts - has_bos  # position p of document i holds token_ids[p + shift[i]]
    ends = doc_starts + doc_lengths - 1
    _fill_rows(
        tokens,
        destination,
        np.asarray(token_ids, dtype=np.int32),
        doc_starts,
        shift,
        ends,
        used,
        (bos_id, eos_id, pad_id),
    )

    row_starts = np.arange(rows, dtype=np.int64) * row_len
    starts = np.union1d(row_starts, doc_starts[doc_starts < rows * row_len])
    offsets = np.searchsorted(starts, np.append(row_starts, rows * row_len)).astype(np.int64)
    values = (starts % row_len).astype(np.int32)
    if row_order is not None:
        values, offsets = _ragged_rows(values, offsets, row_order)
    return PackedRows(tokens, values, offsets)


def _fill_rows(
    tokens: np.ndarray,
    destination: np.ndarray | None,
    body: np.ndarray,
    doc_starts: np.ndarray,
    shift: np.ndarray,
    doc_ends: np.ndarray,
    used: int,
    special_ids: tuple[int | None, int, int],
) -> None:
    """Fill the rows of the stream a block at a time, each row into `tokens[destination[row]]` (in place
    when no destination is given); positions from `used` on are padding.

    A token's index into `body` is a running sum of ones that jumps at each document start (BOS and EOS
    read a neighbour, clipped at the ends, and are overwritten).
    """
    bos_id, eos_id, pad_id = special_ids
    row_len = tokens.shape[1]
    starts = doc_starts[doc_starts < used]
    jumps = np.diff(shift[: len(starts)], prepend=1) + 1
    rows_per_block = max(1, _BLOCK_TOKENS // row_len)
    block = None if destination is None else np.empty(rows_per_block * row_len, dtype=np.int32)
    index_so_far = 0
    for first_row in range(0, len(tokens), rows_per_block):
        end_row = min(first_row + rows_per_block, len(tokens))
        first, last = first_row * row_len, min(end_row * row_len, used)
        out = tokens[first_row:end_row].reshape(-1) if block is None else block[: (end_row - first_row) * row_len]
        index = np.ones(last - first, dtype=np.intp)
        lo, hi = np.searchsorted(starts, (first, last))
        index[starts[lo:hi] - first] = jumps[lo:hi]
        index[:1] += index_so_far
        np.cumsum(index, out=index)
        index_so_far = index[-1]  # every block holds a document token: padding is less than a row
        if len(body):  # else every position is a BOS or EOS
            np.take(body, index, out=out[: last - first], mode="clip")
        out[last - first :] = pad_id
        if bos_id is not None:
            out[starts[lo:hi] - first] = bos_id
        lo, hi = np.searchsorted(doc_ends, (first, last))
        out[doc_ends[lo:hi] - first] = eos_id
        if block is not None:
            tokens[destination[first_row:end_row]] = out.reshape(-1, row_len)


def select_documents(token_ids: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token ids and lengths of the documents at `order` (indices into `lengths`), in that order."""
    starts = np.cumsum(lengths) - lengths
    chosen = lengths[order]
    offsets = np.cumsum(chosen) - chosen
    # int32 indices while they fit: the gather is on data prep's single-threaded tail (3.9 -> 0.9 ms measured).
    index = np.int32 if len(token_ids) < 2**31 else np.int64
    gather = np.repeat((starts[order] - offsets).astype(index), chosen) + np.arange(int(chosen.sum()), dtype=index)
    return token_ids[gather], chosen


def first_fit_rows(lengths: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The row of each example and its offset in the row when each goes, in order, into the first row
    with room left (a new row when none has). Online: a prefix of `lengths` is placed exactly as it is
    within the whole, and rows are opened in increasing order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths > row_len).any():
        raise ValueError(f"an example of {lengths.max()} tokens does not fit in a row of {row_len}")
    room = np.zeros(len(lengths), dtype=np.int64)  # room left in each opened row; never more rows than examples
    opened = 0
    rows, offsets = np.empty(len(lengths), dtype=np.int64), np.empty(len(lengths), dtype=np.int64)
    for index, length in enumerate(lengths):
        fitting = np.flatnonzero(room[:opened] >= length)
        if len(fitting):
            row = fitting[0]
        else:
            row, opened = opened, opened + 1
            room[row] = row_len
        rows[index], offsets[index] = row, row_len - room[row]
        room[row] -= length
    return rows, offsets


def pack_examples(
    token_ids: np.ndarray, lengths: np.ndarray, loss_mask: np.ndarray, row_len: int, pad_id: int
) -> PackedRows:
    """Pack whole examples (their token ids and int8 loss masks concatenated, and the number of tokens of
    each) into padded rows by `first_fit_rows`; every example starts a document."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows, offsets = first_fit_rows(lengths, row_len)
    count = int(rows.max()) + 1 if len(rows) else 0
    tokens = np.full(count * row_len, pad_id, dtype=np.int32)
    mask = np.zeros(count * row_len, dtype=np.int8)
    starts = rows * row_len + offsets
    destination = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
    tokens[destination], mask[destination] = token_ids, loss_mask

    by_position = np.lexsort((offsets, rows))
    doc_start_offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=count))])
    return PackedRows(
        tokens.reshape(count, row_len),
        offsets[by_position].astype(np.int32),
        doc_start_offsets.astype(np.int64),
        mask.reshape(count, row_len),
    )
