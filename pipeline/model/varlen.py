"""Variable-length attention for packed documents: no mask, only where each attention segment starts.

An attention segment is a document (or, without document masking, a row's tokens); a row's trailing padding is
a segment of its own, so it attends only to padding and no real token sees it. ``torch.nn.attention.varlen``'s
``varlen_attn`` runs flash attention over the flattened rows [B * L, heads, head_dim] with ``cu_seqlens`` (each
segment's first token, then B * L): it computes only the tiles inside a segment, reads GQA's shared K/V heads in
place (no repeat), and is causal with ``window_size=(-1, 0)``, bidirectional with ``(-1, -1)``.

Real tokens get exactly the dense mask's attention (``pipeline.model.attention.dense_allowed``); a padding token
attends to the padding before it (causal) or all of it, where the dense mask lets it see only itself; nothing reads
padding states. A document must be one contiguous run of its row and padding must trail it, as ``collate`` lays
rows out.

``varlen_attn`` came with torch 2.10 (``is_causal=``; ``window_size`` from 2.11, both detected) and has kernels on
CUDA only (on CPU torch 2.13 raises ``NotImplementedError``): the CPU tests check everything around the kernel,
with reference CPU kernels (per-segment attention and its backward) registered behind torch's own custom ops.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

_PARAMETERS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


def available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn``."""
    return varlen_attn is not None


@dataclass(frozen=True)
class Segments:
    """The attention segments of a micro-batch, as ``varlen_attn`` reads them."""

    cu_seqlens: torch.Tensor  # int32 [N + 1] on the batch's device: each segment's first token in [B * L], then B * L
    max_seqlen: int  # the kernel's bound on a segment's length: the row length L (see ``packed_segments``)


def segment_starts(host_ids: np.ndarray, document_masking: bool) -> np.ndarray | None:
    """int32 ``cu_seqlens`` of host rows ``host_ids`` [B, L] (document index, -1 = padding), or None when every row
    is one segment without padding."""
    key = host_ids if document_masking else np.minimum(host_ids, 0)  # without document masking: -1 padding, 0 tokens
    batch, length = key.shape
    starts = np.ones((batch, length), dtype=bool)
    starts[:, 1:] = key[:, 1:] != key[:, :-1]
    first = np.flatnonzero(starts)
    if len(first) == batch and not (key < 0).any():
        return None
    return np.append(first, batch * length).astype(np.int32)


def packed_segments(doc_ids: torch.Tensor, document_masking: bool,
                    host_doc_ids: np.ndarray | None = None) -> Segments | None:
    """The segments of rows ``doc_ids`` [B, L] (document index, -1 = padding), or None when every row is one
    segment without padding (plain causal / bidirectional attention: no segments needed).

    Built from ``host_doc_ids``, the same ids on the host (the loader's copy, ``Batch.host``): the segment count is
    a host value of the kernel's launch, and reading the device's ids back would wait for everything queued there
    (the previous step's backward and optimizer). Without a host copy the device's ids are read once. The boundaries
    go to the device in one non-blocking copy, their length marked dynamic so a compiled layer compiles once for
    every segment count; ``max_seqlen`` is the row length, an upper bound the kernel accepts (its extra query tiles
    exit at once), so it is the same int on every micro-batch and never recompiles the layer either."""
    host = host_doc_ids if host_doc_ids is not None else doc_ids.cpu().numpy()
    cu_seqlens = segment_starts(host, document_masking)
    if cu_seqlens is None:
        return None
    on_device = torch.from_numpy(cu_seqlens).to(doc_ids.device, non_blocking=True)
    torch._dynamo.maybe_mark_dynamic(on_device, 0)
    return Segments(cu_seqlens=on_device, max_seqlen=int(host.shape[-1]))


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, *, causal: bool, scale: float | None) -> torch.Tensor:
    """Attention of HF's [B, heads, L, head_dim] query / key / value within ``cu_seqlens``' segments, as HF's
    attention functions return it: [B, L, heads, head_dim]. The flattening is a view of the projections' layout."""
    if varlen_attn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10); "
                           "set model.attn_implementation: flex or sdpa")
    batch, heads, length, dim = query.shape

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1])

    options = ({"window_size": (-1, 0) if causal else (-1, -1)} if "window_size" in _PARAMETERS
               else {"is_causal": causal})
    if "enable_gqa" in _PARAMETERS:
        options["enable_gqa"] = key.shape[1] != heads
    out = varlen_attn(flat(query), flat(key), flat(value), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                      scale=scale, **options)
    return out.view(batch, length, heads, out.shape[-1])


def segment_ids(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """int [B, L]: each token's segment index (for masks that need per-token facts, e.g. a softcapped model's
    FlexAttention fallback)."""
    tokens = torch.arange(batch * length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True).view(batch, length)
