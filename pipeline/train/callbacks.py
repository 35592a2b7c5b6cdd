"""What :meth:`~pipeline.train.trainer.Trainer.fit` does around each step, as callbacks with one small interface:
the stop verdict, validation, the evaluators, the step's record (metrics.jsonl, trackers, console), the divergence
guard, keep-best and checkpoint/stop.

The hooks are OLMo-core's, fewer, called in its order: :meth:`Callback.pre_train` once; per step, once its work is
queued on the device, :meth:`Callback.log_metrics` for the previous step when its numbers were left to be read while
this one runs, then :meth:`Callback.post_step`; :meth:`Callback.post_train` after the loop. Every hook runs over the
callbacks by priority, highest first (OLMo-core's rule), so one order holds for all of them, and it is the order
of effects the run depends on: the stop verdict before anything reads the step; the step's numbers read before a
validation (its time is the step's alone) and the validation's numbers joined to its record; the record written
before the guard may raise; keep-best observing before the step's checkpoint, which spares the best; a checkpoint
only on the guard's good verdict on the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import deepspeed
import torch
import torch.distributed as dist

from pipeline.train.checkpoint import Checkpointer
from pipeline.train.evaluators import TrainingEvaluators
from pipeline.train.guard import DivergenceGuard
from pipeline.train.metrics import MetricsLogger
from pipeline.train.phases import WeightedObjective
from pipeline.train.plan import RunPlan
from pipeline.train.signals import StopRequest
from pipeline.train.state import TrainState
from pipeline.train.step import StepResult
from pipeline.train.validation import Validator


@dataclass(frozen=True)
class Unread:
    """A trained step whose numbers the host has not read yet, and what its metrics record needs besides them."""

    step: int
    phase_idx: int
    phase: str
    result: StepResult
    tokens: int
    started: float  # time.time() at the step's start
    data_seconds: float
    skipped_steps: int  # DeepSpeed's count after the step
    tokens_seen: int
    host: dict[str, float]  # its scalars known on the host (batch sizes, sequence length, masking ratios)


@dataclass
class StepEnd:
    """The newest step as :meth:`Callback.post_step` decides about it, callback by callback."""

    trained: Unread
    signalled: bool = False  # a stop signal on some rank
    stopping: bool = False  # the run stops at this step (a signal, or train.stop_at_step)
    due: bool = False  # a checkpoint is due, or the last step is done
    scalars: dict[str, float] | None = None  # its record once read now (None: read while the next step runs)


class Fit(Protocol):
    """What callbacks see of the trainer (:class:`~pipeline.train.trainer.Trainer`)."""

    plan: RunPlan
    engine: deepspeed.DeepSpeedEngine
    lm: torch.nn.Module
    objectives: Sequence[Sequence[WeightedObjective]]
    state: TrainState
    checkpoints: Checkpointer
    metrics: MetricsLogger
    guard: DivergenceGuard
    stop: StopRequest
    device: torch.device

    def read(self, end: StepEnd) -> dict[str, float]:
        """The step's record, read now (once) instead of while the next step runs."""

    def log(self, s: Unread, scalars: dict[str, float]) -> None:
        """Step ``s``'s record to every callback's :meth:`Callback.log_metrics`."""


class Callback:
    """One of fit's concerns; a hook it does not need does nothing."""

    priority: ClassVar[int] = 0  # higher runs earlier, in every hook

    def pre_train(self, fit: Fit) -> None:
        """Before the first step."""

    def log_metrics(self, fit: Fit, s: Unread, scalars: dict[str, float]) -> None:
        """Step ``s``'s record is complete: the previous step's, or the newest one's when it was read now."""

    def post_step(self, fit: Fit, end: StepEnd) -> None:
        """After the step (and the previous one's record)."""

    def post_train(self, fit: Fit) -> None:
        """After the loop, before the exports and the summary."""


class StopCheck(Callback):
    """The stop verdict on the step, agreed over the ranks (a collective at every step), and whether a checkpoint
    is due."""

    priority = 100

    def pre_train(self, fit: Fit) -> None:
        fit.stop.training_started()  # a signal from now on checkpoints, then stops

    def post_step(self, fit: Fit, end: StepEnd) -> None:
        step = end.trained.step
        end.signalled = fit.stop.agreed()
        end.stopping = end.signalled or step == fit.plan.stop_at_step
        end.due = fit.plan.checkpoint_due(step)


@dataclass
class Validation(Callback):
    """The held-out evaluation when due; its numbers join the step's record."""

    validator: Validator
    priority: ClassVar[int] = 90

    def post_step(self, fit: Fit, end: StepEnd) -> None:
        if fit.plan.validating(end.trained.step):
            objectives = fit.objectives[end.trained.phase_idx]
            fit.read(end).update(self.validator.run(fit.engine, objectives, fit.device))


@dataclass
class Evaluation(Callback):
    """The evaluation tasks beside each validation; their scores join the step's record."""

    evaluators: TrainingEvaluators
    priority: ClassVar[int] = 80

    def post_step(self, fit: Fit, end: StepEnd) -> None:
        step = end.trained.step
        if fit.plan.validating(step):
            fit.read(end).update(self.evaluators.run(fit.engine, fit.lm, step, fit.device))


class Record(Callback):
    """The step's record (:class:`~pipeline.train.metrics.MetricsLogger`: the trackers, metrics.jsonl, the console
    line). A step is read now when it stops the run, is due a checkpoint (both need the guard's verdict on it) or
    was validated; any other is read while the next step runs."""

    priority = 70

    def post_step(self, fit: Fit, end: StepEnd) -> None:
        if end.stopping or end.due or fit.plan.validating(end.trained.step):
            fit.log(end.trained, fit.read(end))

    def log_metrics(self, fit: Fit, s: Unread, scalars: dict[str, float]) -> None:
        fit.metrics.log(s.step, scalars, s.phase)


class Guard(Callback):
    """The divergence guard counts each recorded step and raises :class:`~pipeline.train.guard.Diverged` after the
    step's record is written."""

    priority = 60

    def log_metrics(self, fit: Fit, s: Unread, scalars: dict[str, float]) -> None:
        losses, grad_norm = s.result.losses, s.result.grad_norm
        fit.guard.count(losses, grad_norm, s.skipped_steps)
        fit.guard.check(s.step, losses, grad_norm, fit.checkpoints.last_good)


class KeepBest(Callback):
    """``checkpoint.keep_best``: a healthy validated step's metric, observed before the step's checkpoint, which then
    spares the best."""

    priority = 50

    def log_metrics(self, fit: Fit, s: Unread, scalars: dict[str, float]) -> None:
        if fit.plan.validating(s.step) and fit.guard.healthy:
            fit.checkpoints.observe(s.step, s.phase_idx, scalars)


class Checkpoint(Callback):
    """A checkpoint when one is due or the run stops and the newest step is good; the stop's line; the last
    checkpoint after the loop."""

    priority = 40

    def post_step(self, fit: Fit, end: StepEnd) -> None:
        checkpoints, step = fit.checkpoints, end.trained.step
        if fit.guard.healthy and (end.due or end.stopping):
            checkpoints.save(fit.state)
        if not end.stopping:
            return
        checkpoints.wait()
        if dist.get_rank() == 0:
            why = f" on {fit.stop.reason or 'the stop request of another rank'}" if end.signalled else ""
            saved = ("checkpointed" if checkpoints.last_saved == step else
                     f"not checkpointed: the newest step was bad; the last good checkpoint is "
                     f"{checkpoints.last_good()}")
            print(f"stopped at step {step} ({saved}){why}; start the same command again to resume", flush=True)

    def post_train(self, fit: Fit) -> None:
        if fit.checkpoints.last_saved != fit.state.step and fit.guard.healthy:
            fit.checkpoints.save(fit.state)
        fit.checkpoints.wait()


def fit_callbacks(validator: Validator | None, evaluators: TrainingEvaluators | None) -> list[Callback]:
    """The run's callbacks in the order they run: validation and the evaluators only where the run has them."""
    parts: list[Callback] = [StopCheck(), Record(), Guard(), KeepBest(), Checkpoint()]
    parts += [Validation(validator)] if validator is not None else []
    parts += [Evaluation(evaluators)] if evaluators is not None else []
    return sorted(parts, key=lambda c: -c.priority)
