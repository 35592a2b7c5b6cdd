"""The instructed text layout that data prep, supervised training, evaluation and the export share:
an instruction joined to a text by ``--instruction-format`` (``"{instruction}: "``), tokenized as one
string, pooled over the text alone (:func:`instructed_rows`), so training pools exactly what inference
pools; and the special tokens around it (``LAYOUTS``, :func:`special_tokens`), which ``encode()`` reads with and
the export's record and model card write down. The pairs samples themselves are built by ``prep/pairs.py``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.tokenizer import Tokenizer

DEFAULT_FORMAT = "{instruction}: "  # LLM2Vec's evaluation join ("...: text"); training and use share it here
# the special tokens around a text: data prep's BOS text EOS; the tokenizer's own special tokens (what
# ``tokenizer(text)`` adds: LLM2Vec's and sentence-transformers' layout); the text tokens alone
LAYOUTS = ("bos_eos", "special", "text")
PROBE = "probe text"  # what ``special`` tokenizes to find the tokenizer's own special tokens


def check_format(fmt: str) -> None:
    try:
        ok = fmt.format(instruction="X") != fmt and "{instruction}" in fmt
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"instruction format {fmt!r} must hold '{{instruction}}' once and no other field, "
                         f"e.g. '{DEFAULT_FORMAT}'")


def format_instruction(fmt: str | None, instruction: str | None) -> str:
    """The prefix joined to a text: ``fmt`` filled with ``instruction`` ("" for none; ``fmt`` None: verbatim)."""
    if not instruction:
        return ""
    return instruction if fmt is None else fmt.format(instruction=instruction)


def load_instructions(path: str) -> dict:
    """The ``--instructions`` table, checked: every entry's query and document are a string (document: or null)
    or a non-empty list of them."""
    with open(path) as f:
        table = json.load(f)

    def ok(value, nullable: bool) -> bool:
        items = value if isinstance(value, list) and value else [value]
        return all(isinstance(v, str) and v.strip() or (nullable and v is None) for v in items)

    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object {{task: {{query, document}}}}")
    for task, entry in table.items():
        if (not isinstance(entry, dict) or set(entry) - {"query", "document"} or not ok(entry.get("query"), False)
                or not ok(entry.get("document"), True)):
            raise ValueError(f"{path}: task {task!r}: expected {{\"query\": str | [str, ...], \"document\": "
                             f"str | null | [str | null, ...]}}, got {entry!r}")
    return table


def text_hash(text: str) -> int:
    """A text's 64-bit blake2b (signed, for an int64 array): equal texts hash equal under any instruction."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def tokenize_instructed(tok, texts: Sequence[str], prefixes: Sequence[str], max_length: int, head: list[int],
              tail: list[int]) -> tuple[list[tuple[list[int], int, int, bool] | None], int]:
    """(per text: (ids, first text position, end of text, whether it was cut), or None where the prefix leaves no
    room for the text; the longest prefix's token count). The text starts after as many tokens as the prefix has
    alone, sentence-transformers' rule (``include_prompt: false``), so its export pools what this pools. A prefix
    ending in a space the tokenizer merges into the text's first word ("X: " is ``▁X : ▁`` alone but
    ``▁X : ▁Norfolk`` joined) thus leaves that word out of pooling, in training and in use alike."""
    distinct = sorted({p for p in prefixes if p})
    skips = dict(zip(distinct, (len(ids) for ids in tok.encode_batch(distinct)))) | {"": 0}
    room = max_length - len(head) - len(tail)
    out = []
    for ids, prefix in zip(tok.encode_batch([p + t for p, t in zip(prefixes, texts)]), prefixes):
        skip = skips[prefix]
        cut = ids[:room]
        out.append(None if room <= skip else
                   (head + cut + tail, len(head) + min(skip, len(cut)), len(head) + len(cut), len(ids) > room))
    return out, max((skips[p] for p in prefixes), default=0)


def instructed_rows(tok, texts: Sequence[str], prefixes: Sequence[str], max_length: int, head: list[int],
                    tail: list[int]) -> list[tuple[list[int], int, int]]:
    """(ids, first text position, end of text) per ``prefixes[i] + texts[i]``, tokenized as one string and cut to
    ``max_length`` tokens with ``head`` and ``tail`` around it; the prefix's own token count marks the text's
    start. Raises ValueError when a prefix leaves no room for the text."""
    rows, longest = tokenize_instructed(tok, texts, prefixes, max_length, head, tail)
    if any(r is None for r in rows):
        raise ValueError(f"the instruction takes {len(head) + longest} of the {max_length} tokens allowed; shorten "
                         f"it or raise max_length")
    return [r[:3] for r in rows]


def special_tokens(tokenizer: Tokenizer, layout: str) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the instruction and text under ``layout``; ``special`` asks the tokenizer what its
    own call adds around a text (e.g. Llama: BOS; Qwen2: nothing)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "text":
        return [], []
    if layout == "bos_eos":
        return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []), (
            [tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    bare = tokenizer.hf(PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer.hf(PROBE)["input_ids"]
    start = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    if start is None:
        raise ValueError(f"tokenizer {tokenizer.path}: its own special tokens change the text's tokens, so layout "
                         f"'special' cannot find the text in them; use layout 'bos_eos' or 'text'")
    return full[:start], full[start + len(bare):]
