"""What the report reads from a run directory (:class:`pipeline.run_dir.RunDir`): the recipe (what was trained, from its experiment),
the loss history (from ``metrics.jsonl``) and the evaluation headline numbers (every ``eval/*.json`` that
``launch/evaluate.py`` wrote)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipeline.eval.data import DataError
from pipeline.eval.results import EvalResults
from pipeline.experiment import ExperimentConfig
from pipeline.io import read_jsonl
from pipeline.model.presets import PRESETS
from pipeline.objectives import OBJECTIVES
from pipeline.run_dir import RunDir


@dataclass(frozen=True)
class Recipe:
    """What a run trained (its grid point is a :class:`pipeline.grid.Variant`): the report groups and plots by it."""

    name: str
    phases: str  # objectives per phase, e.g. "clm -> mlm"
    objectives: frozenset[str]
    clm_share: float  # share of the training budget in CLM phases, the run it continued from included
    mask_ratio: float | None  # masking ratio of the last masked objective (mlm, mntp, magnet); None without one
    scale: str  # preset name matching the model's shape, or "custom"
    steps: int


@dataclass
class RunSummary:
    run_dir: str
    recipe: Recipe
    history: dict[str, dict[int, float]]  # "loss/clm" -> step -> value (a replayed step keeps its last value)
    headline: dict[str, float] = field(default_factory=dict)


def model_scale(run: RunDir, exp: ExperimentConfig) -> str:
    if exp.model.init in PRESETS:
        return exp.model.init
    if exp.model.shape in PRESETS:  # a continued run names its start's preset, which the trainer checked
        return exp.model.shape
    if os.path.isfile(run.model_config_json):
        config = run.model_config()
        shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size)
        for name, p in PRESETS.items():
            if shape == (p.num_layers, p.hidden_size, p.ffn_size):
                return name
    return "custom"


def continued_from(run: RunDir) -> RunDir | None:
    """The run whose HF export this run started from (``model.init: RUN/hf``, as a grid's ``${run:NAME}/hf``): a run
    of its name beside this one (the same directory for a grid's runs; for records of runs, copied together, the
    record, even where a run directory of that path exists again), else that run directory where it is still
    there."""
    init = run.experiment().model.init
    if not init or os.path.basename(os.path.normpath(init)) != "hf":
        return None
    name = os.path.dirname(os.path.normpath(init))
    beside = RunDir(os.path.join(os.path.dirname(os.path.normpath(run.path)), os.path.basename(name)))
    for start in beside, RunDir(name):
        if start.exists():
            return start
    return None


def clm_steps(run: RunDir) -> tuple[float, int]:
    """(steps trained with CLM, steps) over the whole budget: a continued run adds the run it started from, so CLM
    then MLM continued sits at the same CLM share as a switch within one run."""
    exp = run.experiment()
    clm = sum(p.share for p in exp.phases if any(o.name == "clm" for o in p.objectives)) * exp.train.steps
    start = continued_from(run)
    if start is None:
        return clm, exp.train.steps
    before, steps = clm_steps(start)
    return clm + before, exp.train.steps + steps


def recipe_of(run: RunDir, exp: ExperimentConfig) -> Recipe:
    names = [[o.name for o in p.objectives] for p in exp.phases]
    ratio, (clm, steps) = None, clm_steps(run)
    for phase in exp.phases:
        for spec in phase.objectives:
            if OBJECTIVES[spec.name].masks:
                ratio = spec.ratio
    return Recipe(name=exp.name, phases=" -> ".join("+".join(n) for n in names),
                   objectives=frozenset(n for ns in names for n in ns),
                   clm_share=float(clm / steps),
                   mask_ratio=ratio, scale=model_scale(run, exp), steps=exp.train.steps)


def read_history(path: str) -> dict[str, dict[int, float]]:
    history: dict[str, dict[int, float]] = {}
    if not os.path.isfile(path):
        return history
    for _, record in read_jsonl(path, DataError):
        for key, value in record.items():
            if key.startswith("loss/"):
                history.setdefault(key, {})[int(record["step"])] = float(value)
    return history


def load_run(run_dir: str) -> RunSummary:
    run = RunDir(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"{run_dir}: no experiment.json, so not a run directory of launch/train.py")
    summary = RunSummary(run_dir, recipe_of(run, run.experiment()), read_history(run.metrics))
    for path in run.all_eval_results():
        summary.headline.update(EvalResults.read(path).headline)
    return summary
