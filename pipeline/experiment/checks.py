"""Checks across the experiment's sections, run when it loads (each section checks itself: sections.py): the phases
and their objectives against the model and the step, the phases' data against one another, the schedule against
the run's length, and the kept-best metric against what the validation logs."""

from __future__ import annotations

import math

from pipeline.config import ConfigError
from pipeline.data.format.index import ShardKind
from pipeline.experiment.phases import PhaseData
from pipeline.experiment.sections import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PhaseSpec,
    TrainConfig,
    ValidationConfig,
)
from pipeline.tasks import IN_TRAINING, SPECS


def check_phases(phases: list[PhaseSpec], model: ModelConfig, train: TrainConfig) -> None:
    """Each phase and its objectives (against the model's attention dropout and the step's accumulation), and
    shares that sum to 1. Defaults are built without from_dict, so the phases are validated (and named) here."""
    for i, phase in enumerate(phases):
        phase.validate()
        for j, objective in enumerate(phase.objectives):
            objective.check_attention_dropout(model.attention_dropout, f"phases[{i}].objectives[{j}]")
            objective.check_step(train.grad_accum, len(phase.objectives), f"phases[{i}].objectives[{j}]")
            objective.check_schedule(f"phases[{i}].objectives[{j}]")
            objective.check_embedding(f"phases[{i}].objectives[{j}]")
    if not math.isclose(sum(p.share for p in phases), 1.0, abs_tol=1e-6):
        shares = [p.share for p in phases]
        raise ConfigError(f"phases: shares must sum to 1, got {shares} (sum {sum(shares):g}); set each phase's "
                          f"share so they do, e.g. {[round(s / sum(shares), 4) for s in shares]}")


def check_batch_warmup(train: TrainConfig, first_phase: int) -> None:
    """The batch warms up within the first phase (``first_phase``: its steps)."""
    if train.batch_warmup.steps > first_phase:
        raise ConfigError(f"train.batch_warmup.steps: {train.batch_warmup.steps} steps outlast the first "
                          f"phase ({first_phase} steps); set train.batch_warmup.steps={first_phase} or fewer: the "
                          f"batch warms up within it (the loaders of later phases count only the steps they "
                          f"read)")


def check_phase_seq_lens(phases: list[PhaseSpec]) -> None:
    for i, p in enumerate(phases):
        if 0 < p.seq_len < 8:
            raise ConfigError(f"phases[{i}].seq_len: {p.seq_len} is out of range; it must be 0 (data.seq_len) "
                              f"or >= 8")


def check_phase_data(phases_data: tuple[PhaseData, ...], data: DataConfig, train: TrainConfig) -> None:
    """Phases reading one shard directory (one loader, one order) agree on its sequence length and micro-batch:
    data.shards' are data.seq_len and train.micro_batch."""
    batch = {ShardKind.PACKED.value: ("train.micro_batch", train.micro_batch)}
    length = {ShardKind.PACKED.value: ("data.seq_len", data.seq_len)}
    for i, pd in enumerate(phases_data):
        key, seq_len = length.setdefault(pd.loader, (f"phases[{i}].seq_len", pd.seq_len))
        if seq_len != pd.seq_len:
            raise ConfigError(f"phases[{i}].seq_len: {pd.seq_len}, but its shards {pd.shards} are read at "
                              f"{key} {seq_len}; a shard directory holds one sequence length, so name shards "
                              f"built at {pd.seq_len} in phases[{i}].shards")
        key, micro = batch.setdefault(pd.loader, (f"phases[{i}].micro_batch", pd.micro_batch))
        if micro != pd.micro_batch:
            raise ConfigError(f"phases[{i}].micro_batch: {pd.micro_batch}, but {pd.shards} is read with "
                              f"{key} {micro}; phases reading one shard directory continue one order at one "
                              f"micro-batch, so set phases[{i}].micro_batch={micro} (or give the phase its own "
                              f"shards)")


def check_schedule_fits(optim: OptimConfig, steps: int) -> None:
    """The warmup and the decay fit in the run's ``steps``."""
    warmup, decay = optim.warmup(steps), optim.decay(steps)
    if warmup + decay <= steps:
        return
    fixed = [f"optim.{k}={v}" for k, v in (("warmup_steps", optim.warmup_steps), ("decay_steps", optim.decay_steps))
             if v is not None and (k == "warmup_steps" or optim.schedule == "wsd")]
    if not fixed:
        raise ConfigError(f"optim: warmup_ratio + decay_ratio ({optim.warmup_ratio:g} + {optim.decay_ratio:g}) "
                          f"exceed 1 (the whole run); lower them, e.g. optim.warmup_ratio=0.1 optim.decay_ratio=0.2")
    raise ConfigError(f"optim: {warmup} warmup + {decay} decay steps ({' '.join(fixed)}) exceed train.steps "
                      f"({steps}); lower them, or leave them unset to take fractions of the run "
                      f"(optim.warmup_ratio={optim.warmup_ratio:g}, optim.decay_ratio={optim.decay_ratio:g})")


# the validation's own scalars (pipeline.train.validation)
VALIDATION_METRICS = {"loss/": "min", "acc/": "max", "probe/": "min", "probe_acc/": "max", "probe_ppl/": "min",
                      "source_loss/": "min", "source_probe/": "min"}


def metric_mode(metric: str, tasks: list[str]) -> str | None:
    """"max" or "min": which way ``metric`` (``eval/...``) improves, when the validation or one of the evaluator
    ``tasks`` logs it (as ``eval/<headline key>``, each task's spec: pipeline.tasks); None for a name none of them
    logs."""
    key = metric.removeprefix("eval/")
    if key == metric:
        return None
    known = VALIDATION_METRICS | {k: h.better for t in tasks if t in IN_TRAINING for k, h in SPECS[t].keys.items()}
    return next((mode for prefix, mode in known.items() if key.startswith(prefix)), None)


def keep_best_mode(c: CheckpointConfig, v: ValidationConfig) -> str:
    """"max" or "min" for ``checkpoint.keep_best`` (its mode, or derived by :func:`metric_mode`); a ConfigError
    when the metric is not measured at a step that has a checkpoint."""
    metric = c.keep_best
    if not v.every:
        raise ConfigError(f"checkpoint.keep_best: {metric} is measured by the validation; set eval.every (a "
                          f"multiple of checkpoint.every, {c.every}) and eval.holdout or eval.shards")
    if v.every % c.every:
        raise ConfigError(f"checkpoint.keep_best: eval.every {v.every} is not a multiple of checkpoint.every "
                          f"{c.every}, so a best step could have no checkpoint; set eval.every to a multiple, "
                          f"e.g. eval.every={c.every * max(1, round(v.every / c.every))}")
    derived = metric_mode(metric, [e.task for e in v.evaluators])
    if not metric.startswith("eval/") or (derived is None and c.keep_best_mode == "auto"):
        tasks = [e.task for e in v.evaluators]
        names = [f"eval/{k}..." for k in [*VALIDATION_METRICS, *(k for t in tasks for k in SPECS[t].keys)]]
        raise ConfigError(f"checkpoint.keep_best: {metric!r} is not a validation scalar this run logs; name one "
                          f"of {names} (eval.evaluators add theirs), or set checkpoint.keep_best_mode to max "
                          f"or min for another eval/ name")
    return derived if c.keep_best_mode == "auto" else c.keep_best_mode
