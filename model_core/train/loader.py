"""Training batches from prepared token shards: a deterministic per-epoch shuffle with an exact,
resumable position, reading from the shards only the rows of this rank's batches.

The position counts rows of the *global* sample stream (epoch, cursor), so it means the same thing
whatever the number of data-parallel ranks: each global batch is cut into equal per-rank slices. Epoch e's
order is a keyed permutation computed per position (data/permutation.py), so no array of every row is made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from model_core.data import PackedRows, SplitRows
from model_core.data.permutation import KeyedPermutation
from model_core.model.documents import document_positions
from model_core.parallel.context import sequence_chunks

Rows = SplitRows | PackedRows  # anything with len() and take(indices) -> PackedRows
# Names the order function in the saved state: a position saved under another order means other samples.
_ORDER = "keyed-feistel-1"


@dataclass(frozen=True)
class Batch:
    """One micro-batch: inputs, next-token labels, a loss mask and optional document-reset positions."""

    tokens: np.ndarray  # (B, T) int32
    labels: np.ndarray  # (B, T) int32
    loss_mask: np.ndarray  # (B, T) float32: 1 where the label is a real token (and, for instructions, a response)
    position_ids: np.ndarray | None  # (B, T) int32, restarting at document starts
    segment_ids: np.ndarray | None  # (B, T) int32, document index within the row

    @property
    def counted_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class LoaderPosition:
    epoch: int = 0
    cursor: int = 0  # rows of this epoch's permutation already handed out


def make_batch(rows: PackedRows, pad_id: int, reset_at_documents: bool) -> Batch:
    """Inputs and next-token labels of the rows; the loss counts every non-padding label, narrowed to the
    stored loss mask (responses only) when the rows carry one."""
    tokens = rows.tokens
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss_mask = (labels != pad_id).astype(np.float32)
    if rows.loss_mask is not None:
        loss_mask *= rows.loss_mask[:, 1:]
    if not reset_at_documents:
        return Batch(inputs, labels, loss_mask, None, None)
    length = inputs.shape[1]
    pairs = [document_positions(rows.doc_starts(row), length) for row in range(len(rows))]
    return Batch(
        inputs, labels, loss_mask, np.stack([p for p, _ in pairs]), np.stack([s for _, s in pairs])
    )


def context_shard(batch: Batch, cp: int, index: int) -> Batch:
    """Context-parallel rank `index`'s part of every row of `batch` (`parallel.context.sequence_chunks`: two of
    2 x cp chunks): its tokens, labels and loss mask, with the positions of the whole row for RoPE and its document
    segment ids, made when the batch has none (0..T-1, one segment), since the rank's tokens no longer start at 0
    nor sit next to each other. The whole batch for cp = 1."""
    if cp == 1:
        return batch
    rows, length = batch.tokens.shape
    positions, segments = batch.position_ids, batch.segment_ids
    if positions is None:
        positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
    if segments is None:
        segments = np.zeros((rows, length), np.int32)
    mine = sequence_chunks(length, cp, index)
    parts = (batch.tokens, batch.labels, batch.loss_mask, positions, segments)
    return Batch(*(np.ascontiguousarray(part[:, mine]) for part in parts))


class ShuffledBatches:
    """Rows of global batches in a seeded per-epoch order; this rank's slice of each, resumable exactly.

    Epoch e visits the rows in `KeyedPermutation(len(rows), (seed, e))`; a remainder smaller than a global
    batch is skipped, so every batch is full and the stream is a pure function of (seed, position).
    """

    def __init__(self, rows: Rows, global_batch_rows: int, seed: int, rank: int = 0, world: int = 1) -> None:
        if len(rows) < global_batch_rows:
            raise ValueError(
                f"the split has {len(rows)} rows, fewer than one global batch of {global_batch_rows} rows; "
                "prepare more data or lower train.micro_batch_size / grad_accum_steps"
            )
        if global_batch_rows % world:
            raise ValueError(f"global batch of {global_batch_rows} rows does not split over {world} ranks")
        self.rows = rows
        self.global_batch_rows = global_batch_rows
        self.seed = seed
        self.rank = rank
        self.world = world
        self.position = LoaderPosition()

    def next_rows(self) -> PackedRows:
        """This rank's rows of the next global batch."""
        if self.position.cursor + self.global_batch_rows > len(self.rows):
            self.position = LoaderPosition(self.position.epoch + 1, 0)
        order = KeyedPermutation(len(self.rows), (self.seed, self.position.epoch))
        per_rank = self.global_batch_rows // self.world
        start = self.position.cursor + self.rank * per_rank
        self.position = LoaderPosition(self.position.epoch, self.position.cursor + self.global_batch_rows)
        return self.rows.take(order.forward(np.arange(start, start + per_rank)).astype(np.int64))

    def _identity(self) -> dict:
        return {"seed": self.seed, "rows": len(self.rows), "global_batch_rows": self.global_batch_rows, "order": _ORDER}

    def state_dict(self) -> dict:
        return {**asdict(self.position), **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ValueError(
                    f"data-loader state was saved with {key}={state.get(key)} but this run has {key}={mine}; "
                    "the saved position would point at different samples"
                )
        self.position = LoaderPosition(state["epoch"], state["cursor"])


def sequential_batches(rows: Rows, batch_rows: int, count: int, pad_id: int, reset_at_documents: bool):
    """The first `count` batches of a split in file order (validation: same batches every time); each batch
    reads only its own rows."""
    for start in range(0, min(count * batch_rows, len(rows) - batch_rows + 1), batch_rows):
        yield make_batch(rows.take(np.arange(start, start + batch_rows)), pad_id, reset_at_documents)
