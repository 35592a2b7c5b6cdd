"""Source mixtures: which source each position of the training order reads, and which of its samples, by index
arithmetic alone (no I/O, nothing materialised per sample).

The semantics are OLMo-core's ``SourceMixtureDataset``: each source has a target ratio (the ratios sum to 1) and a
maximum repetition; over the run's budget (``train.steps`` x global batch samples) a source supplies its ratio of
the samples, and a source that would have to repeat its samples more often than its maximum allows is an error
(:func:`check_budget`) before training starts.

The order is one global, endless sequence of positions, the same for any number of ranks or workers:

- **Which source.** The sources (sorted by name) are the leaves of a balanced binary tree; each inner node splits
  the items that reach it between its two halves in proportion to their ratios, the k-th item going left when
  ``floor((k + 1) * L / T + 1/2)`` exceeds ``floor(k * L / T + 1/2)`` (L / T the left half's share, in integers).
  So every prefix of positions, and every global batch, holds each source's ratio to within about one sample per
  tree level, and position -> (source, index within the source) is a few integer operations per tree level.
- **Which sample.** The source's k-th item is its epoch ``k // N`` (N its training samples), slot ``k % N``,
  through a seeded Feistel permutation of its samples per epoch (``order.permute``, streamed by the source's name):
  within one repetition every sample comes once, and a repetition factor r reads each at most ``ceil(r)`` times.

Ratios are quantised to multiples of 2**-20 (:data:`SCALE`); :attr:`MixturePlan.ratios` are the ones trained.

The same plan mixes the tasks of pairs shards (``data.pair_mixture``: a pairs shard's source is its rows' task),
and with ``data.pair_batching: same_task`` routes whole global batches instead of samples
(``order.SameTaskOrder``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from pipeline.data.format.index import DatasetIndex
from pipeline.data.loading.permutation import MAX_POSITION, permute

SCALE = 1 << 20  # ratios are integers over this


class MixtureError(ValueError):
    """A mixture the shards cannot serve (an unknown source, a source too small for its share)."""


# how a directory comes to hold the one source "default", by the setting that mixes its sources
_UNNAMED = {"data.mixture": "shards built without --source-field are the one source 'default'",
            "data.pair_mixture": "pairs shards built before they recorded their rows' tasks are the one source "
                                 "'default': rebuild them into a new directory"}


def quantise(ratios: dict[str, float]) -> dict[str, int]:
    """Integer weights (sorted by name) of ``ratios`` over :data:`SCALE`, each at least 1."""
    total = sum(ratios.values())
    return {name: max(1, round(ratios[name] / total * SCALE)) for name in sorted(ratios)}


def source_stream(name: str) -> int:
    """The permutation stream of a source: its name's hash, so a source's order ignores which others are mixed."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


@dataclass(frozen=True)
class SourceSamples:
    """A source's training samples as runs of consecutive global sample ids: run r holds ids
    ``starts[r] .. starts[r] + (offsets[r + 1] - offsets[r]) - 1``."""

    starts: np.ndarray  # int64 [runs]
    offsets: np.ndarray  # int64 [runs + 1], from 0 to the source's sample count

    @classmethod
    def of(cls, runs: list[tuple[int, int]]) -> SourceSamples:
        """The samples of ``runs`` (first id, count), ascending; empty runs dropped, adjacent ones joined."""
        joined: list[tuple[int, int]] = []
        for start, n in runs:
            if n and joined and sum(joined[-1]) == start:
                joined[-1] = (joined[-1][0], joined[-1][1] + n)
            elif n:
                joined.append((start, n))
        return cls(np.array([s for s, _ in joined], dtype=np.int64),
                   np.cumsum([0] + [n for _, n in joined], dtype=np.int64))

    @property
    def count(self) -> int:
        return int(self.offsets[-1])

    def global_ids(self, j: np.ndarray) -> np.ndarray:
        run = np.searchsorted(self.offsets, j, side="right") - 1
        return self.starts[run] + (j - self.offsets[run])


def source_samples(index: DatasetIndex, num_samples: int | dict[str, int] | None = None) -> dict[str, SourceSamples]:
    """Each source's training samples: those among the first ``num_samples`` global ids (default all: the rest are
    held out), or with a mapping ``{source: n}`` (``holdout.Holdout.limit``) each source's first n."""
    runs: dict[str, list[tuple[int, int]]] = {name: [] for name in index.sources}
    seen, start = dict.fromkeys(runs, 0), 0
    for shard in index.shards:
        if isinstance(num_samples, dict):
            n = min(max(num_samples[shard.source] - seen[shard.source], 0), shard.samples)
        else:
            n = max(0, min(shard.samples, (index.num_samples if num_samples is None else num_samples) - start))
        runs[shard.source].append((start, n))
        seen[shard.source] += shard.samples
        start += shard.samples
    return {name: SourceSamples.of(r) for name, r in runs.items()}


@dataclass(frozen=True)
class MixturePlan:
    """Position -> global sample id of a mixture (module docstring). ``weights``: integer weights of the mixed
    sources, sorted by name; ``samples``: their training samples."""

    weights: tuple[tuple[str, int], ...]
    samples: tuple[SourceSamples, ...]
    seed: int

    @classmethod
    def build(cls, index: DatasetIndex, ratios: dict[str, float], seed: int,
              num_samples: int | dict[str, int] | None = None, setting: str = "data.mixture") -> MixturePlan:
        """The plan of ``ratios`` over the training samples of ``index`` (``num_samples`` as in
        :func:`source_samples`); errors name ``setting`` (``data.pair_mixture`` for the tasks of pairs shards)."""
        available = source_samples(index, num_samples)
        unknown = sorted(set(ratios) - set(available))
        if unknown:
            held = ", ".join(f"{name} ({s.count} samples)" for name, s in available.items())
            raise MixtureError(f"{setting}: {', '.join(map(repr, unknown))} not among the sources of "
                               f"{index.directory}: {held}; name its sources ({_UNNAMED[setting]})")
        empty = [name for name in sorted(ratios) if available[name].count == 0]
        if empty:
            raise MixtureError(f"{setting}: source {empty[0]!r} has no training samples in {index.directory} "
                               f"(all held out by eval.holdout?); drop it from {setting} or hold out less")
        weights = quantise(ratios)
        return cls(tuple(weights.items()), tuple(available[name] for name in weights), seed)

    @classmethod
    def of_ratios(cls, ratios: dict[str, float]) -> MixturePlan:
        """A plan without samples: what each source supplies (:meth:`counts`), not which samples (the planner's)."""
        return cls(tuple(quantise(ratios).items()), (), 0)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.weights)

    @property
    def ratios(self) -> dict[str, float]:
        """The trained ratios (the configured ones, quantised)."""
        total = sum(w for _, w in self.weights)
        return {name: w / total for name, w in self.weights}

    def _cum(self) -> list[int]:
        return [0, *np.cumsum([w for _, w in self.weights]).tolist()]

    def counts(self, positions: int) -> dict[str, int]:
        """How many of the first ``positions`` positions each source supplies (they sum to ``positions``)."""
        cum, out = self._cum(), {}

        def split(n: int, lo: int, hi: int) -> None:
            if hi - lo == 1:
                out[self.weights[lo][0]] = n
                return
            mid = (lo + hi) // 2
            left = (n * (cum[mid] - cum[lo]) + (cum[hi] - cum[lo]) // 2) // (cum[hi] - cum[lo])
            split(left, lo, mid)
            split(n - left, mid, hi)

        split(positions, 0, len(self.weights))
        return out

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index into :attr:`names`, index among that source's items) of each position."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and (positions.min() < 0 or positions.max() >= MAX_POSITION):
            raise ValueError(f"mixture positions must be in [0, 2**42), got {positions.min()}..{positions.max()}")
        cum = self._cum()
        source, local = np.empty_like(positions), np.empty_like(positions)

        def route(k: np.ndarray, where: np.ndarray, lo: int, hi: int) -> None:
            if hi - lo == 1:
                source[where], local[where] = lo, k
                return
            mid = (lo + hi) // 2
            share, total = cum[mid] - cum[lo], cum[hi] - cum[lo]
            before = (k * share + total // 2) // total
            left = (k + 1) * share + total // 2 >= (before + 1) * total
            route(before[left], where[left], lo, mid)
            route((k - before)[~left], where[~left], mid, hi)

        route(positions, np.arange(len(positions)), 0, len(self.weights))
        return source, local

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """The global sample id at each position."""
        source, local = self.locate(positions)
        out = np.empty_like(source)
        for s in range(len(self.samples)):
            mine = np.flatnonzero(source == s)
            if len(mine):
                out[mine] = self.source_ids(s, local[mine])
        return out

    def source_ids(self, s: int, local: np.ndarray) -> np.ndarray:
        """The global sample ids of items ``local`` of source ``s`` (index into :attr:`names`): item k is slot
        ``k % N`` of its repetition ``k // N``'s permutation."""
        samples, local = self.samples[s], np.asarray(local, dtype=np.int64)
        out = np.empty_like(local)
        epoch, slot = np.divmod(local, samples.count)
        for e in np.unique(epoch):
            at = epoch == e
            out[at] = samples.global_ids(permute(slot[at], samples.count, self.seed, int(e),
                                                 stream=source_stream(self.names[s])))
        return out


@dataclass(frozen=True)
class Budget:
    """A run's budget in samples, and what it asks of each source."""

    steps: int
    global_batch: int
    seq_len: int

    @property
    def samples(self) -> int:
        return self.steps * self.global_batch

    def describe(self) -> str:
        return (f"{self.steps:,} steps x {self.global_batch:,} samples x {self.seq_len:,} tokens "
                f"({self.samples * self.seq_len:,} tokens)")


def check_budget(plan: MixturePlan, budget: Budget, max_repetition: dict[str, float],
                 setting: str = "data.mixture") -> list[str]:
    """Raise :class:`MixtureError` naming the source furthest from supplying its share of ``budget`` within its
    ``max_repetition`` (and any other short one), and ``setting``; else one line per source: its ratio, the samples
    and tokens it supplies, and how many times over that reads its samples."""
    need = plan.counts(budget.samples)
    have = {name: samples.count for name, samples in zip(plan.names, plan.samples)}
    short = sorted((n for n in plan.names if need[n] > math.floor(max_repetition[n] * have[n])),
                   key=lambda n: -need[n] / max(math.floor(max_repetition[n] * have[n]), 1e-9))
    if short:
        also = f" (also short: {', '.join(short[1:])})" if short[1:] else ""
        raise MixtureError(_shortfall(plan, budget, short[0], need[short[0]], have[short[0]],
                                      max_repetition[short[0]], setting) + also)
    lines = []
    for name in plan.names:
        ratio, limit = plan.ratios[name], max_repetition[name]
        lines.append(f"{name}: ratio {ratio:.4g}, {need[name]:,} samples ({need[name] * budget.seq_len:,} tokens) of "
                     f"its {have[name]:,}: {need[name] / have[name]:.2f}x (max {limit:g}x)")
    return lines


def _shortfall(plan: MixturePlan, budget: Budget, name: str, need: int, have: int, limit: float,
               setting: str) -> str:
    cap = math.floor(limit * have)
    steps = cap // max(math.ceil(plan.ratios[name] * budget.global_batch), 1)
    while steps < budget.steps and plan.counts((steps + 1) * budget.global_batch)[name] <= cap:
        steps += 1  # from a lower bound up to the last step count whose share fits
    tokens = budget.seq_len
    return (f"{setting}: source {name!r} cannot supply its share of the run: ratio {plan.ratios[name]:.4g} of "
            f"{budget.describe()} needs {need:,} of its samples ({need * tokens:,} tokens), but it has {have:,} "
            f"({have * tokens:,} tokens) and max_repetition {limit:g} allows {cap:,} ({need / have:.2f}x needed); "
            f"lower its ratio to at most {cap / budget.samples:.4g}, raise {setting}.{name}.max_repetition (or "
            f"data.mixture_max_repetition) to {math.ceil(need / have * 100) / 100:g} or more, shorten train.steps to "
            f"{steps:,}, or add data of that source")
