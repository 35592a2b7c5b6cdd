"""A seeded permutation of [0, n) computed position by position: the orders (``order.py``) and the source
mixture (``mixture.py``) both draw from it, so neither needs the other to permute."""

from __future__ import annotations

import numpy as np

MAX_POSITION = 1 << 42  # positions of a mixture order (pipeline.data.loading.mixture keeps positions * 2**20 in int64)
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
