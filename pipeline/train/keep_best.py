"""``checkpoint.keep_best`` decided once, in preflight, against what the run's validations log phase by phase: the
losses of each phase's objectives that read packed samples and the probes (:func:`pipeline.train.validation.logged`),
each held-out source's with several, and the evaluators' headline scores (:func:`pipeline.train.evaluators.logged`).

A metric no phase logs is a config error; one some phases do not log (``eval/loss/clm`` of a CLM -> MLM run) is
chosen among the steps of the phases that log it, and preflight says so in one line. Before, the first validation
of such a phase stopped the run, before that step's checkpoint, so every resume stopped there again. A score a
validation may leave out (the repetition evaluator's, when no continuation was long enough; a source's, when none
of its samples was scored) makes that step no candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.experiment import ExperimentConfig
from pipeline.train import evaluators, validation
from pipeline.train.phases import WeightedObjective


@dataclass(frozen=True)
class KeepBest:
    """The metric the best checkpoint is chosen by, which way is better, and the phases whose validations log it."""

    metric: str
    mode: str  # "max" | "min"
    phases: tuple[int, ...]
    sometimes: bool = False  # a validation may leave it out (nothing to score): that step is then no candidate


def keep_best(exp: ExperimentConfig, objectives: tuple[tuple[WeightedObjective, ...], ...],
              probes: tuple[WeightedObjective, ...], sources: tuple[str, ...]) -> tuple[KeepBest | None, list[str]]:
    """The run's :class:`KeepBest` (None without ``checkpoint.keep_best``) and the note naming the phases that do
    not log it; a ConfigError when none does. ``sources``: the held-out shards' sources."""
    metric = exp.checkpoint.keep_best
    if not metric:
        return None, []
    mode = exp.keep_best_mode()
    by_evaluators = evaluators.logged(exp.eval.evaluators)
    phases, sometimes, logs = [], False, set()
    for i, phase in enumerate(objectives):
        always, maybe = (a | b for a, b in zip(validation.logged(list(phase), list(probes), sources), by_evaluators))
        logs |= always
        if metric in always | maybe:
            phases.append(i)
            sometimes |= metric not in always
    if not phases:
        raise ConfigError(f"checkpoint.keep_best: no phase's validation logs {metric}; name one they log, e.g. "
                          f"{', '.join(sorted(logs))}")
    notes = []
    if len(phases) < len(objectives):
        unlogged = [f"phases[{i}] ({exp.phases[i].name})" for i in range(len(objectives)) if i not in phases]
        notes.append(f"note: checkpoint.keep_best: {metric} is not logged in {', '.join(unlogged)}; the best "
                     f"checkpoint is chosen among the steps of {', '.join(f'phases[{i}]' for i in phases)}")
    return KeepBest(metric, mode, tuple(phases), sometimes), notes
