"""Cheap token-level edits that make SSCL's positive view x+ from a sentence's tokens.

Each edit changes about ``ratio`` of the tokens and never returns an empty sentence. Its randomness comes from
the sample key and a seed only (no RNG state in the training loop), so a resumed run, any world size and any
worker count see the same edits; a unit seen again in a later epoch gets the same edit.

- ``delete``: drops each token with probability ``ratio`` (SimCSE's "word deletion", on tokens);
- ``crop``: keeps one contiguous window of ``1 - ratio`` of the tokens;
- ``swap``: exchanges two non-overlapping spans of ``ratio / 2`` of the tokens each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np


def edit_rng(key: str, seed: int) -> np.random.Generator:
    """An RNG that depends only on the sample key and the seed."""
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, digest])


def delete(tokens: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    keep = rng.random(len(tokens)) >= ratio
    if len(tokens) and not keep.any():
        keep[rng.integers(len(tokens))] = True
    return tokens[keep]


def crop(tokens: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    n = max(1, round((1.0 - ratio) * len(tokens)))
    start = int(rng.integers(0, len(tokens) - n + 1)) if len(tokens) > n else 0
    return tokens[start : start + n]


def swap(tokens: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    m = max(1, round(ratio * len(tokens) / 2))
    if len(tokens) < 2 * m:
        return tokens
    a = int(rng.integers(0, len(tokens) - 2 * m + 1))
    b = int(rng.integers(a + m, len(tokens) - m + 1))
    return np.concatenate([tokens[:a], tokens[b : b + m], tokens[a + m : b], tokens[a : a + m], tokens[b + m :]])


EDITS: dict[str, Callable[[np.ndarray, float, np.random.Generator], np.ndarray]] = {
    "delete": delete, "crop": crop, "swap": swap}


def edit_tokens(kind: str, tokens: np.ndarray, ratio: float, key: str, seed: int) -> np.ndarray:
    """``tokens`` after the edit ``kind``, deterministic in (key, seed)."""
    if kind not in EDITS:
        raise ValueError(f"unknown token edit {kind!r}; known edits: {', '.join(EDITS)}")
    return EDITS[kind](np.asarray(tokens), ratio, edit_rng(key, seed))
