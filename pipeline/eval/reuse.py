"""Evaluate only what a results file lacks: the tasks ``out`` has no results of run on the model and merged into it
(its finished tasks kept as they were, so a re-run evaluates only what is missing, e.g. a task a study gained), and
a task that another results file of the same model holds with the same options copied from it instead of run again
(``make reproduce``: studies 1 and 3 both read STS; the copy names its file in ``reused``)."""

from __future__ import annotations

import os
from dataclasses import asdict, replace

from pipeline.eval.config import EvalConfig
from pipeline.eval.registry import task_options
from pipeline.eval.results import EvalResults
from pipeline.eval.runner import evaluate


def missing_tasks(out: str, tasks: list[str]) -> list[str]:
    """``tasks`` that the results file ``out`` has no results of (all of them without ``out``)."""
    before = EvalResults.read(out) if os.path.isfile(out) else None
    return [t for t in tasks if not before or t not in before.results]


def evaluated_elsewhere(config: EvalConfig, root: str, paths: list[str], out: str
                        ) -> dict[str, tuple[str, EvalResults]]:
    """Task -> (results file, its contents) for each of ``config``'s tasks that a results file in ``paths`` (not
    ``out``) has for the same model, attention, data and batch size with the options ``config`` would run (its
    config compared as written: a field an older file lacks differs)."""
    wanted = {t: asdict(o) for t, o in task_options(config.tasks, config.overrides).items()}
    same = {k: v for k, v in asdict(config.recorded(root)).items() if k not in ("tasks", "overrides", "progress")}
    found: dict[str, tuple[str, EvalResults]] = {}
    for path in sorted(p for p in paths if os.path.abspath(p) != os.path.abspath(out)):
        other = EvalResults.read(path)
        written = other.to_json()["config"]
        if {k: written.get(k) for k in same} != same:
            continue
        for task, options in wanted.items():
            if task not in found and task in other.results and other.options.get(task) == options:
                found[task] = (path, other)
    return found


def evaluate_missing(config: EvalConfig, out: str, siblings: list[str], root: str) -> None:
    """``config``'s tasks that ``out`` lacks, each copied from a results file of ``siblings`` that has it
    (:func:`evaluated_elsewhere`) or else evaluated, merged into ``out`` in ``config``'s task order and written
    when a task finished (paths relative to the results root ``root``); a failed task is an error, raised after
    the finished ones are written."""
    before = EvalResults.read(out) if os.path.isfile(out) else None
    tasks = missing_tasks(out, config.tasks)
    missing = replace(config, tasks=tasks, overrides=[o for o in config.overrides if o.split(".", 1)[0] in tasks])
    reused = evaluated_elsewhere(missing, root, siblings, out)
    run = [t for t in tasks if t not in reused]
    missing = replace(missing, tasks=run, overrides=[o for o in missing.overrides if o.split(".", 1)[0] in run])
    if run:
        results = evaluate(missing, root)
    else:  # every task is another file's: its model and environment, as that file wrote them
        other = next(iter(reused.values()))[1]
        results = EvalResults(missing.recorded(root), other.model, other.environment,
                              unwritten=tuple(k for k in other.unwritten if k.startswith("model.")))
    for task, (path, other) in reused.items():
        print(f"{task}: the results of {path} (the same model and options)")
        results.with_task_of(other, task, os.path.basename(path))
    results = results.merge(before, config.tasks)
    if results.write(out):
        print(f"wrote {out}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.headline.items()))
    if results.failed or not results.results:
        raise RuntimeError("; ".join(results.failure_lines()) or "no task finished")
