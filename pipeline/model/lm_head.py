"""A memory-bounded LM head loss: linear + cross-entropy over chunks of target rows, gradients made per chunk.

The unchunked head materialises fp32 logits for every target (8 x 2048 CLM targets x 128 256 words x 4 bytes
= 8.4 GB, twice that with their gradient). Here, per chunk of ``chunk_size`` rows, the forward computes the
logits, the loss and whether the label is the arg-max and, while the chunk's logits are live, their softmax
gradient and from it the chunk's input gradient and its share of the weight gradient; then the logits are
dropped. The backward only scales the two stored gradients by the incoming one. This is Liger-Kernel's fused
linear cross-entropy: the extra memory is O(chunk x vocab) plus the two gradients (the size of the input and of
the weight), and the matmuls are the plain head's three. Recomputing each chunk's logits in the backward instead
(Cut Cross-Entropy) holds no weight-sized gradient between forward and backward but adds a fourth matmul: 1.31x
the plain head's step on CPU (BENCHMARKS.md), against the goal of 1.05x.

Matmuls run in the weight's dtype (bf16 on GPU) like ``nn.Linear``; logits, softmax and loss are fp32, and the
weight gradient is accumulated over chunks in fp32. Under ZeRO-3 the head runs as the ``lm_head`` module's
forward, so DeepSpeed gathers its weight for it as for the plain head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK = 1024  # rows per chunk: 1024 x 128 256 fp32 logits = 0.5 GB, large enough for full-speed matmuls


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden @ weight.T).float()


def _out_dtype_gemm(t: torch.Tensor) -> bool:
    """Whether the GEMMs take ``out_dtype``: on CUDA, in eager only. Traced (DeepCompile compiles the whole module,
    this head included), inductor has no lowering of ``addmm(..., out_dtype=)`` (pytorch#163880: "tuned_addmm() takes
    3 positional arguments"), and it fuses the cast of the product into the GEMM's epilogue itself."""
    return t.is_cuda and not torch.compiler.is_compiling()


def _fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` in fp32: on CUDA the GEMM writes its fp32 accumulator directly (``out_dtype``), with no
    bf16 product to round and cast in a second pass; elsewhere the product cast, as ``_chunk_logits``."""
    if _out_dtype_gemm(hidden) and hidden.dtype != torch.float32:
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    return _chunk_logits(hidden, weight)


def _accumulate(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``into += a @ b`` for an fp32 accumulator: bf16 inputs go into it through the GEMM's epilogue on CUDA (one
    read and write of ``into``), elsewhere through a product in ``a``'s dtype and a cast."""
    if a.dtype == into.dtype:
        into.addmm_(a, b)
    elif _out_dtype_gemm(into):
        torch.addmm(into, a, b, out_dtype=into.dtype, out=into)
    else:
        into += (a @ b).float()


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, grads: bool,
             per_target: bool = False):
    """(loss sum, correct count, d loss / d hidden, d loss / d weight, each row's loss), the gradients None unless
    ``grads``, the rows' losses (detached) None unless ``per_target``.

    Each chunk's fp32 logits are read and written as few times as the math allows: the row max (for the correct
    count and as the softmax's shift), the shifted exponent in place, its row sums (the log-sum-exp), and the
    softmax divided straight into the matmul dtype's gradient buffer."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    rows_loss = torch.empty(len(labels), dtype=torch.float32, device=hidden.device) if per_target else None
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
    for start in range(0, len(labels), chunk_size):
        rows = slice(start, start + chunk_size)
        logits = _fp32_logits(hidden[rows], weight)
        label_logit = logits.gather(-1, labels[rows, None]).squeeze(-1)
        top = logits.amax(-1)
        correct += (label_logit >= top).sum()  # the label's logit is the largest (amax: CPU argmax costs ~30x more)
        exp = logits.sub_(top[:, None]).exp_()
        total = exp.sum(-1)
        row_loss = total.log() + top - label_logit
        loss += row_loss.sum()
        if per_target:
            rows_loss[rows] = row_loss
        if grads:  # d loss / d logits = softmax - onehot(label)
            grad_logits = exp.div_(total[:, None]) if weight.dtype == exp.dtype else \
                torch.div(exp, total[:, None], out=torch.empty_like(exp, dtype=weight.dtype))
            grad_logits[torch.arange(len(grad_logits), device=labels.device), labels[rows]] -= 1.0
            grad_hidden[rows] = grad_logits @ weight
            _accumulate(grad_weight, grad_logits.T, hidden[rows])
    return loss, correct, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), rows_loss


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                per_target: bool):
        loss, correct, grad_hidden, grad_weight, rows = _chunked(hidden, weight, labels, chunk_size, True, per_target)
        ctx.save_for_backward(grad_hidden, grad_weight)
        rows = rows if per_target else correct.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(correct, rows)
        return loss, correct, rows

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct, _grad_rows):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, per_target: bool = False) -> tuple[torch.Tensor, ...]:
    """(sum of cross-entropy, number of rows whose label has the largest logit) of materialised fp32 logits; with
    ``per_target`` also each row's cross-entropy (detached: a metric; one more pass over the logits)."""
    with torch.no_grad():  # a label is right when its logit is the largest: amax, as CPU argmax costs ~30x more
        label_logit = logits.gather(-1, labels[:, None]).squeeze(-1)
        correct = (label_logit >= logits.amax(-1)).sum()
        rows = (logits.logsumexp(-1) - label_logit,) if per_target else ()
    return F.cross_entropy(logits, labels, reduction="sum"), correct, *rows


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_size: int = DEFAULT_CHUNK, per_target: bool = False) -> tuple[torch.Tensor, ...]:
    """(fp32 sum of cross-entropy of ``hidden @ weight.T`` against ``labels``, number of rows whose label has the
    largest logit), ``chunk_size`` rows at a time. ``hidden`` [N, H], ``weight`` [V, H], ``labels`` [N]. With
    ``per_target``, each row's cross-entropy (detached) as a third value.

    Up to ``chunk_size`` rows the logits are one chunk anyway: they go through the plain head's autograd path,
    within the same memory bound. Without gradients (evaluation) no gradient is made."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if len(labels) <= chunk_size:
        return cross_entropy(_chunk_logits(hidden, weight), labels, per_target)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size, per_target)
    else:
        out = _chunked(hidden, weight, labels, chunk_size, False, per_target)
        out = (out[0], out[1], out[4])
    return out if per_target else out[:2]


class ChunkedLMHead(nn.Linear):
    """The model's ``lm_head`` (same weight), whose forward with ``labels`` returns ``linear_cross_entropy``'s
    (loss sum, correct count[, each row's loss]) instead of logits; without labels it is the plain linear layer."""

    chunk_size: int = DEFAULT_CHUNK

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, per_target: bool = False):
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, labels, self.chunk_size, per_target)


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
