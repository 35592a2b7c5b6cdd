"""Which samples go into which micro-batch: pure index arithmetic, no I/O.

The training order is one global sequence per epoch, a seeded permutation of all sample ids, cut into global
batches of ``micro_batch * grad_accum * dp_world`` samples; the epoch's remainder is dropped so that every rank
gets the same number of micro-batches. Because every position is computed, not replayed, resuming at any global
sample costs nothing and does not depend on the number of ranks or dataloader workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.data.mixture import MixturePlan, SourceSamples

MAX_POSITION = 1 << 42  # positions of a mixture order (pipeline.data.mixture keeps positions * 2**20 in int64)

_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, num_samples: int, seed: int, epoch: int, stream: int | None = None) -> np.ndarray:
    """The sample ids at ``positions`` of epoch ``epoch``'s order: a seeded bijection of [0, num_samples).

    A Feistel network over the next even power of two, cycle-walked back into range, instead of a materialized
    ``rng.permutation(num_samples)``: the order of a 300M-sample corpus then costs no memory and no start-up time
    in each rank and worker. Round keys come from ``np.random.SeedSequence``, whose output numpy guarantees
    across versions, so a resumed run sees the same order after an upgrade. ``stream`` gives an independent
    permutation for each of several sequences under one seed (a mixture's sources).
    """
    half = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    shift, low = np.uint64(half), np.uint64((1 << half) - 1)
    entropy = [seed, epoch] if stream is None else [seed, epoch, stream]
    keys = np.random.SeedSequence(entropy).generate_state(_ROUNDS, dtype=np.uint64)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & low
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & low)
        return (left << shift) | right

    x = feistel(np.asarray(positions, dtype=np.uint64))
    outside = np.flatnonzero(x >= num_samples)
    while len(outside):  # terminates: each cycle of the bijection that starts in range comes back into range
        x[outside] = feistel(x[outside])
        outside = outside[x[outside] >= num_samples]
    return x.astype(np.int64)


@dataclass(frozen=True)
class TrainOrder:
    """Rank ``dp_rank``'s endless micro-batch sequence, starting at absolute global step ``start_step``
    (``epoch * steps_per_epoch + step``). Global batch ``s`` of an epoch is positions [s*G, (s+1)*G) of its order;
    rank r takes the contiguous slice [r*M*GA, (r+1)*M*GA) of it, cut into GA micro-batches of M. The order
    permutes [0, num_samples), which are the sample ids themselves, or with ``ids`` (``num_samples`` of them: the
    training samples of a directory whose held-out ones are not its last, ``holdout.Holdout.train``) indexes into
    them."""

    num_samples: int
    seed: int
    micro_batch: int
    grad_accum: int
    dp_rank: int
    dp_world: int
    start_step: int = 0
    ids: SourceSamples | None = None

    @property
    def num_batches(self) -> None:
        return None  # endless: epochs follow each other

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_world

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def sample_ids(self, j: int) -> np.ndarray:
        """Global sample ids of this rank's ``j``-th micro-batch counted from ``start_step``."""
        step, micro = divmod(self.start_step * self.grad_accum + j, self.grad_accum)
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        first = step_in_epoch * self.global_batch + (self.dp_rank * self.grad_accum + micro) * self.micro_batch
        return self._at(np.arange(first, first + self.micro_batch), epoch)

    def _at(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        order = permute(positions, self.num_samples, self.seed, epoch)
        return order if self.ids is None else self.ids.global_ids(order)


@dataclass(frozen=True)
class MixtureOrder(TrainOrder):
    """:class:`TrainOrder` over a source mixture (``pipeline.data.mixture``): one endless epoch whose positions
    ``plan`` maps to sample ids; batches and ranks slice the positions as in :class:`TrainOrder`. The sources'
    own epochs live inside the plan."""

    plan: MixturePlan | None = None

    @property
    def steps_per_epoch(self) -> int:
        return MAX_POSITION // self.global_batch

    def _at(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        return self.plan.sample_ids(positions)


@dataclass(frozen=True)
class EvalOrder:
    """Samples ``first`` .. ``first + num_samples - 1`` once each, in stored order. Round t covers [t*M*W, (t+1)*M*W)
    of them and rank r takes the r-th slice of M, so all ranks get the same number of micro-batches (ZeRO-3's
    forward is a collective). Slots past the last sample are -1: the loader fills them with padding rows, so every
    micro-batch has M rows. With ``ids`` (``num_samples`` sample ids, ascending) slot i is ``ids[i]`` instead of
    ``first + i``: a held-out set that is not one range (``holdout.Holdout.scored``)."""

    num_samples: int
    micro_batch: int
    dp_rank: int
    dp_world: int
    first: int = 0
    ids: np.ndarray | None = None

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // (self.micro_batch * self.dp_world))

    def sample_ids(self, j: int) -> np.ndarray:
        ids = np.arange(self.micro_batch) + (j * self.dp_world + self.dp_rank) * self.micro_batch
        inside = ids < self.num_samples
        if self.ids is not None:
            return np.where(inside, self.ids[np.where(inside, ids, 0)], -1)
        return np.where(inside, ids + self.first, -1)
