"""Sentence and paragraph units: the samples of contrastive objectives (SimCSE, MAGNET's SSCL), one unit each.

Splitting is deliberately simple, so anyone can predict it and it costs nothing next to tokenizing:

- ``paragraph``: the blocks of a document separated by blank (empty or whitespace-only) lines, stripped;
- ``sentence``: each paragraph cut after ``.``, ``!`` or ``?`` (optionally followed by one closing quote or
  bracket) where whitespace follows, with every whitespace run inside the sentence made one space (a verse's line
  breaks are not sentence boundaries). Abbreviations such as "Mr." end a sentence too;
- ``record``: the whole record, stripped (inputs that already hold one sentence a record, such as wiki1m, or
  records that carry a paraphrase of their text).

A unit becomes one sample of ``max_unit_tokens`` tokens: BOS, the unit's tokens, EOS (as configured), then
padding, in one segment. A unit longer than that keeps its first tokens (BOS and EOS stay), as LLM2Vec's
``max_seq_length`` truncation does; the job counts such units.
"""

from __future__ import annotations

import re

import numpy as np

UNIT_MODES = ("sentence", "paragraph", "record")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019)\]]))\s+")
_WHITESPACE = re.compile(r"\s+")


def split_units(text: str, mode: str) -> list[str]:
    """The non-empty units of one document, in order."""
    if mode not in UNIT_MODES:
        raise ValueError(f"unit mode must be one of {', '.join(UNIT_MODES)}, got {mode!r}")
    if mode == "record":
        return [text.strip()] if text.strip() else []
    paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(text)]
    if mode == "paragraph":
        return [p for p in paragraphs if p]
    return [_WHITESPACE.sub(" ", s) for p in paragraphs for s in _SENTENCE_END.split(p) if s]


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
