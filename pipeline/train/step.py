"""One optimizer step: the objectives of a phase on their batches, losses normalised over the global batch.

The loop around it (data, checkpoints, metrics, stop signals) is :class:`pipeline.train.trainer.Trainer`. The path
to the backward: :func:`train_step` normalises the step (:func:`_normalised`), picks each objective's pass (plain, or
GradCache's), runs the one micro-step loop (:func:`_micro_steps`) and reads the numbers back (:class:`StepMetrics`).
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
from pipeline.objectives.base import ObjectiveOutput
from pipeline.train.grad_cache import EmbedPass, GradCache, split_ranges, token_ranges
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
    copy alone, not for the work queued after it, so the trainer can read step n while step n + 1 runs. ``values``
    holds :class:`StepMetrics`' slots, named in ``slots``; ``grad_norm`` is the norm where it is on the host."""

    def __init__(self, values: torch.Tensor, slots: dict[str, slice], names: list[str], sources: tuple[str, ...],
                 lr: float, grad_norm: float | None):
        self.lr = lr
        self._slots, self._names, self._sources, self._grad_norm = slots, names, sources, grad_norm
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
        values = self._values.tolist()
        slot = {name: values[at] for name, at in self._slots.items()}
        head_targets, tokens, pairs = slot["work"]
        by_source = {name.removeprefix("source/"): v for name, v in slot.items() if name.startswith("source/")}
        return StepNumbers({n: slot[f"sums/{n}"][0] / slot[f"targets/{n}"][0] for n in self._names},
                           {n: slot[f"sums/{n}"][1] / slot[f"targets/{n}"][0] for n in self._names if n != ROUTER_AUX},
                           slot["grad_norm"][0] if "grad_norm" in slot else self._grad_norm,
                           Work(tokens=tokens, head_targets=head_targets, attended_pairs=pairs),
                           {name: {src: v[2 * j] / v[2 * j + 1] for j, src in enumerate(self._sources) if v[2 * j + 1] > 0}
                            for name, v in by_source.items()},
                           {src: int(t) for src, t in zip(self._sources, slot.get("source_tokens", ()))})

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


@dataclass(frozen=True)
class _Normalised:
    """Each output's weight and normalisation in a step, from its targets over the whole global batch."""

    names: list[str]  # the step's outputs, in the order of their first micro-batch
    weights: dict[str, float]  # each output's weight (the objective's times the loss's)
    scale: torch.Tensor  # fp32 [outputs]: world * grad_accum / the output's targets over the global batch
    totals: torch.Tensor  # float64 [outputs]: those targets (at least 1)
    work: torch.Tensor  # float64 [3]: head targets, body tokens and attended pairs of all ranks

    def weighted(self, name: str, loss_sum: torch.Tensor) -> torch.Tensor:
        return self.weights[name] * loss_sum * self.scale[self.names.index(name)]


def _normalised(engine, step_objs: list[WeightedObjective], batches: dict[str, list], counts: list[list[dict]],
                world: int, grad_accum: int, device: torch.device) -> _Normalised:
    """Every loss is normalised by its target count over the whole global batch (all ranks, all micro-steps), so
    the step equals one big-batch step whatever the split; DeepSpeed divides the gradients by the world size and
    its ``gradient_accumulation_steps`` (``grad_accum``, whatever the micro-steps), hence the ``world * grad_accum``
    factor. The step's work is summed in the same all-reduce."""
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
    return _Normalised(names, weights, (world * grad_accum / total).float(), total, reduced[len(names):])


class StepMetrics:
    """A step's logged numbers, summed on the device in named slots as the micro-steps run (no host sync): each
    output's loss sum and correct predictions (fp32, as its loss), and with ``sources`` each packed output's loss
    sum and targets per source and the packed tokens per source (float64, ``index_add_``). :meth:`result` sums them
    over the ranks in one all-reduce and queues the step's one copy to the host (:class:`StepResult`)."""

    def __init__(self, names: list[str], sources: tuple[str, ...], device: torch.device):
        self.names, self.sources, self.device = names, sources, device
        self.sums = torch.zeros(len(names), 2, device=device)  # per output: loss sum, correct
        self.by_source: dict[str, torch.Tensor] = {}  # output -> float64 [S, 2]: loss sum, targets
        self.tokens = torch.zeros(len(sources), dtype=torch.float64, device=device)

    def add_tokens(self, batch: Batch) -> None:
        self.tokens.index_add_(0, batch.source_ids.clamp(min=0), (batch.doc_ids >= 0).sum(-1).double())

    def add(self, name: str, out: ObjectiveOutput, packed: Batch | None = None) -> None:
        """One forward's output ``name``; ``packed``: its batch, when packed, whose rows are summed per source."""
        self.sums[self.names.index(name)] += torch.stack([out.loss_sum.detach().float(), out.num_correct.float()])
        if self.sources and packed is not None and out.row_loss is not None:
            into = self.by_source.setdefault(name, torch.zeros(len(self.sources), 2, dtype=torch.float64,
                                                                device=self.device))
            # padding rows (source -1) have no targets: adding them to source 0 adds nothing
            into.index_add_(0, packed.source_ids.clamp(min=0),
                            torch.stack([out.row_loss.double(), out.row_targets.double()], -1))

    def result(self, norm: _Normalised, grad_norm, lr: float) -> StepResult:
        """The step's numbers, the ranks' sums reduced (the target counts and the work were before the step); the
        grad norm joins the copy where it is still on the device."""
        summed = {**{f"sums/{name}": s for name, s in zip(self.names, self.sums.double())},  # loss sum, correct
                  **{f"source/{name}": s.flatten() for name, s in self.by_source.items()},
                  **({"source_tokens": self.tokens} if self.sources else {})}
        on_device = isinstance(grad_norm, torch.Tensor)
        kept = {**{f"targets/{name}": t.reshape(1) for name, t in zip(self.names, norm.totals)}, "work": norm.work,
                **({"grad_norm": grad_norm.detach().double().reshape(1).to(self.device)} if on_device else {})}
        parts = summed | kept
        slots, at = {}, 0
        for name, part in parts.items():
            slots[name], at = slice(at, at + len(part)), at + len(part)
        values = torch.cat(list(parts.values()))
        dist.all_reduce(values[: sum(len(part) for part in summed.values())])  # in place: the ranks' sums
        return StepResult(values, slots, self.names, self.sources, lr,
                          None if on_device else float(grad_norm if grad_norm is not None else 0.0))


def _unreported_grad_norm(engine) -> torch.Tensor | None:
    """The gradients' 2-norm where DeepSpeed measures none: without ZeRO and in fp32 (stage 0) the client optimizer
    runs unwrapped and ``get_global_grad_norm()`` stays None. Read at the accumulation boundary, after ``backward``
    has all-reduced the gradients and before ``step()`` clips and clears them, so it is DeepSpeed's norm: the one
    before clipping. None where DeepSpeed's optimizer (ZeRO, bf16) measures it itself."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return None
    return torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters() if p.grad is not None])


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


class _Pass:
    """One objective's part of each micro-step: ``loss(m, metrics)`` runs its forward of micro-step ``m`` and
    returns what to back-propagate, normalised; ``begin`` and ``end`` run before and after the loop."""

    micro_steps: int

    def begin(self, metrics: StepMetrics) -> None:
        return None

    def loss(self, m: int, metrics: StepMetrics) -> torch.Tensor:
        raise NotImplementedError

    def end(self) -> None:
        return None


class _Plain(_Pass):
    """Each micro-batch through the engine's forward; its outputs' losses weighted, normalised and summed. Token
    objectives get their host-counted targets (``counts``, as :func:`target_counts`)."""

    def __init__(self, engine, o: WeightedObjective, batches: list[Batch], counts: list[dict], norm: _Normalised):
        self.engine, self.o, self.batches, self.counts, self.norm = engine, o, batches, counts, norm
        self.micro_steps = len(batches)

    def loss(self, m: int, metrics: StepMetrics) -> torch.Tensor:
        objective, batch = self.o.objective, self.batches[m]
        packed = batch if objective.shard_kind == ShardKind.PACKED else None
        known = (self.counts[m],) if objective.predicts_tokens else ()
        loss = 0.0
        for own, out in self.engine(objective, batch, *known).items():
            name = self.o.loss_name(own)
            loss = loss + self.norm.weighted(name, out.loss_sum)
            metrics.add(name, out, packed)
        return loss


class _Cached(_Pass):
    """The micro-batches as one contrastive batch (``grad_cache``, :class:`GradCache`): embedded without a graph in
    chunks (the micro-batches, or token-budget chunks of their rows), the loss of all of them and its embedding
    gradient, then one chunk re-run and back-propagated a micro-step, so the engine accumulates, clips and steps as
    for any micro-step. The loss is weighted and normalised by its factor (weight times ``world * grad_accum /
    global queries``); DeepSpeed divides every backward by ``grad_accum``, whatever the number of chunks."""

    def __init__(self, engine, o: WeightedObjective, batches: list[Batch], counts: list[dict], norm: _Normalised):
        objective, self.name = o.objective, o.loss_name(o.objective.name)
        budget = objective.chunk_tokens
        chunks = batches if budget is None else _token_chunks(batches, budget, norm.scale.device)
        self.micro_steps = len(chunks)
        factor = norm.weights[self.name] * norm.scale[norm.names.index(self.name)]

        def loss(embeddings: torch.Tensor) -> torch.Tensor:
            self.out = objective.loss(embeddings, batches)
            return self.out.loss_sum * factor

        self.cache = GradCache(lambda m: engine(EmbedPass(objective), chunks[m]), self.micro_steps, loss)

    def begin(self, metrics: StepMetrics) -> None:
        self.cache.cache()
        metrics.add(self.name, self.out)

    def loss(self, m: int, metrics: StepMetrics) -> torch.Tensor:
        return self.cache.surrogate(m)

    def end(self) -> None:
        self.cache.done()


def _micro_steps(engine, passes: list[_Pass], metrics: StepMetrics):
    """Forward, backward and (at the boundary, inside DeepSpeed) the update of each micro-step; the gradients'
    norm where DeepSpeed measures none. The trainer owns the boundary, since a batch warmup
    (``train.batch_warmup``) takes fewer micro-steps than DeepSpeed's ``gradient_accumulation_steps`` (whose
    counter would then also run out of step with ours)."""
    micro_steps, grad_norm = passes[0].micro_steps, None
    for p in passes:
        p.begin(metrics)
    for m in range(micro_steps):
        engine.set_gradient_accumulation_boundary(m == micro_steps - 1)
        engine.backward(sum(p.loss(m, metrics) for p in passes))
        if m == micro_steps - 1:
            grad_norm = _unreported_grad_norm(engine)
        engine.step()
    for p in passes:
        p.end()
    return grad_norm


def train_step(engine, step_objs: list[WeightedObjective], batches: dict[str, list], world: int,
               grad_accum: int, sources: tuple[str, ...] = (), counts: list[list[dict]] | None = None) -> StepResult:
    """One optimizer step over the micro-batches in ``batches`` (by shard kind: ``grad_accum`` of each, or fewer
    while a batch warmup grows the global batch), each loss normalised over the global batch (:func:`_normalised`).
    An objective with ``grad_cache`` (alone in its phase) takes its micro-batches as one contrastive batch.
    ``sources``: the names of the packed shards' sources when their batches carry source ids; each output of a
    packed objective is then also summed per source (its loss over that source's targets in the global batch).
    ``counts``: :func:`target_counts` of the batches' host copies (the trainer's; default: counted here).
    """
    # Nothing here reads the device back (tests/unit/train/test_trainer.py counts the reads): a host sync drains the
    # device's queue, so one before (or inside) the forward would leave it idle while the host launches. The target
    # counts come from the host; the logged numbers leave the device in one non-blocking copy (``StepResult``).
    device = next(engine.module.parameters()).device
    counts = target_counts(step_objs, batches) if counts is None else counts
    norm = _normalised(engine, step_objs, batches, counts, world, grad_accum, device)
    metrics = StepMetrics(norm.names, sources, device)
    for b in batches.get(ShardKind.PACKED, []) if sources else ():
        metrics.add_tokens(b)
    lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves on inside the last step()
    passes = [(_Cached if getattr(o.objective, "grad_cache", False) else _Plain)(
        engine, o, batches[o.objective.shard_kind], per_micro, norm) for o, per_micro in zip(step_objs, counts)]
    grad_norm = _micro_steps(engine, passes, metrics)
    if grad_norm is None:  # None only where the DeepSpeed config turns it off (zero_optimization.compute_grad_norm)
        grad_norm = engine.get_global_grad_norm()
    return metrics.result(norm, grad_norm, lr)
