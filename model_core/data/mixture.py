"""A weighted mixture of data sources as one stream of samples: which source's row sample g is, for any g,
computed from g alone, with no array of every row.

Each source has a share of the samples (`shares`: a weight as given, or its epochs x rows over a mixture
cycle). The shares are apportioned over a period of PERIOD samples as integer quotas (largest remainder,
at least one for a source with a share), and the period's samples are handed out by the Sainte-Laguë
order: source s's k-th sample of the period falls at time (2k + 1) / (2 quota_s), and the period is every
source's times merged (ties by source). That order is the one a smooth weighted round robin gives: at every
prefix of the period each source's count is within about one sample of its share of the prefix, so any
window of a few hundred samples holds each source close to its share (tests/test_mixture.py measures it).

Sample g is sample k of its source (k counts that source's earlier samples, period by period), and k is
row `KeyedPermutation(rows, (seed, source, epoch)).forward(k % rows)` of the source, epoch = k // rows: a
source read to its end starts its next epoch in another order. The position of a run is the number of
samples consumed: it means the same samples however they were batched (any global batch, any number of
data-parallel ranks), so a run resumes under another batch without repeating or skipping one.

A run that continues an earlier one on new data (continued pretraining, a mixture whose sources grew)
starts the new stream at its first sample and carries each source's epochs by name (`carry`): a source read
1.5 times goes on counting from 1.5, and its new rows are read in the orders of epochs 2, 3, ..., never one
the earlier run used. Rows are not matched across the two datasets (a grown source is packed and shuffled
anew), so a grown source's next epoch is its old documents and its new ones together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model_core.data.permutation import KeyedPermutation
from params.rules import source_names
from params.schema import DataSource

PERIOD = 1 << 16  # samples of one apportionment period: shares are met to 1 / PERIOD


class MixtureError(ValueError):
    """A mixture the dataset cannot give (a weight on a source with no rows); the message names the source."""


@dataclass(frozen=True)
class MixtureSource:
    name: str
    first_row: int  # its rows are [first_row, first_row + rows) of the split
    rows: int
    share: float  # of the mixture's samples


def mixture_sources(sources: Sequence[DataSource], split: dict, dataset: str) -> list[MixtureSource]:
    """The sources of a prepared split (its manifest entry) with their shares of the mixture.

    A weight is the source's share. The other sources are read by epochs (1 when unset) and share what the
    weights leave in proportion to epochs x rows, so a mixture cycle reads each of them `epochs` times.
    """
    names = source_names(sources)
    counts = split.get("sources")
    if counts is None or len(counts) != len(sources):
        made = "no per-source rows" if counts is None else f"{len(counts)} sources"
        raise MixtureError(
            f"dataset {dataset} was prepared with {made} but data.sources lists {len(sources)}; prepare the data again"
        )
    for name, source, count in zip(names, sources, counts):
        if source.weight is not None and count["rows"] == 0:
            raise MixtureError(
                f"data source {name} has weight {source.weight} but no training rows in dataset {dataset} (its "
                f"{count['documents']} kept documents make {count['tokens']} tokens, less than one row); drop its "
                "weight, give it more data or a shorter model.seq_len"
            )
    weights = [source.weight for source in sources]
    weighted = sum(weight for weight in weights if weight is not None)
    by_epochs = [
        (source.epochs if source.epochs is not None else 1.0) * count["rows"] if source.weight is None else 0.0
        for source, count in zip(sources, counts)
    ]
    if None in weights and sum(by_epochs) == 0:
        unweighted = ", ".join(name for name, weight in zip(names, weights) if weight is None)
        raise MixtureError(
            f"data sources {unweighted} (read by epochs) have no training rows in dataset {dataset}, so the share "
            f"{1 - weighted:.6g} the weights leave cannot be met"
        )
    if None not in weights:  # every source weighted: the weights sum to 1 within the schema's tolerance
        shares = [weight / weighted for weight in weights]
    else:
        rest = (1.0 - weighted) / sum(by_epochs)
        shares = [weight if weight is not None else rest * part for weight, part in zip(weights, by_epochs)]
    return [
        MixtureSource(name, count.get("first_row", 0), count["rows"], share)
        for name, count, share in zip(names, counts, shares)
    ]


def quotas(shares: Sequence[float], period: int = PERIOD) -> list[int]:
    """Integer samples per period for each share (largest remainder; at least 1 for a positive share)."""
    exact = np.asarray(shares, dtype=np.float64) * period / max(sum(shares), 1e-300)
    counts = np.floor(exact).astype(np.int64)
    counts[(exact > 0) & (counts == 0)] = 1
    remainder = exact - counts
    while counts.sum() != period:
        if counts.sum() < period:
            counts[int(np.argmax(remainder))] += 1
            remainder[int(np.argmax(remainder))] = -np.inf
        else:
            largest = int(np.argmax(np.where(counts > 1, counts, -1)))
            counts[largest] -= 1
    return counts.tolist()


class Mixture:
    """The mixture's sample stream: `rows(samples)` gives each sample's split row and source."""

    def __init__(self, sources: Sequence[MixtureSource], seed: int, period: int = PERIOD) -> None:
        self.sources = list(sources)
        self.seed = seed
        self.period = period
        self.quotas = quotas([source.share for source in self.sources], period)
        owner = np.repeat(np.arange(len(self.sources)), self.quotas)
        rank = np.concatenate([np.arange(quota) for quota in self.quotas])
        times = (2 * rank + 1) / (2 * np.asarray(self.quotas, dtype=np.float64)[owner])
        order = np.lexsort((owner, times))  # IEEE division and a stable sort: the same order on every platform
        self._period_source = owner[order].astype(np.int32)
        self._period_rank = rank[order].astype(np.int64)
        self.epochs_before = [0.0] * len(self.sources)  # read by the run this one continues (`carry`)

    def carry(self, epochs: dict[str, float]) -> None:
        """Go on from the epochs an earlier run read of each source, by name (others start at 0)."""
        self.epochs_before = [float(epochs.get(source.name, 0.0)) for source in self.sources]

    def identity(self) -> list[dict]:
        """What decides the stream besides the seed: each source's rows and quota."""
        return [
            {"name": source.name, "first_row": source.first_row, "rows": source.rows, "quota": quota}
            for source, quota in zip(self.sources, self.quotas)
        ]

    def rows(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(split row, source index) of each global sample number."""
        samples = np.asarray(samples, dtype=np.int64)
        cycle, at = np.divmod(samples, self.period)
        source = self._period_source[at]
        within = cycle * np.asarray(self.quotas, dtype=np.int64)[source] + self._period_rank[at]
        rows = np.empty(len(samples), dtype=np.int64)
        for index in np.unique(source).tolist():
            mine = np.flatnonzero(source == index)
            entry = self.sources[index]
            epoch, offset = np.divmod(within[mine], entry.rows)
            first_epoch = math.ceil(self.epochs_before[index])  # past every epoch an earlier run started
            for value in np.unique(epoch).tolist():
                chosen = mine[epoch == value]
                order = KeyedPermutation(entry.rows, (self.seed, index, first_epoch + value))
                rows[chosen] = entry.first_row + order.forward(offset[epoch == value]).astype(np.int64)
        return rows, source

    def consumed(self, samples: int) -> list[int]:
        """Samples each source gave to the first `samples` of the stream."""
        cycle, at = divmod(samples, self.period)
        partial = np.bincount(self._period_source[:at], minlength=len(self.sources))
        return [cycle * quota + int(count) for quota, count in zip(self.quotas, partial)]
