"""Which samples go into which micro-batch: pure index arithmetic, no I/O.

The training order is one global sequence per epoch, a seeded permutation of all sample ids, cut into global
batches of ``micro_batch * grad_accum * dp_world`` samples (fewer while a batch warmup grows them, in whole
micro-batches of every rank); the epoch's remainder is dropped so that every rank gets the same number of
micro-batches. Because every position is computed, not replayed, resuming at any global
sample costs nothing and does not depend on the number of ranks or dataloader workers.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipeline.data.loading.mixture import MixturePlan, SourceSamples
from pipeline.data.loading.permutation import MAX_POSITION, permute


@dataclass(frozen=True)
class BatchWarmup:
    """The global batch while it warms up, counted in global micro-batches (those of all ranks together): ``start``
    of the ``full`` batch at step 0, growing linearly to all of it at step ``steps``, rounded down to whole
    ``granule``s (at least one). A function of the step alone: the same on every world size with the same ``full``
    and ``granule``, which is what keeps the global order the same on another world size."""

    full: int
    start: float
    steps: int
    granule: int

    def micro_batches(self, step: int) -> int:
        if step >= self.steps:
            return self.full
        share = self.start + (1.0 - self.start) * step / self.steps
        return max(self.granule, self.granule * math.floor(round(share * self.full / self.granule, 6)))


@dataclass(frozen=True)
class StepPlace:
    """Where optimizer step ``step`` lies: its first micro-batch in a rank's stream, its epoch and the position in
    that epoch's order of its global batch's first sample."""

    step: int
    first_micro: int
    epoch: int
    offset: int


@dataclass(frozen=True)
class TrainOrder:
    """Rank ``dp_rank``'s endless micro-batch sequence from optimizer step ``first_step``, whose global batch starts
    ``first_offset`` samples into epoch ``first_epoch``. Each step's global batch is the next ``G`` positions of the
    epoch's order (``G = micro_batch x grad_accum x dp_world``, or less while ``warmup`` grows it); a step that would
    run past the epoch's end starts the next epoch instead (the remainder is dropped). Rank r takes the contiguous
    ``r``-th ``1/dp_world`` of it, cut into micro-batches of ``micro_batch``. The order permutes [0, num_samples),
    which are the sample ids themselves, or with ``ids`` (``num_samples`` of them: the training samples of a
    directory whose held-out ones are not its last, ``holdout.Holdout.train``) indexes into them."""

    num_samples: int
    seed: int
    micro_batch: int
    grad_accum: int
    dp_rank: int
    dp_world: int
    first_step: int = 0
    first_epoch: int = 0
    first_offset: int = 0
    ids: SourceSamples | None = None
    warmup: BatchWarmup | None = None

    @property
    def num_batches(self) -> None:
        return None  # endless: epochs follow each other

    @property
    def global_batch(self) -> int:
        """Samples of a full (warmed-up) optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.dp_world

    @property
    def epoch_length(self) -> int:
        return self.num_samples

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch."""
        return self.epoch_length // self.global_batch

    def micro_steps(self, step: int) -> int:
        """Micro-batches of each rank in optimizer step ``step``."""
        return self.grad_accum if self.warmup is None else self.warmup.micro_batches(step) // self.dp_world

    def samples(self, step: int) -> int:
        """The global batch of optimizer step ``step``, in samples."""
        return self.micro_steps(step) * self.micro_batch * self.dp_world

    @cached_property
    def _warm(self) -> list[StepPlace]:
        """The places of the steps from ``first_step`` to the first one with the full batch (walked once: only the
        warmup's batches vary)."""
        places, micro, epoch, offset = [], 0, self.first_epoch, self.first_offset
        for step in range(self.first_step, max(self.first_step, self.warmup.steps if self.warmup else 0) + 1):
            if offset + self.samples(step) > self.epoch_length:
                epoch, offset = epoch + 1, 0
            places.append(StepPlace(step, micro, epoch, offset))
            micro, offset = micro + self.micro_steps(step), offset + self.samples(step)
        return places

    @cached_property
    def _warm_starts(self) -> list[int]:
        return [p.first_micro for p in self._warm]

    def place(self, step: int) -> StepPlace:
        """Where optimizer step ``step`` (>= ``first_step``) lies."""
        warm = self._warm
        if step <= warm[-1].step:
            return warm[step - self.first_step]
        last, size = warm[-1], self.global_batch  # from the last warm step on, every batch is full
        n = step - last.step
        left = (self.epoch_length - last.offset) // size  # full batches from last.offset to the epoch's end
        epoch, offset = ((last.epoch, last.offset + n * size) if n < left else
                         (last.epoch + 1 + (n - left) // self.steps_per_epoch, (n - left) % self.steps_per_epoch * size))
        return StepPlace(step, last.first_micro + n * self.grad_accum, epoch, offset)

    def locate(self, j: int) -> tuple[StepPlace, int]:
        """The step of this rank's ``j``-th micro-batch counted from ``first_step``, and its index in the step."""
        warm = self._warm
        if j >= warm[-1].first_micro:
            n, micro = divmod(j - warm[-1].first_micro, self.grad_accum)
            return self.place(warm[-1].step + n), micro
        i = bisect.bisect_right(self._warm_starts, j) - 1
        return warm[i], j - warm[i].first_micro

    def sample_ids(self, j: int) -> np.ndarray:
        """Global sample ids of this rank's ``j``-th micro-batch counted from ``first_step``."""
        place, micro = self.locate(j)
        first = (self.dp_rank * self.micro_steps(place.step) + micro) * self.micro_batch
        return self._rows(place, np.arange(first, first + self.micro_batch))

    def _rows(self, place: StepPlace, within: np.ndarray) -> np.ndarray:
        """The sample ids of rows ``within`` (positions inside the step's global batch) of the step at ``place``."""
        return self._at(place.offset + within, place.epoch)

    def _at(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        order = permute(positions, self.num_samples, self.seed, epoch)
        return order if self.ids is None else self.ids.global_ids(order)


@dataclass(frozen=True)
class MixtureOrder(TrainOrder):
    """:class:`TrainOrder` over a source mixture (``pipeline.data.loading.mixture``): one endless epoch whose positions
    ``plan`` maps to sample ids; batches and ranks slice the positions as in :class:`TrainOrder`. The sources'
    own epochs live inside the plan."""

    plan: MixturePlan | None = None

    @property
    def epoch_length(self) -> int:
        return MAX_POSITION

    def _at(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        return self.plan.sample_ids(positions)


@dataclass(frozen=True)
class SameTaskOrder(MixtureOrder):
    """:class:`MixtureOrder` whose every global batch comes from one source of the plan (a task of
    ``data.pair_mixture``; FlagEmbedding's ``same_dataset_within_batch``): the plan routes optimizer steps, not
    samples, so the sequence of batch tasks follows the ratios (every prefix of steps within about one batch per
    tree level) and is a function of the step alone. A step of task t takes the next rows of t's own order (its
    repetitions and seeded permutations, as the mixture's): the rows after those of t's earlier steps. Ranks cut a
    step's rows as :class:`TrainOrder` does, so all ranks' rows of a step share its task, and 1 or N ranks read the
    same global batches; a batch warmup's smaller steps are counted exactly."""

    def task_of(self, step: int) -> tuple[int, int]:
        """(the task of optimizer step ``step``, an index into ``plan.names``; the position in that task's own order
        of the step's first row)."""
        task, k = (int(x[0]) for x in self.plan.locate(np.array([step])))
        tasks, starts, totals, counts = self._warm_tasks
        if step < len(tasks):
            return task, int(starts[step])
        return task, int(totals[task] + (k - counts[task]) * self.global_batch)

    @cached_property
    def _warm_tasks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The steps of a batch warmup (whose batches are smaller): each one's task and its first row's position
        in that task's order; each task's rows and steps over the warmup."""
        steps = np.arange(self.warmup.steps if self.warmup else 0)
        tasks = self.plan.locate(steps)[0]
        starts, totals = np.zeros(len(steps), dtype=np.int64), np.zeros(len(self.plan.names), dtype=np.int64)
        for step, task in zip(steps, tasks):
            starts[step], totals[task] = totals[task], totals[task] + self.samples(int(step))
        return tasks, starts, totals, np.bincount(tasks, minlength=len(self.plan.names))

    def _rows(self, place: StepPlace, within: np.ndarray) -> np.ndarray:
        task, first = self.task_of(place.step)
        return self.plan.source_ids(task, first + within)


@dataclass(frozen=True)
class EvalOrder:
    """Samples ``first`` .. ``first + num_samples - 1`` once each, in stored order. Round t covers [t*M*W, (t+1)*M*W)
    of them and rank r takes the r-th slice of M, so all ranks get the same number of micro-batches (ZeRO-3's
    forward is a collective). Slots past the last sample are -1: the loader fills them with padding rows, so every
    micro-batch has M rows. With ``ids`` (``num_samples`` sample ids, ascending) slot i is ``ids[i]`` instead of
    ``first + i``: a held-out set that is not one range (``holdout.Holdout.scored``)."""

    num_samples: int
    micro_batch: int
    dp_rank: int
    dp_world: int
    first: int = 0
    ids: np.ndarray | None = None

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // (self.micro_batch * self.dp_world))

    def sample_ids(self, j: int) -> np.ndarray:
        ids = np.arange(self.micro_batch) + (j * self.dp_world + self.dp_rank) * self.micro_batch
        inside = ids < self.num_samples
        if self.ids is not None:
            return np.where(inside, self.ids[np.where(inside, ids, 0)], -1)
        return np.where(inside, ids + self.first, -1)
