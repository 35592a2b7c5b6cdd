"""Sentence and paragraph units: how a text is cut into them, the one rule that prep (the samples of contrastive
objectives, one unit each) and evaluation (the sentences of repetition, infilling and their metrics) share.

Splitting is deliberately simple, so anyone can predict it and it costs nothing next to tokenizing:

- ``paragraph``: the blocks of a document separated by blank (empty or whitespace-only) lines, stripped;
- ``sentence``: each paragraph cut after ``.``, ``!`` or ``?`` (optionally followed by one closing quote or
  bracket) where whitespace follows, with every whitespace run inside the sentence made one space (a verse's line
  breaks are not sentence boundaries). Abbreviations such as "Mr." end a sentence too;
- ``record``: the whole record, stripped (inputs that already hold one sentence a record, such as wiki1m, or
  records that carry a paraphrase of their text).
"""

from __future__ import annotations

import re

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
