"""The one way evaluation turns token rows into hidden states: right padding, the project's mask builder.

Rows are padded on the right with ``doc_ids`` -1 on padding, so ``pipeline.model.attention`` builds the mask (padding
is never a key, whatever the mode) and position ids stay 0..n-1 for every row, as in training.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from pipeline.model.attention import attention_inputs
from pipeline.tokenizer import Tokenizer


def pad_id(tokenizer: Tokenizer) -> int:
    """The padding id (never attended to, so any id works when the tokenizer has none)."""
    for candidate in (tokenizer.pad_id, tokenizer.eos_id):
        if candidate is not None:
            return candidate
    return 0


def wrap(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """BOS + ids + EOS, as data prep writes every document (each only when the tokenizer has one)."""
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + list(ids) + (
        [tokenizer.eos_id] if tokenizer.eos_id is not None else [])


def pad_rows(rows: Sequence[Sequence[int]], pad: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int64 [B, L], doc_ids int32 [B, L]: 0 on tokens, -1 on padding)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    doc_ids = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        doc_ids[i, : len(row)] = 0
    return ids.to(device), doc_ids.to(device)


def hidden_states(lm: PreTrainedModel, input_ids: torch.Tensor, doc_ids: torch.Tensor, mode: str,
                  span_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states [B, L, d] of the decoder body under attention ``mode``."""
    attention = attention_inputs(mode, doc_ids, span_ids, attn_implementation=lm.config._attn_implementation,
                                 dtype=lm.dtype)
    return lm.model(input_ids=input_ids, **attention).last_hidden_state


def encode_with_offsets(tokenizer: Tokenizer, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Token ids (no special tokens, as data prep encodes) and each token's character span in its text."""
    if not getattr(tokenizer.hf, "is_fast", False):
        raise ValueError(f"tokenizer {tokenizer.path}: word and span tasks map tokens to characters, which needs a "
                         f"fast (tokenizer.json) tokenizer; save one with transformers' PreTrainedTokenizerFast")
    if not texts:
        return []
    out = tokenizer.hf(list(texts), add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True,
                       return_attention_mask=False, return_token_type_ids=False)
    return [(ids, [tuple(o) for o in offsets]) for ids, offsets in zip(out["input_ids"], out["offset_mapping"])]


def token_owner(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """For each token, the index of the character span (word, answer, missing span) it overlaps, or -1."""
    owner, j = [], 0
    for start, end in offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        owner.append(j if j < len(spans) and start < spans[j][1] and end > spans[j][0] else -1)
    return owner


def tokenize_words(tokenizer: Tokenizer, sentences: Sequence[Sequence[str]]) -> list[tuple[list[int], list[list[int]]]]:
    """Each sentence's words joined by spaces and tokenized once, as ``BOS tokens EOS``, with the positions of each
    word's tokens (empty for a word no token overlaps, e.g. a zero-width character)."""
    texts, spans = [], []
    for words in sentences:
        starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
        texts.append(" ".join(words))
        spans.append([(int(s), int(s) + len(w)) for s, w in zip(starts, words)])
    shift = int(tokenizer.bos_id is not None)
    out = []
    for (ids, offsets), word_spans in zip(encode_with_offsets(tokenizer, texts), spans):
        positions: list[list[int]] = [[] for _ in word_spans]
        for t, owner in enumerate(token_owner(offsets, word_spans)):
            if owner >= 0:
                positions[owner].append(t + shift)
        out.append((wrap(tokenizer, ids), positions))
    return out
