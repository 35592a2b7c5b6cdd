"""The run's plan, decided once from the experiment in preflight: where each phase starts and what it reads, and at
which steps the trainer logs, validates, checkpoints, stops and exports. The trainer's loop reads the plan, never
the experiment, so what a step does is a function of the step and the plan alone (a resume lands where it left)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.experiment import CheckpointConfig, ExperimentConfig, phase_at

if TYPE_CHECKING:  # the decision's module imports the evaluators, which the plan does not need
    from pipeline.train.keep_best import KeepBest


@dataclass(frozen=True)
class PhasePlan:
    """One phase as the loop runs it: its steps, the loader of its packed samples and its RoPE settings."""

    name: str
    start: int  # its first global step
    steps: int  # its optimizer steps
    loader: str  # the loader of its packed samples (PhaseData.loader: "packed", or its own shards' key)
    seq_len: int
    rope_theta: float | None  # the latest rope_theta of this and the earlier phases (None: the start model's)
    context: int  # the longest seq_len of this and the earlier phases


@dataclass(frozen=True)
class RunPlan:
    """The run's steps and cadences; 0 turns a cadence off (``validate_every``, ``stop_at_step``)."""

    steps: int
    phases: tuple[PhasePlan, ...]
    seed: int
    grad_accum: int
    log_every: int
    validate_every: int  # validation and the evaluators beside it, and one at the last step
    checkpoint_every: int  # and one at the last step
    stop_at_step: int
    max_bad_steps: int  # the divergence guard's limit
    peak_tflops: float  # per device, for MFU (0: look the device up)
    export_hf: bool
    export_sentence_transformers: bool
    keep_best: str  # the metric the best checkpoint is chosen by ("": none)
    run_dir: str
    model: str  # model.init, as the first line names it

    def phase_at(self, step: int) -> int:
        """The phase of the global ``step`` (from 0)."""
        return phase_at([p.start for p in self.phases], step)

    def validating(self, step: int) -> bool:
        return bool(self.validate_every) and (step % self.validate_every == 0 or step == self.steps)

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.steps


@dataclass(frozen=True)
class CheckpointSpec:
    """How the run keeps checkpoints (``checkpoint``; when it takes them is the plan's ``checkpoint_due``)."""

    keep_last: int
    keep_every: int
    async_save: bool
    keep: KeepBest | None = None  # checkpoint.keep_best against what each phase logs (None: none)


def checkpoint_spec(cfg: CheckpointConfig, keep: KeepBest | None = None) -> CheckpointSpec:
    return CheckpointSpec(cfg.keep_last, cfg.keep_every, cfg.async_save, keep)


def run_plan(exp: ExperimentConfig) -> RunPlan:
    t, data = exp.train, exp.phases_data
    phases = tuple(PhasePlan(p.name, start, steps, d.loader, d.seq_len, d.rope_theta, d.context)
                   for p, start, steps, d in zip(exp.phases, exp.phase_starts(), exp.phase_lengths(), data))
    return RunPlan(t.steps, phases, t.seed, t.grad_accum, t.log_every, exp.eval.every, exp.checkpoint.every,
                   t.stop_at_step, t.max_bad_steps, t.peak_tflops, t.export_hf, t.export_sentence_transformers,
                   exp.checkpoint.keep_best, exp.run_dir, exp.model.init)
