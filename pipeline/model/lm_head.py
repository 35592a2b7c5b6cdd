"""A memory-bounded LM head loss: linear + cross-entropy over chunks of target rows, recomputed in backward.

The unchunked head materialises fp32 logits for every target (8 x 2048 CLM targets x 128 256 words x 4 bytes
= 8.4 GB, twice that with their gradient). Here the forward keeps only each row's log-sum-exp: per chunk of
``chunk_size`` rows it computes the logits, their log-sum-exp, the label's logit and whether the label is the
arg-max, then drops them. The backward recomputes each chunk's logits, turns them into the softmax gradient and
accumulates the input and weight gradients, so the extra memory is O(chunk x vocab) (the approach of Cut
Cross-Entropy; Liger-Kernel's fused linear cross-entropy computes the gradients in the forward instead).

Matmuls run in the weight's dtype (bf16 on GPU) like ``nn.Linear``; logits, softmax and loss are fp32, and the
weight gradient is accumulated over chunks in fp32. Under ZeRO-3 the head runs as the ``lm_head`` module's
forward, so DeepSpeed gathers its weight for the forward and again for the backward, as for the plain head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK = 1024  # rows per chunk: 1024 x 128 256 fp32 logits = 0.5 GB, large enough for full-speed matmuls


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden @ weight.T).float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int):
        lse = torch.empty(len(labels), dtype=torch.float32, device=hidden.device)
        label_logit = torch.empty_like(lse)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        for start in range(0, len(labels), chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight)
            lse[rows] = logits.logsumexp(-1)
            label_logit[rows] = logits.gather(-1, labels[rows, None]).squeeze(-1)
            # a label is right when its logit is the largest (amax: CPU argmax costs ~30x more)
            correct += (label_logit[rows] >= logits.amax(-1)).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(correct)
        return (lse - label_logit).sum(), correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        rows_all = torch.arange(len(labels), device=labels.device)
        for start in range(0, len(labels), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # d loss / d logits = softmax - onehot(label), scaled by the incoming gradient
            grad_logits = (_chunk_logits(hidden[rows], weight) - lse[rows, None]).exp_()
            grad_logits[rows_all[:len(grad_logits)], labels[rows]] -= 1.0
            grad_logits = (grad_logits * grad_loss).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ hidden[rows]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy, number of rows whose label has the largest logit) of materialised fp32 logits."""
    with torch.no_grad():  # a label is right when its logit is the largest: amax, as CPU argmax costs ~30x more
        correct = (logits.gather(-1, labels[:, None]).squeeze(-1) >= logits.amax(-1)).sum()
    return F.cross_entropy(logits, labels, reduction="sum"), correct


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sum of cross-entropy of ``hidden @ weight.T`` against ``labels``, number of rows whose label has the
    largest logit), ``chunk_size`` rows at a time. ``hidden`` [N, H], ``weight`` [V, H], ``labels`` [N].

    Up to ``chunk_size`` rows the logits are one chunk anyway, so they are kept for the backward (as the plain
    head does) rather than recomputed: within the same memory bound, and no slower than the plain head."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if len(labels) <= chunk_size:
        return cross_entropy(_chunk_logits(hidden, weight), labels)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size)


class ChunkedLMHead(nn.Linear):
    """The model's ``lm_head`` (same weight), whose forward with ``labels`` returns ``linear_cross_entropy``'s
    (loss sum, correct count) instead of logits; without labels it is the plain linear layer."""

    chunk_size: int = DEFAULT_CHUNK

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, labels, self.chunk_size)


def chunk_lm_head(model: nn.Module, chunk_size: int = DEFAULT_CHUNK) -> ChunkedLMHead:
    """Turn ``model.lm_head`` into a ``ChunkedLMHead`` in place (the same module and parameter, so ZeRO-3's
    partitioning and hooks and the checkpoint keys are unchanged); call it before the engine is built."""
    head = model.lm_head
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"model.lm_head_chunk: the chunked LM head needs a bias-free nn.Linear lm_head, this model "
                         f"has {head!r}; set model.lm_head_chunk: 0 for the unchunked head")
    if chunk_size < 1:
        raise ValueError(f"model.lm_head_chunk must be >= 1 (or 0 for the unchunked head), got {chunk_size}")
    head.__class__ = ChunkedLMHead
    head.chunk_size = chunk_size
    return head
