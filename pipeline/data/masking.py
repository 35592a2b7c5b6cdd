"""The precomputed masking plan, and how training turns it into masked inputs at any ratio.

Per sample, data prep stores a random rank for every maskable token (a uniformly random permutation of the
maskable positions) and a 32-bit replacement draw per token. Masking at ratio p selects the k = round(p * n)
lowest ranks, so the masks of lower ratios are subsets of higher ones and any ratio can be chosen at train time
without an RNG in the loop (exact resume, identical masks across ablations).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.data.format import UNMASKABLE

POLICIES = ("80-10-10", "mask")
_STREAMS = {"mask": 0, "spans": 1}


def sample_rng(seed: int, file_index: int, sample_index: int, stream: str) -> np.random.Generator:
    """An RNG that depends only on the sample's identity, not on job layout or processing order."""
    entropy = [seed, file_index, sample_index, _STREAMS[stream]]
    if 0 <= min(entropy) and max(entropy) < 1 << 32:  # same words as the list, but 2x faster for SeedSequence
        entropy = np.array(entropy, dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def maskable_positions(input_ids: np.ndarray, segments: np.ndarray, special_ids: np.ndarray) -> np.ndarray:
    """Tokens inside a document that are not special tokens (BOS/EOS/PAD/mask are never masked)."""
    inside = np.zeros(len(input_ids), dtype=bool)
    for s, e in segments.tolist():
        inside[s:e] = True
    if len(special_ids) == 0:
        return inside
    special = np.sort(special_ids)  # membership by binary search: np.isin's set-up costs more at this size
    nearest = special[np.minimum(np.searchsorted(special, input_ids), len(special) - 1)]
    return inside & (nearest != input_ids)


def plan_masks(maskable: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(mask_rank uint16, mask_draw uint32) for one sample."""
    rank = np.full(len(maskable), UNMASKABLE, dtype=np.uint16)
    rank[maskable] = rng.permutation(int(maskable.sum())).astype(np.uint16)
    draw = rng.integers(0, 1 << 32, size=len(maskable), dtype=np.uint32)
    return rank, draw


def mask_targets(mask_rank: torch.Tensor, ratio: float) -> torch.Tensor:
    """Bool [..., L]: the positions masked at ``ratio`` (k = round(ratio * maskable) per row)."""
    n = (mask_rank != UNMASKABLE).sum(-1, keepdim=True)
    k = torch.floor(ratio * n.double() + 0.5).to(mask_rank.dtype)
    return mask_rank.long() < k.long()


def apply_mask_plan(input_ids: torch.Tensor, mask_rank: torch.Tensor, mask_draw: torch.Tensor, ratio: float,
                    policy: str, mask_id: int, random_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input ids, target bool) for a batch [..., L].

    Policy "mask" replaces every target by ``mask_id``; "80-10-10" (BERT) uses ``draw % 10``: 0-7 mask token,
    8 a random regular token ``random_pool[(draw // 10) % len(random_pool)]``, 9 keeps the original.
    """
    if policy not in POLICIES:
        raise ValueError(f"mask policy must be one of {POLICIES}, got {policy!r}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"mask ratio must be in (0, 1], got {ratio}")
    targets = mask_targets(mask_rank, ratio)
    if policy == "mask":
        replacement = torch.full_like(input_ids, mask_id)
    else:
        draw = mask_draw.long()
        category = draw % 10
        random_ids = random_pool.to(input_ids.device)[(draw // 10) % len(random_pool)].to(input_ids.dtype)
        replacement = torch.where(category < 8, torch.full_like(input_ids, mask_id),
                                  torch.where(category == 8, random_ids, input_ids))
    return torch.where(targets, replacement, input_ids), targets
