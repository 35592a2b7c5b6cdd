"""MAGNET span boundaries: contiguous spans inside single documents, precomputed per sample."""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import numpy as np


def sample_spans(segments: np.ndarray, rng: np.random.Generator, min_len: int, max_len: int,
                 fraction: float) -> np.ndarray:
    """Non-overlapping [start, end) spans covering about ``fraction`` of the document tokens.

    Lengths are uniform in [min_len, max_len] (the last one shortened towards the target, never below min_len).
    Every span starts at least one token after its document piece begins, so the token before it is context
    (it predicts the span's first token), and spans never touch, so each is a separate span. Returns int32 [m, 2].
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"span lengths need 1 <= min_len <= max_len, got {min_len}..{max_len}")
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"span fraction must be in [0, 1), got {fraction}")
    # Plain Python over the few candidates actually examined: numpy's per-call overhead cost more than the work.
    pieces = segments.tolist()
    lengths = [e - s for s, e in pieces]
    total = sum(lengths)
    target = int(round(fraction * total))
    if target == 0 or not any(n - 1 >= min_len for n in lengths):
        return np.zeros((0, 2), dtype=np.int32)
    # Each candidate is one raw 64-bit draw (numpy keeps raw output across versions): the low half picks a length,
    # the high half a uniformly random start token (modulo bias < total / 2**32). It is kept when it fits its
    # document piece and neither overlaps nor touches an earlier span.
    width = max_len - min_len + 1
    cum = list(accumulate(lengths, initial=0))
    taken = bytearray(pieces[-1][1] + 2)  # segments are in order: the last one ends last
    spans: list[tuple[int, int]] = []
    covered = drawn = 0
    limit = 8 * (target // min_len + 1)
    while covered < target and drawn < limit:  # a sample usually needs ~20 draws: fetch them 32 at a time
        batch = rng.bit_generator.random_raw(min(32, limit - drawn)).tolist()
        drawn += len(batch)
        for r in batch:
            offset = (r >> 32) % total
            k = bisect_right(cum, offset) - 1
            lo, hi = pieces[k]
            s = lo + offset - cum[k]
            n = min_len + (r & 0xFFFFFFFF) % width
            if n > target - covered:  # shorten the last span towards the target (inline: min/max cost 20 %)
                n = max(target - covered, min_len)
            if s <= lo or s + n > hi or taken.find(1, s - 1, s + n + 1) != -1:
                continue
            taken[s : s + n] = b"\x01" * n
            spans.append((s, s + n))
            covered += n
            if covered >= target:
                break
    spans.sort()
    return np.array(spans, dtype=np.int32).reshape(-1, 2)
