"""Training batches from prepared token shards: a deterministic mixture of the data sources with an exact,
resumable position, reading from the shards only the rows of this rank's batches.

The position is the number of samples (rows) of the mixture's stream consumed (data/mixture.py), so it
means the same thing whatever the number of data-parallel ranks, the micro-batch size, the accumulation or
the global batch: each global batch is the next `global_batch_rows` samples, cut into equal per-rank
slices, and a run resumed under another batch continues at the next sample. Each source's epoch e is a
keyed permutation of its rows computed per position (data/permutation.py), so no array of every row is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_core.data import PackedRows, SplitRows
from model_core.data.mixture import Mixture, MixtureSource
from model_core.model.documents import document_positions
from model_core.parallel.context import sequence_chunks

Rows = SplitRows | PackedRows  # anything with len() and take(indices) -> PackedRows
# Names the order function in the saved state: a position saved under another order means other samples.
_ORDER = "mixture-sainte-lague-keyed-feistel-1"


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
    """Rows of global batches drawn from the mixture of the split's sources; this rank's slice of each,
    resumable exactly at any batch size.

    Without `sources` the split is one source (share 1). Every batch is full: a source read to its end goes
    on with its next epoch, and the stream is a pure function of (seed, sources, samples consumed).
    """

    def __init__(
        self,
        rows: Rows,
        global_batch_rows: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        sources: list[MixtureSource] | None = None,
    ) -> None:
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
        self.mixture = Mixture(sources or [MixtureSource("source0", 0, len(rows), 1.0)], seed)
        self.samples = 0  # of the mixture's stream consumed, by every rank together
        self.last_samples = np.empty(0, np.int64)  # the sample numbers of this rank's rows of the last batch

    def next_rows(self) -> PackedRows:
        """This rank's rows of the next global batch."""
        per_rank = self.global_batch_rows // self.world
        start = self.samples + self.rank * per_rank
        self.last_samples = np.arange(start, start + per_rank, dtype=np.int64)
        self.samples += self.global_batch_rows
        return self.rows.take(self.mixture.rows(self.last_samples)[0])

    def consumed(self) -> dict[str, tuple[int, float]]:
        """Per source: the samples the run has read of it and the epochs read in all (above 1: repeated; those
        of a run this one continues included)."""
        counts = self.mixture.consumed(self.samples)
        return {
            source.name: (count, before + (count / source.rows if source.rows else 0.0))
            for source, count, before in zip(self.mixture.sources, counts, self.mixture.epochs_before)
        }

    def _identity(self) -> dict:
        return {"seed": self.seed, "order": _ORDER, "sources": self.mixture.identity()}

    def state_dict(self) -> dict:
        epochs = {name: read for name, (_, read) in self.consumed().items()}
        return {
            "samples": self.samples, "global_batch_rows": self.global_batch_rows, "epochs": epochs,
            "epochs_before": self.mixture.epochs_before, **self._identity(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved sample, whatever batch it was saved under (`state["global_batch_rows"]`)."""
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ValueError(
                    f"data-loader state was saved with {key}={state.get(key)} but this run has {key}={mine}; "
                    "the saved position would point at different samples"
                )
        self.samples = state["samples"]
        self.mixture.epochs_before = list(state["epochs_before"])


def sequential_batches(rows: Rows, batch_rows: int, count: int, pad_id: int, reset_at_documents: bool):
    """The first `count` batches of a split in file order (validation: same batches every time); each batch
    reads only its own rows."""
    for start in range(0, min(count * batch_rows, len(rows) - batch_rows + 1), batch_rows):
        yield make_batch(rows.take(np.arange(start, start + batch_rows)), pad_id, reset_at_documents)
