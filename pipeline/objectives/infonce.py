"""InfoNCE on cosine similarity with in-batch negatives gathered across data-parallel ranks, with gradient.

Shared by LLM2Vec's unsupervised SimCSE and MAGNET's SSCL. Each rank scores its own queries against the keys
of every rank; the gather's backward sums the key gradients over ranks, so the step equals one step on the
concatenated batch (the trainer divides the summed loss by the global number of queries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.objectives.base import ObjectiveOutput


class _GatherRows(torch.autograd.Function):
    """All-gather rows of different counts per rank; backward returns this rank's slice of the summed gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        rank = dist.get_rank()
        ctx.start, ctx.end = sum(counts[:rank]), sum(counts[: rank + 1])
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.start : ctx.end], None


def gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows of all ranks, offset of this rank's rows); the identity without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    n = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, n)
    counts = [int(c) for c in counts]
    return _GatherRows.apply(x, counts), sum(counts[: dist.get_rank()])


def info_nce(queries: torch.Tensor, keys: torch.Tensor, scale: float = 20.0) -> ObjectiveOutput:
    """Row i of ``queries`` must pick row i of ``keys`` among the keys of every rank (one direction, q -> k).
    ``scale`` is 1 / temperature (LLM2Vec: 20, i.e. tau = 0.05)."""
    if queries.shape != keys.shape or queries.ndim != 2:
        raise ValueError(f"info_nce needs queries and keys of the same [n, d] shape, got {tuple(queries.shape)} "
                         f"and {tuple(keys.shape)}")
    all_keys, offset = gather_rows(keys)
    if all_keys.shape[0] < 2:
        raise ValueError("the contrastive batch holds fewer than 2 examples over all ranks, so there is no negative; "
                         "raise the unit micro batch (data.unit_micro_batch)")
    logits = scale * F.normalize(queries.float(), dim=-1) @ F.normalize(all_keys.float(), dim=-1).T
    labels = torch.arange(queries.shape[0], device=queries.device) + offset
    return ObjectiveOutput(loss_sum=F.cross_entropy(logits, labels, reduction="sum"),
                           num_targets=torch.tensor(queries.shape[0], device=queries.device),
                           num_correct=(logits.argmax(-1) == labels).sum())
