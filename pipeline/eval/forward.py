"""The one way evaluation turns token rows into hidden states: right padding, the project's mask builder.

Rows are padded on the right with ``doc_ids`` -1 on padding, so ``pipeline.model.attention`` builds the mask (padding
is never a key, whatever the mode) and position ids stay 0..n-1 for every row, as in training.

:func:`row_states` is the cheaper way for whole rows under plain ``causal`` or ``bidirectional`` attention, where
right padding needs no [B, 1, L, L] mask: causal attention never reaches the padding after a row's tokens (so no
mask at all, SDPA's ``is_causal``: its flash kernels on GPU), and bidirectional attention needs only a key-padding
mask [B, 1, 1, L]; an unpadded batch gets no mask. A token's state is the same as under ``attention_inputs``' mask,
and whether a batch is padded is read from the host-side rows (no device sync). :func:`length_batches` sorts rows
by length into batches within a token budget, so little padding is computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from pipeline.model.attention import FLEX, VARLEN, attention_inputs
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


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; to CUDA through pinned memory without blocking, so the host does not wait for the
    batches already queued on the GPU (a pageable copy synchronises the stream)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pad_rows(rows: Sequence[Sequence[int]], pad: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int64 [B, L], doc_ids int32 [B, L]: 0 on tokens, -1 on padding)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    doc_ids = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        doc_ids[i, : len(row)] = 0
    return to_device(ids, device), to_device(doc_ids, device)


def length_batches(lengths: Sequence[int], max_tokens: int | None = None, max_rows: int | None = None
                   ) -> list[list[int]]:
    """Indices of ``lengths`` sorted longest first (ties in index order) into consecutive batches whose padded size
    (rows x longest row) stays within ``max_tokens`` and whose rows within ``max_rows`` (None: no bound; a row
    longer than ``max_tokens`` is a batch of its own). Longest first: a budget too large fails on the first batch.
    A function of ``lengths`` alone, so every rank of a launch builds the same list."""
    if max_tokens is not None and max_tokens < 1 or max_rows is not None and max_rows < 1:
        raise ValueError(f"max_tokens {max_tokens} / max_rows {max_rows}: a batch needs room for at least one row; "
                         f"pass a positive budget")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        batch = batches[-1] if batches else None
        if (batch is None or (max_rows is not None and len(batch) >= max_rows)
                or (max_tokens is not None and (len(batch) + 1) * lengths[batch[0]] > max_tokens)):
            batches.append([i])
        else:
            batch.append(i)
    return batches


def hidden_states(lm: PreTrainedModel, input_ids: torch.Tensor, doc_ids: torch.Tensor, mode: str,
                  span_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states [B, L, d] of the decoder body under attention ``mode``."""
    attention = attention_inputs(mode, doc_ids, span_ids, attn_implementation=lm.config._attn_implementation,
                                 dtype=lm.dtype)
    return lm.model(input_ids=input_ids, **attention).last_hidden_state


def row_states(lm: PreTrainedModel, rows: Sequence[Sequence[int]], pad: int, mode: str) -> torch.Tensor:
    """Last hidden states [B, L, d] of whole token ``rows``, right-padded, under attention ``mode``; plain
    ``causal`` and ``bidirectional`` take the cheaper forms of the module docstring, other modes
    :func:`hidden_states`."""
    device = next(lm.parameters()).device
    ids, doc_ids = pad_rows(rows, pad, device)
    if mode not in ("causal", "bidirectional"):
        return hidden_states(lm, ids, doc_ids, mode)
    if mode == "causal" or len({len(r) for r in rows}) == 1:
        return lm.model(input_ids=ids, is_causal=mode == "causal").last_hidden_state
    keys = (doc_ids >= 0)[:, None, None, :]  # [B, 1, 1, L]: every query reads the row's tokens
    if lm.config._attn_implementation not in ("sdpa", FLEX, VARLEN):  # eager adds a float mask
        keys = torch.zeros(keys.shape, dtype=lm.dtype, device=device).masked_fill(~keys, torch.finfo(lm.dtype).min)
    return lm.model(input_ids=ids, attention_mask=keys).last_hidden_state


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
