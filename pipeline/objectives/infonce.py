"""InfoNCE on cosine similarity with in-batch negatives gathered across data-parallel ranks, with gradient.

Shared by LLM2Vec's unsupervised SimCSE and supervised stage and MAGNET's SSCL. Each rank scores its own queries
against the keys of every rank; the gather's backward sums the key gradients over ranks, so the step equals one
step on the concatenated batch (the trainer divides the summed loss by the global number of queries).

``matryoshka`` (Matryoshka representation learning, Kusupati et al. 2022) adds the same InfoNCE on the first d
coordinates of every embedding for each of its dims, weighted: sentence-transformers' ``MatryoshkaLoss`` around
``MultipleNegativesRankingLoss``. The rows are gathered once at full width and cut after, so the cut composes
with the gather and with GradCache (which caches the gradient of the whole loss with respect to full embeddings).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.objectives.base import ObjectiveOutput
from pipeline.objectives.configs import Matryoshka


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


def collisions(key_hashes: torch.Tensor, column_hashes: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Bool [n, m]: the candidates of each query whose text equals its positive's (``key_hashes`` [n]), other than
    the positive itself (column ``labels[i]``): another row's identical positive or hard negative, a false
    negative that must not be scored against the query (llm2vec issue #178)."""
    same = column_hashes[None, :] == key_hashes[:, None]
    same[torch.arange(len(labels), device=labels.device), labels] = False
    return same


def info_nce(queries: torch.Tensor, keys: torch.Tensor, scale: float = 20.0, negatives: torch.Tensor | None = None,
             key_hashes: torch.Tensor | None = None, negative_hashes: torch.Tensor | None = None,
             matryoshka: Matryoshka | None = None, in_batch: bool = True) -> ObjectiveOutput:
    """Row i of ``queries`` must pick row i of ``keys`` among the keys of every rank (one direction, q -> k), and
    the ``negatives`` of every rank after them (LLM2Vec's HardNegativeNLLLoss order: all positives, then all hard
    negatives). ``scale`` is 1 / temperature (LLM2Vec: 20 for SimCSE, 50 for supervised training). With
    ``key_hashes`` (int64 [n], the keys' text hashes; ``negative_hashes`` those of the negatives) a candidate with
    the text of query i's own key is left out of query i's softmax (:func:`collisions`). ``in_batch`` false: row i
    picks its key among its own negatives only (``negatives`` [n x K, d], row i's K in order; FlagEmbedding's
    ``use_inbatch_neg=False``), nothing gathered, as each row's loss is its own. ``matryoshka``: the weighted sum
    of the InfoNCE on each of its leading dims instead (module docstring); ``num_correct`` counts the picks of the
    first (largest) one."""
    if queries.shape != keys.shape or queries.ndim != 2:
        raise ValueError(f"info_nce needs queries and keys of the same [n, d] shape, got {tuple(queries.shape)} "
                         f"and {tuple(keys.shape)}")
    precision = torch.promote_types(queries.dtype, torch.float32)  # bf16 scored in fp32; fp64 (tests) kept
    score, labels, masked = (_in_batch if in_batch else _own)(queries, keys, negatives, key_hashes, negative_hashes)
    loss_sum, first = None, None
    for dim, weight in matryoshka.terms() if matryoshka else [(None, None)]:
        logits = score(scale * F.normalize(queries[:, :dim].to(precision), dim=-1), dim, precision)
        if masked is not None:
            logits = logits.masked_fill(masked, float("-inf"))
        term = F.cross_entropy(logits, labels, reduction="sum")
        term = term if weight is None else weight * term
        loss_sum, first = (term, logits) if loss_sum is None else (loss_sum + term, first)
    return ObjectiveOutput(loss_sum=loss_sum, num_targets=torch.tensor(queries.shape[0], device=queries.device),
                           num_correct=(first.argmax(-1) == labels).sum())


# (scale x the normalised queries, the dim, the dtype) -> logits: the scale first, as the scores always were
Scores = Callable[[torch.Tensor, int | None, torch.dtype], torch.Tensor]


def _in_batch(queries, keys, negatives, key_hashes, negative_hashes) -> tuple[Scores, torch.Tensor, torch.Tensor | None]:
    """(scores against every rank's keys, then every rank's negatives; the labels; the collision mask)."""
    all_keys, offset = gather_rows(keys)
    candidates = all_keys if negatives is None else torch.cat([all_keys, gather_rows(negatives)[0]])
    if candidates.shape[0] < 2:
        raise ValueError("the contrastive batch holds fewer than 2 examples over all ranks, so there is no negative; "
                         "raise the unit micro batch (data.unit_micro_batch)")
    labels = torch.arange(queries.shape[0], device=queries.device) + offset
    masked = None
    if key_hashes is not None:
        with torch.no_grad():
            columns = gather_rows(key_hashes)[0]
            if negatives is not None:
                columns = torch.cat([columns, gather_rows(negative_hashes)[0]])
            masked = collisions(key_hashes, columns, labels)
    return (lambda q, dim, dtype: q @ F.normalize(candidates[:, :dim].to(dtype), dim=-1).T), labels, masked


def _own(queries, keys, negatives, key_hashes, negative_hashes) -> tuple[Scores, torch.Tensor, torch.Tensor | None]:
    """(scores of each row against its own key, then its own negatives; label 0; the collision mask: a negative
    with the text of the row's key)."""
    n = queries.shape[0]
    if negatives is None or negatives.shape[0] == 0 or negatives.shape[0] % n:
        raise ValueError(f"without in-batch negatives each query needs its own hard negatives, got "
                         f"{0 if negatives is None else negatives.shape[0]} for {n} queries")
    own = torch.cat([keys[:, None], negatives.view(n, -1, negatives.shape[-1])], 1)  # [n, 1 + K, d]
    masked = None
    if key_hashes is not None:
        same = negative_hashes.view(n, -1) == key_hashes[:, None]
        masked = torch.cat([torch.zeros_like(same[:, :1]), same], 1)
    labels = torch.zeros(n, dtype=torch.long, device=queries.device)
    return (lambda q, dim, dtype: torch.einsum("nd,nkd->nk", q, F.normalize(own[..., :dim].to(dtype), dim=-1))), \
        labels, masked
