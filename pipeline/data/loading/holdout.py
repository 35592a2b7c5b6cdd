"""``eval.holdout``'s held-out samples of a shard directory: the last ``ceil(fraction x N_s)`` of each source's
``N_s`` samples (in the directory's order), so validation scores every source in proportion to its size; training
reads the rest, with or without a mixture. In a directory of one source that is its last ``ceil(fraction x N)``
samples, and training reads the first ones, exactly as before sources existed.

Everything is a function of the manifest and the fraction alone (no I/O, nothing per sample but the scored ids),
so the split is the same on any number of ranks or workers, and resuming finds the same training samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.data.format.index import DatasetIndex
from pipeline.data.loading.mixture import SourceSamples


def held_out_count(num_samples: int, fraction: float) -> int:
    """The last ``ceil(fraction * num_samples)`` samples (of a source) are held out. (Rounded first: 0.07 x 100 is
    7.000000000000001 in floats.)"""
    return math.ceil(round(fraction * num_samples, 6))


@dataclass(frozen=True)
class ValidationSamples:
    """The fixed set validation scores: samples [first, first + count) of ``index``, or with ``ids`` those ``count``
    samples (ascending): taken per source from a :class:`Holdout`, they are no one range (:meth:`Holdout.scored`).
    A :class:`Holdout` is the split of a directory (what trains, what is held out); this is what is scored."""

    index: DatasetIndex
    first: int
    count: int
    ids: np.ndarray | None = None


@dataclass(frozen=True)
class Holdout:
    """Which samples of a directory training reads and which validation may score. ``train_counts`` and
    ``held_counts``: per source (sorted by name), how many of its first samples train and how many of its last are
    held out."""

    fraction: float
    train_counts: dict[str, int]
    held_counts: dict[str, int]
    train: SourceSamples  # the training samples, ascending global ids
    held: dict[str, SourceSamples]  # each source's held-out samples, ascending

    @property
    def train_count(self) -> int:
        return self.train.count

    @property
    def held_count(self) -> int:
        return sum(self.held_counts.values())

    @property
    def prefix(self) -> bool:
        """Training reads exactly samples [0, train_count): one source, or nothing held out."""
        return len(self.train.starts) <= 1 and (not len(self.train.starts) or self.train.starts[0] == 0)

    @property
    def limit(self) -> int | dict[str, int]:
        """What ``mixture.source_samples`` takes to read the training samples: their count when they are the first
        ones, else each source's."""
        return self.train_count if self.prefix else self.train_counts

    def scored(self, count: int) -> np.ndarray:
        """The ``count`` held-out samples validation scores (ascending global ids): from each source its first
        held-out ones, ``count`` apportioned to the sources in proportion to their held-out samples (largest
        remainders, ties to the name first in order), so a fixed set smaller than the holdout still holds every
        source in proportion."""
        total = self.held_count
        if not 0 <= count <= total:
            raise ValueError(f"{count} samples to score, but {total} are held out")
        quota = {name: count * k // total for name, k in self.held_counts.items()} if total else {}
        left = count - sum(quota.values())
        for name in sorted(quota, key=lambda n: (-(count * self.held_counts[n] % total), n))[:left]:
            quota[name] += 1
        ids = [self.held[name].global_ids(np.arange(n, dtype=np.int64)) for name, n in quota.items() if n]
        return np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)


def split(index: DatasetIndex, fraction: float) -> Holdout:
    """The held-out split of ``index`` at ``fraction`` (module docstring): O(shards)."""
    totals = {name: 0 for name in index.sources}
    for shard in index.shards:
        totals[shard.source] += shard.samples
    held = {name: held_out_count(n, fraction) for name, n in totals.items()}
    train = {name: totals[name] - held[name] for name in totals}
    train_runs: list[tuple[int, int]] = []
    held_runs: dict[str, list[tuple[int, int]]] = {name: [] for name in totals}
    seen, start = dict.fromkeys(totals, 0), 0
    for shard in index.shards:  # a source's samples are in global order: its held-out ones are its shards' last
        n = min(max(train[shard.source] - seen[shard.source], 0), shard.samples)
        train_runs.append((start, n))
        held_runs[shard.source].append((start + n, shard.samples - n))
        seen[shard.source] += shard.samples
        start += shard.samples
    return Holdout(fraction, train, held, SourceSamples.of(train_runs),
                   {name: SourceSamples.of(runs) for name, runs in held_runs.items()})
