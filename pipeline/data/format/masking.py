"""The precomputed masking plan, and how training turns it into masked inputs at any ratio.

Per sample, data prep stores a random rank for every maskable token (a uniformly random permutation of the
maskable positions) and a 32-bit replacement draw per token. Masking at ratio p selects the k = round(p * n)
lowest ranks, so the masks of lower ratios are subsets of higher ones and any ratio can be chosen at train time
without an RNG in the loop (exact resume, identical masks across ablations).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.data.format.sample import UNMASKABLE

POLICIES = ("80-10-10", "mask")


_GENERATOR = np.random.Generator(np.random.Philox(0))  # re-keyed for every sample by sample_rng


def sample_rng(seed: int, file_index: int, sample_index: int) -> np.random.Generator:
    """The sample's RNG: Philox keyed by (seed, file_index), its counter starting at sample_index * 2**64, so it
    depends only on the sample's identity, not on job layout or processing order, and samples never share draws.
    The masking plan draws first and the MAGNET spans after, so span settings never change a plan.

    Philox is counter-based: re-keying this process's one generator costs ~2 us, where seeding a new one costs
    10-25 (SeedSequence hashing, OS entropy), a tenth of data prep's per-sample work. The generator returned is
    therefore shared: it is valid until the next call."""
    _GENERATOR.bit_generator.state = {
        "bit_generator": "Philox",
        "state": {"counter": np.array([0, sample_index, 0, 0], dtype=np.uint64),
                  "key": np.array([seed, file_index], dtype=np.uint64)},
        "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
    }
    return _GENERATOR


def regular_token_table(special_ids: np.ndarray) -> np.ndarray:
    """Bool lookup table, False at the special ids, for ``maskable_positions``: ids above the largest special id
    clip onto its last entry, which is True. A lookup costs less than np.isin's set-up at this size."""
    special_ids = np.asarray(special_ids, dtype=np.int64)
    regular = np.ones(int(np.max(special_ids, initial=-1)) + 2, dtype=bool)
    regular[special_ids] = False
    return regular


def maskable_positions(input_ids: np.ndarray, segments: np.ndarray, regular: np.ndarray) -> np.ndarray:
    """Tokens inside a document that are not special tokens (BOS/EOS/PAD/mask are never masked); ``regular`` is
    ``regular_token_table(special_ids)``."""
    inside = np.zeros(len(input_ids), dtype=bool)
    for s, e in segments.tolist():
        inside[s:e] = True
    return inside & regular.take(input_ids, mode="clip")


def plan_masks(maskable: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(mask_rank uint16, mask_draw uint32) for one sample. The draws are the bit generator's raw output, which
    numpy keeps the same across versions, read as little-endian 32-bit words."""
    rank = np.full(len(maskable), UNMASKABLE, dtype=np.uint16)
    rank[maskable] = rng.permutation(int(np.count_nonzero(maskable))).astype(np.uint16)
    raw = rng.bit_generator.random_raw((len(maskable) + 1) // 2).astype("<u8", copy=False)
    return rank, raw.view("<u4")[: len(maskable)].astype(np.uint32, copy=False)


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
