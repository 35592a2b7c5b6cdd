"""One optimizer step: the objectives of a phase on their batches, losses normalised over the global batch.

The loop around it (data, checkpoints, metrics, stop signals) is :class:`pipeline.train.trainer.Trainer`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.data.format.index import ShardKind
from pipeline.data.loading.batch import Batch, cat_rows
from pipeline.model.flops import Work
from pipeline.model.moe import ROUTER_AUX
from pipeline.train.grad_cache import EmbedPass, grad_cache, split_ranges, token_ranges
from pipeline.train.phases import WeightedObjective


@dataclass(frozen=True)
class StepNumbers:
    losses: dict[str, float]  # per output, over the global batch
    accuracy: dict[str, float]  # per output
    grad_norm: float  # the gradients' 2-norm before clipping
    work: Work  # what the forward passes of all ranks ran, for the MFU
    # with sources: per output, each source's loss over the global batch (sources without targets this step left
    # out), and each source's non-padding tokens in the step's packed micro-batches
    source_losses: dict[str, dict[str, float]] = field(default_factory=dict)
    source_tokens: dict[str, int] = field(default_factory=dict)


class StepResult:
    """A step's logged numbers (``StepNumbers``' fields, and ``lr``, the rate it used). They leave the device in one
    copy queued at the step's end (non-blocking, into pinned memory, on CUDA); the first field read waits for that
    copy alone, not for the work queued after it, so the trainer can read step n while step n + 1 runs."""

    def __init__(self, values: torch.Tensor, names: list[str], lr: float, grad_norm: float | None,
                 by_source: _SourceSums | None):
        self.lr = lr
        self._names, self._grad_norm, self._by_source = names, grad_norm, by_source
        self._ready = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values, self._ready = host.copy_(values, non_blocking=True), torch.cuda.Event()
            self._ready.record()
        self._values = values

    @functools.cached_property
    def numbers(self) -> StepNumbers:
        if self._ready is not None:
            self._ready.synchronize()
        values, k = self._values.tolist(), len(self._names)
        sums, totals, (head_targets, tokens, pairs) = values[: 2 * k], values[2 * k : 3 * k], values[3 * k : 3 * k + 3]
        grad_norm = values[3 * k + 3] if self._grad_norm is None else self._grad_norm
        by_source = self._by_source.read(values[3 * k + 4 :]) if self._by_source is not None else ({}, {})
        return StepNumbers({n: sums[2 * i] / totals[i] for i, n in enumerate(self._names)},
                           {n: sums[2 * i + 1] / totals[i] for i, n in enumerate(self._names) if n != ROUTER_AUX},
                           grad_norm,
                           Work(tokens=tokens, head_targets=head_targets, attended_pairs=pairs), *by_source)

    losses = property(lambda self: self.numbers.losses)
    accuracy = property(lambda self: self.numbers.accuracy)
    grad_norm = property(lambda self: self.numbers.grad_norm)
    work = property(lambda self: self.numbers.work)
    source_losses = property(lambda self: self.numbers.source_losses)
    source_tokens = property(lambda self: self.numbers.source_tokens)


def target_counts(step_objs: list[WeightedObjective], batches: dict[str, list]) -> list[list[dict[str, int]]]:
    """Each objective's targets of each loss in each of its micro-batches (``num_targets``), as host ints. The
    trainer counts them on the batches' host copies, where this waits for no device; on device batches it reads
    each count back."""
    return [[{own: int(n) for own, n in o.objective.num_targets(b).items()} for b in batches[o.objective.shard_kind]]
            for o in step_objs]


def _on_device(values: list[float], device: torch.device) -> torch.Tensor:
    """float64 ``values`` on ``device`` without waiting for it: a blocking copy to CUDA would wait for its queue,
    so the copy goes non-blocking from pinned memory."""
    host = torch.tensor(values, dtype=torch.float64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class _SourceSums:
    """Per-source loss sums and targets of each output, and tokens per source, of one step, on the device: added
    per micro-batch with ``index_add_`` (no host sync) and reduced and read back with the step's other numbers."""

    def __init__(self, sources: tuple[str, ...], device: torch.device):
        self.sources, self.device = sources, device
        self.sums: dict[str, torch.Tensor] = {}  # output -> float64 [S, 2] (loss sum, targets)
        self.tokens = torch.zeros(len(sources), dtype=torch.float64, device=device)

    def add_tokens(self, batch) -> None:
        self.tokens.index_add_(0, batch.source_ids.clamp(min=0), (batch.doc_ids >= 0).sum(-1).double())

    def add(self, name: str, batch, row_loss: torch.Tensor, row_targets: torch.Tensor) -> None:
        into = self.sums.setdefault(name, torch.zeros(len(self.sources), 2, dtype=torch.float64, device=self.device))
        # padding rows (source -1) have no targets: adding them to source 0 adds nothing
        into.index_add_(0, batch.source_ids.clamp(min=0), torch.stack([row_loss.double(), row_targets.double()], -1))

    def flat(self) -> torch.Tensor:
        return torch.cat([*(s.flatten() for s in self.sums.values()), self.tokens])

    def read(self, values: list[float]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
        """(losses, tokens) from the reduced :meth:`flat` as host floats."""
        n, losses = len(self.sources), {}
        for i, name in enumerate(self.sums):
            pairs = values[2 * n * i : 2 * n * (i + 1)]
            losses[name] = {src: pairs[2 * j] / pairs[2 * j + 1] for j, src in enumerate(self.sources)
                            if pairs[2 * j + 1] > 0}
        tokens = values[2 * n * len(self.sums):]
        return losses, {src: int(t) for src, t in zip(self.sources, tokens)}


def _unreported_grad_norm(engine) -> torch.Tensor | None:
    """The gradients' 2-norm where DeepSpeed measures none: without ZeRO and in fp32 (stage 0) the client optimizer
    runs unwrapped and ``get_global_grad_norm()`` stays None. Read at the accumulation boundary, after ``backward``
    has all-reduced the gradients and before ``step()`` clips and clears them, so it is DeepSpeed's norm: the one
    before clipping. None where DeepSpeed's optimizer (ZeRO, bf16) measures it itself."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return None
    return torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters() if p.grad is not None])


def _mark_boundary(engine, micro: int, micro_steps: int) -> None:
    """Tell DeepSpeed whether micro-step ``micro`` ends the optimizer step: the trainer owns the boundary, since a
    batch warmup (``train.batch_warmup``) takes fewer micro-steps than DeepSpeed's ``gradient_accumulation_steps``
    (whose counter would then also run out of step with ours)."""
    engine.set_gradient_accumulation_boundary(micro == micro_steps - 1)


def _micro_steps(engine, step_objs: list[WeightedObjective], batches: dict[str, list], counts: list[list[dict]],
                 names: list[str], weights: dict[str, float], scale: torch.Tensor, sums: torch.Tensor,
                 by_source: _SourceSums | None, micro_steps: int):
    """Forward, backward and (at the boundary, inside DeepSpeed) the update of each micro-batch; the gradients'
    norm where DeepSpeed measures none. Token objectives get their host-counted targets (``counts``, as
    :func:`target_counts`). With ``by_source``, each packed output's row losses are summed per source too."""
    grad_norm = None
    for micro in range(micro_steps):
        _mark_boundary(engine, micro, micro_steps)
        loss = 0.0
        for o, per_micro in zip(step_objs, counts):
            batch = batches[o.objective.shard_kind][micro]
            known = (per_micro[micro],) if o.objective.predicts_tokens else ()
            for own, out in engine(o.objective, batch, *known).items():
                loss_sum, correct = out[0], out[2]
                name = o.loss_name(own)
                i = names.index(name)
                loss = loss + weights[name] * loss_sum * scale[i]
                sums[i] += torch.stack([loss_sum.detach().float(), correct.float()])
                if by_source is not None and o.objective.shard_kind == ShardKind.PACKED and len(out) == 5:
                    by_source.add(name, batch, out[3], out[4])
        engine.backward(loss)
        if micro == micro_steps - 1:
            grad_norm = _unreported_grad_norm(engine)
        engine.step()
    return grad_norm


def _token_chunks(micro: list[Batch], budget: int, device: torch.device) -> list[Batch]:
    """The rows of ``micro`` in order, cut into chunks of at most ``budget`` real tokens (``grad_cache: {tokens:
    N}``), counted on the host copies; as many chunks as the rank that needs most (``split_ranges``). Reads one
    number back from the device: that count."""
    whole = cat_rows(micro)
    tokens = (whole.host_values().doc_ids >= 0).sum(-1).tolist()
    ranges = token_ranges(tokens, budget)
    count = torch.tensor([len(ranges)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return [whole.rows(begin, end) for begin, end in split_ranges(ranges, tokens, int(count))]


def _cached_micro_steps(engine, o: WeightedObjective, micro: list, factor: torch.Tensor, sums: torch.Tensor):
    """The micro-batches as one contrastive batch (``grad_cache``): embedded without a graph in chunks (the
    micro-batches, or token-budget chunks of their rows), the loss of all of them and its embedding gradient, then
    each chunk re-run with its RNG state and back-propagated through the engine, which accumulates, clips and steps
    as for any micro-step. ``factor`` is the loss's weight times its normalisation (``world * grad_accum / global
    queries``); DeepSpeed divides every backward by ``grad_accum``, whatever the number of chunks."""
    objective, result, grad_norm = o.objective, {}, None
    budget = getattr(objective, "chunk_tokens", None)
    chunks = micro if budget is None else _token_chunks(micro, budget, factor.device)
    micro_steps = len(chunks)

    def loss(embeddings: torch.Tensor) -> torch.Tensor:
        result["out"] = out = objective.loss(embeddings, micro)
        return out.loss_sum * factor

    def backward(m: int, surrogate: torch.Tensor) -> None:
        nonlocal grad_norm
        _mark_boundary(engine, m, micro_steps)
        engine.backward(surrogate)
        if m == micro_steps - 1:
            grad_norm = _unreported_grad_norm(engine)
        engine.step()

    grad_cache(lambda m: engine(EmbedPass(objective), chunks[m]), micro_steps, loss, backward)
    sums += torch.stack([result["out"].loss_sum.detach().float(), result["out"].num_correct.float()])
    return grad_norm


def train_step(engine, step_objs: list[WeightedObjective], batches: dict[str, list], world: int,
               grad_accum: int, sources: tuple[str, ...] = (), counts: list[list[dict]] | None = None) -> StepResult:
    """One optimizer step over the micro-batches in ``batches`` (by shard kind: ``grad_accum`` of each, or fewer
    while a batch warmup grows the global batch).

    Every loss is normalised by its target count over the whole global batch (all ranks, all micro-steps), so
    the step equals one big-batch step whatever the split; DeepSpeed divides the gradients by the world size and
    its ``gradient_accumulation_steps`` (``grad_accum``, whatever the micro-steps), hence the ``world * grad_accum``
    factor. The step's work is summed in the same all-reduce. An
    objective with ``grad_cache`` (alone in its phase) takes its micro-batches as one contrastive batch.
    ``sources``: the names of the packed shards' sources when their batches carry source ids; each output of a
    packed objective is then also summed per source (its loss over that source's targets in the global batch).
    ``counts``: :func:`target_counts` of the batches' host copies (the trainer's; default: counted here).
    """
    # Nothing here reads the device back (tests/unit/train/test_trainer.py counts the reads): a host sync drains the
    # device's queue, so one before (or inside) the forward would leave it idle while the host launches. The target
    # counts come from the host; the logged numbers leave the device in one non-blocking copy (``StepResult``).
    device = next(engine.module.parameters()).device
    counts = target_counts(step_objs, batches) if counts is None else counts
    totals: dict[str, int] = {}
    weights: dict[str, float] = {}
    head_targets = 0
    body = torch.zeros(2, dtype=torch.float64, device=device)
    router_aux_coef = getattr(engine.module, "router_aux_coef", None)  # an MoE model: one router loss per call
    for o, per_micro in zip(step_objs, counts):
        for b in batches[o.objective.shard_kind]:
            body += o.objective.body_work(b)
        for micro in per_micro:
            for own, n in micro.items():
                name = o.loss_name(own)
                totals[name] = totals.get(name, 0) + n
                weights[name] = o.weight * o.objective.loss_weights[own]
                head_targets += n if o.objective.predicts_tokens else 0
        if router_aux_coef is not None:
            totals[ROUTER_AUX] = totals.get(ROUTER_AUX, 0) + len(per_micro)
            weights[ROUTER_AUX] = router_aux_coef
    names = list(totals)
    reduced = torch.cat([_on_device([*(totals[n] for n in names), head_targets], device), body])
    dist.all_reduce(reduced)
    total = reduced[: len(names)].clamp(min=1.0)
    # fp32 like the Python float it replaces, which multiplied an fp32 loss as fp32: the losses stay bit-identical
    scale = (world * grad_accum / total).float()
    sums = torch.zeros(len(names), 2, device=device)
    by_source = _SourceSums(sources, device) if sources else None
    if by_source is not None:
        for b in batches.get(ShardKind.PACKED, []):
            by_source.add_tokens(b)
    lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves on inside the last step()
    cached = [o for o in step_objs if getattr(o.objective, "grad_cache", False)]
    if cached:  # the config allows a grad-cache objective only alone in its phase
        o = cached[0]
        name = o.loss_name(o.objective.name)
        grad_norm = _cached_micro_steps(engine, o, batches[o.objective.shard_kind],
                                        weights[name] * scale[names.index(name)], sums[names.index(name)])
    else:
        micro_steps = len(batches[step_objs[0].objective.shard_kind])
        grad_norm = _micro_steps(engine, step_objs, batches, counts, names, weights, scale, sums, by_source, micro_steps)
    if grad_norm is None:  # None only where the DeepSpeed config turns it off (zero_optimization.compute_grad_norm)
        grad_norm = engine.get_global_grad_norm()
    dist.all_reduce(sums)
    per_source = by_source.flat() if by_source is not None else torch.zeros(0, dtype=torch.float64, device=device)
    if by_source is not None:
        dist.all_reduce(per_source)
    # the step's one copy to the host: the logged losses and accuracies, their target counts, the work, the grad
    # norm where it is still on the device
    on_device = isinstance(grad_norm, torch.Tensor)
    norm = grad_norm.detach().double().reshape(1).to(device) if on_device else torch.zeros(1, dtype=torch.float64,
                                                                                            device=device)
    values = torch.cat([sums.double().flatten(), total, reduced[len(names):], norm, per_source])
    return StepResult(values, names, lr, None if on_device else float(grad_norm if grad_norm is not None else 0.0),
                      by_source)
