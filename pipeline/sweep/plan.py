"""A sweep resolved: the request (the command line's options), the grid's selected runs with their states, written
as run directories (``experiment.yaml`` and ``job.sbatch``), in dependency order; then submitted (the SLURM backend,
:mod:`pipeline.sweep.slurm`) or trained here (the local backend, :mod:`pipeline.sweep.local`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Literal

import yaml

from pipeline.config import ConfigError, load_yaml, parse_overrides, to_dict
from pipeline.grid import SMOKE_SUFFIX, Grid, Variant, load_grid
from pipeline.inputs import check_buildable, under
from pipeline.io import REPO, repo_relative
from pipeline.sweep.local import run_local
from pipeline.sweep.slurm import job_script, queued_jobs, submit_all
from pipeline.sweep.status import RunState, run_dir, run_states, table
from pipeline.tokenizer import check_tokenizer_path

RESIZABLE = {"train.grad_accum"}  # may change for a started run: other resources, same global batch


def select(variants: list[Variant], patterns: list[str]) -> list[Variant]:
    """The variants whose names (a twin's also without ``-smoke``) match any of the shell-style ``patterns`` (all
    without patterns); a pattern that matches nothing is an error listing the names."""
    from fnmatch import fnmatchcase

    def matches(v: Variant, pattern: str) -> bool:
        return fnmatchcase(v.name, pattern) or fnmatchcase(v.name.removesuffix(SMOKE_SUFFIX), pattern)

    unmatched = [p for p in patterns if not any(matches(v, p) for v in variants)]
    if unmatched:
        raise ConfigError(f"--only {unmatched}: no variant of this grid matches; its variants: "
                          f"{[v.name for v in variants]}")
    return [v for v in variants if not patterns or any(matches(v, p) for p in patterns)]


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): obj}


def recorded(obj):
    """An experiment (as a mapping) as its run directory records it: every path inside the repository relative to
    it (the jobs run from its root; defaults such as the sample corpus's are absolute), so that committed records
    read the same in every clone."""
    if isinstance(obj, dict):
        return {k: recorded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [recorded(v) for v in obj]
    return repo_relative(obj) if isinstance(obj, str) and obj.startswith(REPO + os.sep) else obj


def _same(old, new) -> bool:
    """Equal, or one path written absolute and relative to the repository (a run started before the sweep wrote
    repository-relative run directories)."""
    return old == new or (isinstance(old, str) and isinstance(new, str)
                          and os.path.join(REPO, old) == os.path.join(REPO, new))


def write_run(grid: Grid, variant: Variant, state: RunState) -> None:
    """Write the run's experiment.yaml and job.sbatch. A started run keeps its experiment: a grid edit that
    changes it (other than grad_accum, which follows the resources) is an error."""
    exp, run = variant.experiment, run_dir(variant)
    os.makedirs(run.path, exist_ok=True)
    path = run.experiment_yaml
    new = recorded(to_dict(exp))
    if state.progress != "new" and os.path.exists(path):
        old, cur = _flat(load_yaml(path)), _flat(new)
        changed = sorted(k for k in old.keys() | cur.keys() if not _same(old.get(k), cur.get(k)) and k not in RESIZABLE)
        if changed:
            raise ConfigError(f"{path}: {variant.name} has started (step {state.step}) with other settings: "
                              + ", ".join(f"{k} {old.get(k)!r} -> {cur.get(k)!r}" for k in changed)
                              + f"; undo the change, or delete {exp.run_dir} to start the run over")
    with open(path, "w") as f:
        f.write(f"# {variant.name} of {grid.path}, resolved by launch/sweep.py\n")
        yaml.safe_dump(new, f, sort_keys=False)
    with open(run.job_file, "w") as f:
        f.write(job_script(grid, variant))


def check_inputs(variant: Variant) -> None:
    """Before a run is started: its shards (unless the trainer builds them) and tokenizer exist, so a placeholder
    path fails here instead of in a queued job; the checks preflight makes (``pipeline.inputs``). Relative paths are
    relative to the repository root, where jobs run."""
    data = variant.experiment.data
    try:
        check_buildable(under(REPO, data.shards), "data.shards", "data.build_inputs", data.build_inputs,
                        data.seq_len, data)
        check_tokenizer_path(under(REPO, data.tokenizer))
    except (ConfigError, FileNotFoundError) as e:
        raise ConfigError(f"{variant.name}: {e}") from None


def in_order(selected: list[Variant], everything: list[Variant], states: dict[str, RunState]) -> list[Variant]:
    """``selected`` with every run after the runs it reads; a run it reads must be finished, queued or selected."""
    by_name = {v.name: v for v in everything}
    chosen = {v.name for v in selected}
    ordered: list[Variant] = []

    def visit(v: Variant) -> None:
        if v in ordered:
            return
        for dep in v.after:
            if dep in chosen:
                visit(by_name[dep])
            elif states[dep].progress not in ("finished", "queued"):
                raise ConfigError(f"{v.name} starts from {dep}, which is {states[dep].progress} and not part of this "
                                  f"sweep; add it (e.g. --only '{dep}' --only '{v.name}') or finish it first")
        ordered.append(v)

    for v in selected:
        visit(v)
    return ordered


@dataclass(frozen=True)
class SweepRequest:
    """What a sweep is asked to do; the fields are the command line's options."""

    grid: str  # grid file
    smoke: bool = False  # the -smoke twins
    only: list[str] = field(default_factory=list)  # shell patterns of run names (all runs without)
    out: str = "runs"  # parent directory of the run directories
    overrides: list[str] = field(default_factory=list)  # --set KEY=VALUE for every run
    nodes: int | None = None  # the grid's resources unless given
    gpus_per_node: int | None = None
    time: str | None = None  # SLURM time limit of one job
    action: Literal["show", "write", "submit", "local"] = "show"


@dataclass
class Sweep:
    """A request resolved against the grid and the run directories: ``todo`` holds the selected runs that have
    not finished, each after the runs it reads."""

    request: SweepRequest
    grid: Grid
    selected: list[Variant]
    states: dict[str, RunState]
    todo: list[Variant]


def prepare(request: SweepRequest) -> Sweep:
    """Resolve the request, print the table, and unless it only shows: write the unfinished runs' directories (a
    queued run's are left alone) and, before submitting or training, check their inputs."""
    grid = load_grid(request.grid)
    base = grid.spec.smoke.resources if request.smoke else grid.spec.resources
    given = {"nodes": request.nodes, "gpus_per_node": request.gpus_per_node, "time": request.time}
    resources = replace(base, **{k: v for k, v in given.items() if v is not None})
    resources.validate()
    everything = grid.variants(smoke=request.smoke, out=repo_relative(request.out),
                               overrides=dict(parse_overrides(request.overrides)), resources=resources)
    selected = select(everything, request.only)
    queued = queued_jobs([v.name for v in everything]) if request.action == "submit" else {}
    states = run_states(everything, queued)
    print(table(selected, states))
    sweep = Sweep(request, grid, selected, states,
                  in_order([v for v in selected if states[v.name].progress != "finished"], everything, states))
    for v in sweep.todo if request.action != "show" else ():
        if states[v.name].progress != "queued":
            write_run(grid, v, states[v.name])
    if request.action in ("submit", "local"):
        for v in sweep.todo:
            check_inputs(v)
    return sweep


def act(sweep: Sweep) -> None:
    """Print what the sweep holds, then submit its runs in order (each after the jobs of the runs it reads) or
    train them here one after another."""
    request, states = sweep.request, sweep.states
    done = sum(states[v.name].progress == "finished" for v in sweep.selected)
    print(f"\n{len(sweep.selected)} runs: {done} finished, {len(sweep.todo)} to do; " + (
        "nothing written (--write, --submit or --local to act)" if request.action == "show"
        else f"run directories under {request.out}/"))
    if request.action == "submit":
        submit_all(sweep.todo, states)
    elif request.action == "local":
        for v in sweep.todo:
            run_local(v)
