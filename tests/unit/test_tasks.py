"""Every evaluation task is described once and completely (pipeline/tasks.py): every registered task has a TaskSpec
with every fact its readers take (the experiment config, the training logs, the report's plots, the card's
model-index), and a real result of each task is read by them as its spec says (:func:`check_against_spec`, which
tests/unit/eval/test_eval_tasks.py's ``run_task`` applies to every result). A task added with a fact forgotten fails
here."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from pipeline.config import ConfigError, from_dict
from pipeline.eval.registry import TASKS
from pipeline.eval.report.plots import log_scale, unit
from pipeline.experiment import VALIDATION_METRICS, EvaluatorConfig, metric_mode
from pipeline.export.model_index import task_results
from pipeline.tasks import IN_TRAINING, SPECS
from pipeline.train.metrics import EVALUATOR_SCALARS

TASK_TESTS = os.path.join(os.path.dirname(__file__), "eval", "test_eval_tasks.py")


def _named(key: str) -> str:
    """A headline number a declared key stands for: the key, or a dataset's number under a prefix."""
    return key + "a-dataset" if key.endswith(("/", "_")) else key


def test_every_registered_task_has_a_complete_spec():
    assert list(SPECS) and set(TASKS) == set(SPECS), "register each spec's run in pipeline/eval (registry.TASKS)"
    for name, spec in SPECS.items():
        assert TASKS[name].spec is spec and spec.name == name
        assert spec.family and spec.description and spec.keys and spec.hub.task_type and spec.hub.task_name, name
        assert dataclasses.is_dataclass(spec.options), f"{name}: options must be a dataclass"
        from_dict(spec.options, {}, name)  # every option has a default: --tasks NAME alone runs it
        assert all(h.better in ("max", "min") and h.unit != "" for h in spec.keys.values()), name
        assert isinstance(spec.in_training, bool)
        if spec.in_training:  # eval.evaluators[i].datasets become its options' datasets
            assert "datasets" in {f.name for f in dataclasses.fields(spec.options)}, name
    declared = [k for spec in SPECS.values() for k in spec.keys]
    logged = [k for spec in SPECS.values() if spec.in_training for k in spec.keys]
    # each headline number falls under one declaration, and a score logged in training under no validation scalar's
    clashes = [(a, b) for a in declared for b in declared if a != b and b.startswith(a)]
    clashes += [(a, b) for a in logged for b in VALIDATION_METRICS if a.startswith(b) or b.startswith(a)]
    assert clashes == [] and len(declared) == len(set(declared))


def test_the_experiment_the_training_logs_and_the_plots_read_every_spec():
    for name, spec in SPECS.items():
        config = EvaluatorConfig(name, datasets=["a.tsv"])
        if spec.in_training:
            config.check("eval.evaluators[0]")
            assert config.task_options("eval.evaluators[0]").datasets == ["a.tsv"]
        else:
            with pytest.raises(ConfigError, match=f"'{name}' does not run during training; choose one of"):
                config.check("eval.evaluators[0]")
        for key, declared in spec.keys.items():
            number = _named(key)
            assert metric_mode(f"eval/{number}", [name]) == (declared.better if spec.in_training else None)
            assert f"eval/{number}".startswith(EVALUATOR_SCALARS) == spec.in_training
            assert (unit(number), log_scale(number)) == (declared.unit or number, declared.log)
    assert list(IN_TRAINING) == [n for n, s in SPECS.items() if s.in_training]


def check_against_spec(name: str, result: dict, split: str | None) -> None:
    """A real ``result`` of task ``name`` as its spec's readers take it: each headline number falls under one of
    the spec's keys (its direction, its plot axis), and the card's model-index lists the result under the spec's
    Hub labels."""
    spec = SPECS[name]
    headline = spec.headline(result)
    assert all(isinstance(v, float) and spec.key(k) for k, v in headline.items()), (name, headline, list(spec.keys))
    entries = task_results(name, result, split)
    assert entries and {(e.task_type, e.task_name) for e in entries} == {(spec.hub.task_type, spec.hub.task_name)}


def test_every_task_runs_in_a_test_that_checks_its_result_against_its_spec():
    """test_eval_tasks.py's ``run_task`` passes each result to :func:`check_against_spec`: every task goes through
    it (a task name given to ``run_task``, or the values of the parametrized argument given to it)."""
    ran = set()
    for test in ast.walk(ast.parse(open(TASK_TESTS).read(), TASK_TESTS)):
        if not isinstance(test, ast.FunctionDef):
            continue
        params = {d.args[0].value: d.args[1] for d in test.decorator_list
                  if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize"}
        for call in ast.walk(test):
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "run_task":
                arg = call.args[0]
                ran |= ({arg.value} if isinstance(arg, ast.Constant)
                        else set(ast.literal_eval(params[arg.id])) if arg.id in params else set())
    assert sorted(set(SPECS) - ran) == [], "run each task through run_task in tests/unit/eval/test_eval_tasks.py"
