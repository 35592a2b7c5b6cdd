"""Every evaluation task by name, how it runs (its spec: :data:`pipeline.tasks.SPECS`, in its family module's
order), and their options from ``--set TASK.KEY=VALUE`` overrides."""

from __future__ import annotations

from pipeline.config import ConfigError, apply_overrides, from_dict
from pipeline.eval import embeddings, infilling, intrinsic, probing, repetition
from pipeline.eval.finetune import classification, qa, retrieval, token_classification
from pipeline.eval.task import Task

TASKS: dict[str, Task] = {t.spec.name: t for module in (intrinsic, infilling, repetition, embeddings, probing,
                                                       classification, token_classification, qa, retrieval)
                          for t in module.TASKS}


def task_options(names: list[str], overrides: list[str]) -> dict[str, object]:
    """Typed options of each task in ``names``; an override for an unknown or unselected task is an error."""
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ConfigError(f"unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}")
    data = apply_overrides({}, list(overrides))
    stray = sorted(set(data) - set(names))
    if stray:
        raise ConfigError(f"--set for {stray}, which are not among --tasks {names}")
    return {n: from_dict(TASKS[n].spec.options, data.get(n, {}), n) for n in names}
