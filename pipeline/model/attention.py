"""The one attention-mask builder: every mode is an ``allowed(q, k)`` rule over per-token facts.

A mode is a rule that says whether query token ``q`` may attend to key token ``k`` given their positions,
document ids and MAGNET span ids. The builder adds what every mode shares: padding (``doc_id == -1``) is never a
key, document masking keeps packed documents apart, and the diagonal is always allowed, so every query row keeps
at least one key (padding rows attend only to themselves; no NaN). MAGNET's context/span modes are two more
entries in ``RULES``.

The result is what the HF model's forward needs, in the form each attention implementation reads correctly:

- ``eager``: a 4D float additive mask [B, 1, L, L] in the model dtype (eager adds a bool mask as 0/1: silently
  wrong);
- ``sdpa``: a 4D bool mask [B, 1, L, L], one per sample and shared by all heads (a quarter of a float mask's
  memory; on GPU it runs SDPA's memory-efficient kernel).

Flex attention is not offered: HF's flex path segfaults on CPU with torch 2.13, so it cannot be tested here; a
``BlockMask`` from ``allowed`` would be its one extra branch.

When a batch has no padding and document masking changes nothing (document masking off, or one document per row),
causal and bidirectional need no mask at all: the builder then passes ``is_causal`` explicitly (so SDPA can use
its flash kernels). It never returns an empty result: HF SDPA turns causal when it gets neither a mask nor
``is_causal=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Tokens:
    """Per-token facts a rule may read; query and key views are broadcast along different axes."""

    pos: torch.Tensor
    doc: torch.Tensor  # document index within the sample, -1 = padding
    span: torch.Tensor | None  # MAGNET span index, -1 = context; None when the caller has no spans


Rule = Callable[[Tokens, Tokens], torch.Tensor]


def _causal(q: Tokens, k: Tokens) -> torch.Tensor:
    return k.pos <= q.pos


def _bidirectional(q: Tokens, k: Tokens) -> torch.Tensor:
    return torch.ones_like(k.pos <= q.pos)


def _in_span(t: Tokens) -> torch.Tensor:
    """Bool: is the token inside a MAGNET span? Without span ids every token is context."""
    return t.span >= 0 if t.span is not None else torch.zeros_like(t.pos, dtype=torch.bool)


def _magnet(q: Tokens, k: Tokens) -> torch.Tensor:
    """MAGNET: context (span -1) sees all context and never a span token, so no span leaks into the encoder
    states; a span token sees all context and the span tokens at or before it (causal across spans)."""
    q_in_span, k_in_span = _in_span(q), _in_span(k)
    return ~k_in_span | (q_in_span & (k.pos <= q.pos))


def _magnet_own_span(q: Tokens, k: Tokens) -> torch.Tensor:
    """MAGNET with span tokens seeing only earlier tokens of their own span (plus all context)."""
    q_in_span, k_in_span = _in_span(q), _in_span(k)
    return ~k_in_span | (q_in_span & (k.pos <= q.pos) & (k.span == q.span))


RULES: dict[str, Rule] = {"causal": _causal, "bidirectional": _bidirectional, "magnet": _magnet,
                          "magnet_own_span": _magnet_own_span}
# Modes that, without padding or document boundaries, are exactly HF's own causal / bidirectional attention.
_PLAIN_IS_CAUSAL = {"causal": True, "bidirectional": False}
IMPLEMENTATIONS = ("eager", "sdpa")


def allowed(mode: str, q: Tokens, k: Tokens, document_masking: bool) -> torch.Tensor:
    """Bool: may ``q`` attend to ``k``? The mode's rule plus padding, document masking and the diagonal."""
    if mode not in RULES:
        raise ValueError(f"unknown attention mode {mode!r}; known modes: {', '.join(RULES)}")
    ok = RULES[mode](q, k) & (q.doc >= 0) & (k.doc >= 0)
    if document_masking:
        ok = ok & (q.doc == k.doc)
    return ok | (q.pos == k.pos)


def dense_allowed(mode: str, doc_ids: torch.Tensor, span_ids: torch.Tensor | None = None,
                  document_masking: bool = True) -> torch.Tensor:
    """Bool [B, 1, L, L] (True = attend) for a batch of ``doc_ids`` [B, L]."""
    pos = torch.arange(doc_ids.shape[-1], device=doc_ids.device)

    def view(axis: int) -> Tokens:
        # queries vary along dim 2, keys along dim 3; the head dim (1) stays 1 so all heads share the mask
        expand = (lambda t: t[:, None, :, None]) if axis == 2 else (lambda t: t[:, None, None, :])
        return Tokens(pos=expand(pos[None]), doc=expand(doc_ids),
                      span=None if span_ids is None else expand(span_ids))

    return allowed(mode, view(2), view(3), document_masking)


def _needs_mask(mode: str, doc_ids: torch.Tensor, document_masking: bool) -> bool:
    if mode not in _PLAIN_IS_CAUSAL:
        return True
    if (doc_ids < 0).any():
        return True
    return document_masking and bool((doc_ids != doc_ids[:, :1]).any())


def attention_inputs(mode: str, doc_ids: torch.Tensor, span_ids: torch.Tensor | None = None, *,
                     document_masking: bool = True, attn_implementation: str = "sdpa",
                     dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword arguments for ``model(...)`` / ``model.model(...)`` that realise ``mode`` on this batch.

    ``attn_implementation`` is the model's (``model.config._attn_implementation``); ``dtype`` is the model's
    dtype, used for the eager float mask.
    """
    if mode not in RULES:
        raise ValueError(f"unknown attention mode {mode!r}; known modes: {', '.join(RULES)}")
    if attn_implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {attn_implementation!r} cannot express custom masks; "
                         f"use one of {', '.join(IMPLEMENTATIONS)}")
    if not _needs_mask(mode, doc_ids, document_masking):
        return {"is_causal": _PLAIN_IS_CAUSAL[mode]}
    ok = dense_allowed(mode, doc_ids, span_ids, document_masking)
    if attn_implementation == "sdpa":
        return {"attention_mask": ok}
    return {"attention_mask": torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(
        ~ok, torch.finfo(dtype).min)}
