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
  memory; on GPU it runs SDPA's memory-efficient kernel and computes every masked-out block);
- ``FLEX`` (``pipeline_flex``, registered below with transformers' ``AttentionInterface``, so any HF decoder that
  dispatches through it takes it): a FlexAttention ``BlockMask`` whose ``mask_mod`` evaluates ``allowed`` on the
  gathered facts of one (query, key) pair, so blocks that ``allowed`` rules out entirely are skipped. One per
  micro-batch, shared by all layers. Anything that is not a ``BlockMask`` (no mask, a 2D padding mask) runs HF's
  own SDPA, so a ``FLEX`` model is an SDPA model that also takes block masks. The exception is an attention
  logit softcap (Gemma 2), which SDPA cannot apply: it is FlexAttention's ``score_mod`` on every batch, and what
  SDPA would have read (``is_causal``, a bool mask) becomes a ``BlockMask`` in each layer.
- ``VARLEN`` (``pipeline_varlen``, registered the same way): causal and bidirectional batches that need a mask get
  no mask but their attention segments (:mod:`pipeline.model.varlen`: ``cu_seqlens`` from ``doc_ids``, built once
  per micro-batch and passed to every layer as HF's flash-varlen kwargs ``cu_seq_lens_q/k``, ``max_length_q/k``)
  and run ``torch.nn.attention.varlen.varlen_attn``'s flash kernels; the MAGNET modes, which segments cannot
  express, get FLEX's block mask; anything else runs HF's SDPA. So a ``VARLEN`` model is a ``FLEX`` model whose
  plain modes skip the mask build and the masked-out tiles.

When a batch has no padding and document masking changes nothing (document masking off, or one document per row),
causal and bidirectional need no mask at all: the builder then passes ``is_causal`` explicitly (so SDPA can use
its flash kernels). It never returns an empty result: HF SDPA turns causal when it gets neither a mask nor
``is_causal=False``.

torch 2.13 runs FlexAttention's forward on CPU (eager: an unfused reference that materialises the scores;
compiled: an inductor C++ kernel) but has no backward there, so training on CPU keeps SDPA (``resolve_implementation``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from pipeline.model.varlen import available as varlen_available
from pipeline.model.varlen import packed_segments, segment_ids, varlen_attention


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
FLEX = "pipeline_flex"  # the HF attention implementations registered below
VARLEN = "pipeline_varlen"
IMPLEMENTATIONS = ("eager", "sdpa", FLEX, VARLEN)
SETTINGS = ("auto", "sdpa", "eager", "flex", "varlen")  # model.attn_implementation
BLOCK_SIZE = 128  # FlexAttention's tile: the granularity at which masked-out blocks are skipped


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


@functools.cache
def compiled_create_block_mask() -> Callable:
    """``create_block_mask`` compiled once per process (as torchtitan does): the eager build evaluates the
    ``mask_mod`` on every pair with many small kernels, 12-20 ms a micro-batch on an H200 (issue 32's
    measurement); compiled it is one fused kernel. A new batch's ids are new tensor inputs, not a recompile."""
    return torch.compile(create_block_mask)


def flex_block_mask(mode: str, doc_ids: torch.Tensor, span_ids: torch.Tensor | None = None,
                    document_masking: bool = True, block_size: int = BLOCK_SIZE,
                    compiled: bool | None = None) -> BlockMask:
    """The ``BlockMask`` of ``allowed`` for a batch of ``doc_ids`` [B, L]: its ``mask_mod`` gathers the facts of
    query ``q_idx`` and key ``kv_idx`` of sample ``b`` and evaluates the same rule as ``dense_allowed``. Built
    by :func:`compiled_create_block_mask` when ``compiled`` (default: on CUDA), else eagerly."""
    if mode not in RULES:
        raise ValueError(f"unknown attention mode {mode!r}; known modes: {', '.join(RULES)}")

    def facts(b: torch.Tensor, i: torch.Tensor) -> Tokens:
        return Tokens(pos=i, doc=doc_ids[b, i], span=None if span_ids is None else span_ids[b, i])

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(mode, facts(b, q_idx), facts(b, kv_idx), document_masking)

    batch, length = doc_ids.shape
    build = compiled_create_block_mask() if (doc_ids.is_cuda if compiled is None else compiled) else create_block_mask
    return build(mask_mod, batch, None, length, length, device=doc_ids.device, BLOCK_SIZE=block_size)


def skipped_blocks(block_mask: BlockMask) -> float:
    """Fraction of the (query block, key block) tiles FlexAttention skips: none of their pairs is allowed. (torch's
    ``BlockMask.sparsity`` divides by the unpadded L x L area instead, which understates it when L % 128 != 0.)"""
    computed = block_mask.kv_num_blocks.sum() + (0 if block_mask.full_kv_num_blocks is None
                                                 else block_mask.full_kv_num_blocks.sum())
    batch, q_blocks = block_mask.kv_num_blocks.shape[0], block_mask.kv_num_blocks.shape[-1]
    return 1.0 - float(computed) / (batch * q_blocks * block_mask.kv_indices.shape[-1])


def _needs_mask(mode: str, doc_ids: torch.Tensor, document_masking: bool,
                host_doc_ids: np.ndarray | None = None) -> bool:
    """Whether the batch needs a mask (padding, or, with document masking, a row of several documents), decided on
    ``host_doc_ids`` (the host's copy, ``Batch.host``) when given: reading the device's ids waits for its queue."""
    if mode not in _PLAIN_IS_CAUSAL:
        return True
    ids = host_doc_ids if host_doc_ids is not None else doc_ids.cpu().numpy()  # no host copy: one read
    return bool((ids < 0).any() or (document_masking and (ids != ids[:, :1]).any()))


def no_mask(device: torch.device) -> torch.Tensor:
    """An empty 4D mask: FLEX and VARLEN's "attend as ``is_causal`` says". transformers' mask preprocessing returns
    a 4D mask as it is, so a forward given one skips ``find_packed_sequence_indices``, which reads the device back
    (``bool`` of its position-id check) on every forward that has no mask; the attention functions below read it
    as no mask."""
    return torch.empty((0, 0, 0, 0), dtype=torch.bool, device=device)


def is_no_mask(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.numel() == 0


def attention_inputs(mode: str, doc_ids: torch.Tensor, span_ids: torch.Tensor | None = None, *,
                     document_masking: bool = True, attn_implementation: str = "sdpa",
                     dtype: torch.dtype = torch.float32, host_doc_ids: np.ndarray | None = None) -> dict[str, Any]:
    """Keyword arguments for ``model(...)`` / ``model.model(...)`` that realise ``mode`` on this batch.

    ``attn_implementation`` is the model's (``model.config._attn_implementation``); ``dtype`` is the model's
    dtype, used for the eager float mask; ``host_doc_ids``: the same ids on the host (the loader's copy), from
    which the plain-or-masked decision and the varlen segments are made without reading the device.
    """
    if mode not in RULES:
        raise ValueError(f"unknown attention mode {mode!r}; known modes: {', '.join(RULES)}")
    if attn_implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {attn_implementation!r} cannot express custom masks; "
                         f"use one of {', '.join(IMPLEMENTATIONS)}")
    ours = attn_implementation in (FLEX, VARLEN)
    plain = {"is_causal": _PLAIN_IS_CAUSAL.get(mode)} | ({"attention_mask": no_mask(doc_ids.device)} if ours else {})
    if attn_implementation == VARLEN and mode in _PLAIN_IS_CAUSAL:
        segments = packed_segments(doc_ids, document_masking, host_doc_ids)  # stands for _needs_mask's decision
        if segments is None:
            return plain
        return plain | {"cu_seq_lens_q": segments.cu_seqlens, "cu_seq_lens_k": segments.cu_seqlens,
                        "max_length_q": segments.max_seqlen, "max_length_k": segments.max_seqlen}
    if not _needs_mask(mode, doc_ids, document_masking, host_doc_ids):
        return plain
    if ours:
        return {"attention_mask": flex_block_mask(mode, doc_ids, span_ids, document_masking)}
    ok = dense_allowed(mode, doc_ids, span_ids, document_masking)
    if attn_implementation == "sdpa":
        return {"attention_mask": ok}
    return {"attention_mask": torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(
        ~ok, torch.finfo(dtype).min)}


HALF = (torch.bfloat16, torch.float16)  # the flash varlen kernel's dtypes


def resolve_implementation(setting: str, cuda: bool, dtype: torch.dtype = torch.bfloat16) -> str:
    """The HF attention implementation for ``model.attn_implementation`` on a model of ``dtype``: ``auto`` is VARLEN
    on CUDA in half precision (flash varlen for causal / bidirectional batches that need a mask, FlexAttention
    block masks for MAGNET, SDPA's flash path for batches that need no mask), FLEX on CUDA in fp32 (the flash
    varlen kernel takes bf16 / fp16 only) or where this torch has no varlen, and SDPA on CPU."""
    if setting not in SETTINGS:
        raise ValueError(f"model.attn_implementation: {setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "varlen" and not varlen_available():
        raise ValueError(f"model.attn_implementation: varlen needs torch.nn.attention.varlen (torch >= 2.10), which "
                         f"torch {torch.__version__} lacks; use auto, flex or sdpa")
    if setting == "varlen" and cuda and dtype not in HALF:
        raise ValueError(f"model.attn_implementation: varlen runs flash attention, which takes bf16 or fp16, but the "
                         f"model is {str(dtype).removeprefix('torch.')}; set model.dtype: bf16, or use auto or flex")
    if setting == "auto":
        return (VARLEN if varlen_available() and dtype in HALF else FLEX) if cuda else "sdpa"
    return {"flex": FLEX, "varlen": VARLEN}.get(setting, setting)


@functools.cache
def compiled_flex() -> Callable:
    """FlexAttention compiled once per process. Dynamo's default (``dynamic=None``) specialises the first call's
    shapes and makes the sizes that change symbolic on the first recompile, so variable batch widths (SSCL's
    padded views) cost a bounded few compiles; ``dynamic=False`` compiled each new width until dynamo's
    recompile limit, then fell back to eager FlexAttention, which materialises the whole score matrix."""
    return torch.compile(flex_attention)


def _flex(query: torch.Tensor):
    """Compiled FlexAttention on CUDA (the fused kernel), eager elsewhere and inside an already compiling region
    (``model.compile``), where the surrounding graph compiles it."""
    if not query.is_cuda or torch.compiler.is_compiling():
        return flex_attention
    return compiled_flex()


# FlexAttention's forward tiles on Hopper (H100/H200) in bf16/fp16 by head_dim, as (BLOCK_M, BLOCK_N, num_stages,
# num_warps): torch's own sm90 defaults for 64 and 128 (inductor's ``h100_default_flex_config``); head_dim 96 has no
# entry there, so torch falls back to 64 x 64 tiles with 4 warps, and gets the config of 128, the size its kernel
# pads 96 to. The backward's sm90 default already covers head_dim <= 128. Not yet measured against torch's choice.
_SM90_FORWARD_TILES = {64: (128, 128, 3, 4), 96: (128, 64, 3, 8), 128: (128, 64, 3, 8)}


@torch.compiler.assume_constant_result  # read once while a compiled layer traces, not a graph break
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def forward_tiles(head_dim: int, query_length: int, dtype: torch.dtype) -> dict[str, int] | None:
    """The forward ``kernel_options`` of :data:`_SM90_FORWARD_TILES` for a half-precision query of ``head_dim`` and
    ``query_length`` rows on an sm90 GPU, or None (torch's choice). Queries shorter than a tile's ``BLOCK_M`` (128)
    get None: torch runs them with its flex-decoding kernel, which sizes its boundary checks from its own block
    size, not the override (short unit rows, MAGNET evaluation, Gemma 2's softcap on short inputs)."""
    tiles = _SM90_FORWARD_TILES.get(head_dim)
    if tiles is None or dtype not in HALF or query_length < tiles[0]:
        return None
    return dict(zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), tiles, strict=True))


def flex_kernel_options(query: torch.Tensor) -> dict[str, int] | None:
    """FlexAttention ``kernel_options`` for ``query`` [B, H, L, head_dim]: :func:`forward_tiles` on an sm90 GPU
    (``fwd_``: the backward keeps its own), None (torch's choice) elsewhere."""
    if not query.is_cuda or not _is_sm90(query.device):
        return None
    return forward_tiles(query.shape[-1], query.shape[-2], query.dtype)


def _softcapped(softcap: float):
    """Gemma 2's attention logit softcap as a FlexAttention ``score_mod`` (eager's ``softcap * tanh(s / softcap)``)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _block_mask_of(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   attention_mask: torch.Tensor | None, is_causal: bool | None) -> BlockMask | None:
    """What SDPA would have read from ``attention_mask`` / ``is_causal`` as a ``BlockMask`` (None: attend to
    everything), for softcapped models, whose scores SDPA cannot modify. Same causal default as HF's SDPA."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if not causal:
            return None
        return create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, q_len, kv_len,
                                 device=query.device)
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"{FLEX}: a softcapped model takes a BlockMask or a bool mask, not a {attention_mask.dtype} "
                        "mask; build it with pipeline.model.attention.attention_inputs")
    dense = attention_mask.expand(query.shape[0], 1, q_len, kv_len)  # one mask for all heads (sdpa_mask's form)
    return create_block_mask(lambda b, h, q_idx, kv_idx: dense[b, 0, q_idx, kv_idx], query.shape[0], None, q_len,
                             kv_len, device=query.device)


def flex_or_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, dropout: float = 0.0, scaling: float | None = None,
                         softcap: float | None = None, is_causal: bool | None = None, **kwargs):
    """HF attention function: FlexAttention for a ``BlockMask``, HF's SDPA for anything else, except that a
    softcapped model (Gemma 2) always runs FlexAttention with the softcap as its ``score_mod``: SDPA has none.
    :func:`no_mask` is no mask."""
    if is_no_mask(attention_mask):
        attention_mask = None
    if not isinstance(attention_mask, BlockMask):
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
        attention_mask = _block_mask_of(module, query, key, attention_mask, is_causal)
    if dropout > 0:
        raise ValueError("FlexAttention has no attention dropout; set model.attn_implementation: sdpa for "
                         "model.attention_dropout > 0")
    out = _flex(query)(query, key, value, score_mod=None if softcap is None else _softcapped(softcap),
                       block_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                       kernel_options=flex_kernel_options(query))
    return out.transpose(1, 2).contiguous(), None


def varlen_or_flex_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, dropout: float = 0.0, scaling: float | None = None,
                           softcap: float | None = None, is_causal: bool | None = None,
                           cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, **kwargs):
    """HF attention function: flash varlen over the segments ``attention_inputs`` passed (``cu_seq_lens_q``),
    :func:`flex_or_sdpa_forward` for anything else. A softcapped model (Gemma 2; varlen has no softcap) runs its
    segments as a FlexAttention block mask built in each layer, like FLEX's softcap path."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_k", "max_length_k")}  # self-attention: q's
    if cu_seq_lens_q is None:
        return flex_or_sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    softcap=softcap, is_causal=is_causal, **kwargs)
    if dropout > 0:
        raise ValueError("varlen attention has no attention dropout; set model.attn_implementation: sdpa for "
                         "model.attention_dropout > 0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if softcap is None:
        return varlen_attention(query, key, value, cu_seq_lens_q, max_length_q, causal=causal, scale=scaling), None
    batch, _, length, _ = query.shape
    segment = segment_ids(cu_seq_lens_q, batch, length)

    def mask_mod(b, h, q_idx, kv_idx):
        same = segment[b, q_idx] == segment[b, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    block_mask = create_block_mask(mask_mod, batch, None, length, length, device=query.device)
    return flex_or_sdpa_forward(module, query, key, value, block_mask, scaling=scaling, softcap=softcap)


AttentionInterface.register(FLEX, flex_or_sdpa_forward)
AttentionInterface.register(VARLEN, varlen_or_flex_forward)
for _name in (FLEX, VARLEN):  # 2D padding masks and no mask: exactly as for sdpa
    ALL_MASK_ATTENTION_FUNCTIONS.register(_name, sdpa_mask)
