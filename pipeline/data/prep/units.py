"""A sentence or paragraph unit as one sample (the samples of contrastive objectives, SimCSE and MAGNET's SSCL);
how a document is cut into units is ``pipeline/data/format/units.py``.

A unit becomes one sample of ``max_unit_tokens`` tokens: BOS, the unit's tokens, EOS (as configured), then
padding, in one segment. A unit longer than that keeps its first tokens (BOS and EOS stay), as LLM2Vec's
``max_seq_length`` truncation does; the job counts such units.
"""

from __future__ import annotations

import numpy as np


def unit_sample(ids: list[int], seq_len: int, pad_id: int, bos_id: int | None, eos_id: int | None
                ) -> tuple[np.ndarray, int, bool]:
    """(int32 [seq_len] ids: BOS, the unit's first tokens, EOS, padding; the unit's length; whether it was cut)."""
    room = seq_len - (bos_id is not None) - (eos_id is not None)
    if room < 1:
        raise ValueError(f"units of {seq_len} tokens leave no room for text between BOS and EOS; raise "
                         f"--max-unit-tokens")
    unit = ([bos_id] if bos_id is not None else []) + ids[:room] + ([eos_id] if eos_id is not None else [])
    out = np.full(seq_len, pad_id, dtype=np.int32)
    out[: len(unit)] = unit
    return out, len(unit), len(ids) > room
