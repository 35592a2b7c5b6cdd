"""A sweep: a grid's runs as run directories, their state, one sbatch file each, submission in dependency order,
and its command line: ``python launch/sweep.py GRID [--smoke] [--only PATTERN] [--out runs] [--set KEY=VALUE]
[--write | --submit | --local]`` (or ``pipeline-sweep ...``).

The command prints the grid as a table (run, model, steps, tokens, phases, start run, state) and writes nothing.
``--write`` also writes OUT/RUN/experiment.yaml and OUT/RUN/job.sbatch for every selected run that has not finished;
``--submit`` writes them and sbatches them (finished and queued runs are skipped; unfinished ones resume from their
newest checkpoint; a run that continues another one waits for its job); ``--local`` writes them and trains them
one after another on this machine. See docs/experiments.md.

Per run ``OUT/NAME/``: ``experiment.yaml`` (the resolved experiment the job reads; training rewrites the same
content) and ``job.sbatch`` (launch/slurm/train.sbatch's directives with this run's name, size and log, then
train.sbatch itself on this run). Submitting again is safe: finished runs are skipped, queued ones left alone and
unfinished ones submitted again, to resume from their newest complete checkpoint. A run that reads another run's
output waits for that job (``--dependency=afterok``; train.sbatch requeues itself at the time limit, so the job
ends only when the run has finished).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import yaml

from pipeline.config import ConfigError, load_yaml, parse_overrides, to_dict
from pipeline.grid import SMOKE_SUFFIX, Grid, Resources, Variant, load_grid
from pipeline.inputs import check_buildable, under
from pipeline.model.presets import PRESETS
from pipeline.objectives import OBJECTIVES
from pipeline.run_dir import RunDir
from pipeline.tokenizer import check_tokenizer_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")
RESIZABLE = {"train.grad_accum"}  # may change for a started run: other resources, same global batch


@dataclass(frozen=True)
class RunState:
    kind: str  # new | started | queued | finished
    step: int = 0  # newest complete checkpoint
    job: int | None = None  # SLURM job id of a queued run

    def describe(self, steps: int) -> str:
        if self.kind == "queued":
            return f"queued (job {self.job}, step {self.step}/{steps})"
        return {"new": "new", "finished": "finished"}.get(self.kind, f"started (step {self.step}/{steps})")


def is_finished(variant: Variant) -> bool:
    """Trained to the last step and, when the run exports, its HF directory written."""
    exp, run = variant.experiment, RunDir(variant.experiment.run_dir)
    return run.latest_complete() == exp.train.steps and (not exp.train.export_hf or run.has_hf())


def queued_jobs(names: list[str]) -> dict[str, int]:
    """Run name -> id of this user's pending or running job of that name; {} where SLURM is not installed."""
    if shutil.which("squeue") is None or not names:
        return {}
    proc = subprocess.run(["squeue", "--me", "--noheader", "--format=%j %i", f"--name={','.join(names)}"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"squeue failed (rc {proc.returncode}): {proc.stderr.strip()}; is the SLURM controller "
                           "reachable (SLURM_CONF)?")
    return {name: int(job.split("_")[0]) for name, job in (line.split() for line in proc.stdout.splitlines())}


def run_states(variants: list[Variant], queued: dict[str, int]) -> dict[str, RunState]:
    states = {}
    for v in variants:
        step = RunDir(v.experiment.run_dir).latest_complete() or 0
        if is_finished(v):
            states[v.name] = RunState("finished", step)
        elif v.name in queued:
            states[v.name] = RunState("queued", step, queued[v.name])
        else:
            states[v.name] = RunState("started" if step else "new", step)
    return states


def _objective_label(spec) -> str:
    return f"{spec.name}{round(spec.ratio * 100)}" if OBJECTIVES[spec.name].masks else spec.name


def phases_label(variant: Variant) -> str:
    """``clm 3000 -> mlm40 9000``: each phase's objectives and length in steps."""
    exp = variant.experiment
    ends = [*exp.phase_starts()[1:], exp.train.steps]
    return " -> ".join(f"{'+'.join(_objective_label(o) for o in p.objectives)} {end - start}"
                       for p, start, end in zip(exp.phases, exp.phase_starts(), ends))


def tokens_label(variant: Variant) -> str:
    t, r = variant.experiment.train, variant.resources
    tokens = t.steps * t.micro_batch * t.grad_accum * r.world_size * variant.experiment.data.seq_len
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.1f}{unit}"
    return str(tokens)


def table(variants: list[Variant], states: dict[str, RunState]) -> str:
    header = ("run", "model", "steps", "tokens", "phases", "starts from", "state")
    rows = []
    for v in variants:
        m = v.experiment.model
        model = m.shape or (m.init if m.init in PRESETS else os.path.basename(m.init.rstrip("/")))
        rows.append((v.name, model, str(v.experiment.train.steps), tokens_label(v), phases_label(v),
                     ", ".join(v.after) or "-", states[v.name].describe(v.experiment.train.steps)))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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


def _sbatch_directives(resources, name: str, log: str) -> list[str]:
    """train.sbatch's ``#SBATCH`` lines with this run's name, nodes, log file, time, GPUs and cores (one task a
    node: its cores serve all the node's ranks)."""
    directives: dict[str, str | None] = {}
    with open(TRAIN_SBATCH) as f:
        for line in f:
            if m := re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line):
                directives[m.group(1)] = m.group(2)
    directives.update({"job-name": name, "nodes": str(resources.nodes), "output": log})
    if resources.time:
        directives["time"] = resources.time
    if resources.gpu:
        directives["gpus-per-node"] = str(resources.gpus_per_node)
    directives["cpus-per-task"] = str(resources.gpus_per_node * (resources.cpus_per_gpu if resources.gpu else 1))
    return [f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in directives.items()]


def job_script(grid: Grid, variant: Variant) -> str:
    run = RunDir(os.path.abspath(variant.experiment.run_dir))
    r = variant.resources
    env = [f"export GPUS_PER_NODE={r.gpus_per_node}", f'export PYTHON="${{PYTHON:-{sys.executable}}}"']
    if not r.gpu:
        env.append('export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"')
    values = " ".join(f"{a}={v}" for a, v in variant.values.items())
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# {variant.name} of {grid.path} ({values}), written by launch/sweep.py.",
        "# Submit from the repository root (or with sweep.py --submit, which skips finished runs):",
        f"#   sbatch {os.path.relpath(run.job_file, REPO)}",
        "# The directives are launch/slurm/train.sbatch's, with this run's name, size and log file.",
        *_sbatch_directives(r, variant.name, run.slurm_log),
        *env,
        f"exec bash {TRAIN_SBATCH} --config {variant.ds_config} "
        f"--experiment {run.experiment_yaml}",
        ""])


def write_run(grid: Grid, variant: Variant, state: RunState) -> None:
    """Write the run's experiment.yaml and job.sbatch. A started run keeps its experiment: a grid edit that
    changes it (other than grad_accum, which follows the resources) is an error."""
    exp, run = variant.experiment, RunDir(variant.experiment.run_dir)
    os.makedirs(run.path, exist_ok=True)
    path = run.experiment_yaml
    new = to_dict(exp)
    if state.kind != "new" and os.path.exists(path):
        old, cur = _flat(load_yaml(path)), _flat(new)
        changed = sorted(k for k in old.keys() | cur.keys() if old.get(k) != cur.get(k) and k not in RESIZABLE)
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
            elif states[dep].kind not in ("finished", "queued"):
                raise ConfigError(f"{v.name} starts from {dep}, which is {states[dep].kind} and not part of this "
                                  f"sweep; add it (e.g. --only '{dep}' --only '{v.name}') or finish it first")
        ordered.append(v)

    for v in selected:
        visit(v)
    return ordered


def submit(variant: Variant, after_jobs: list[int]) -> int:
    """sbatch the run's job file from the repository root; returns the job id (also logged in RUN/jobs.txt)."""
    run = RunDir(variant.experiment.run_dir)
    cmd = ["sbatch", "--parsable", *([f"--dependency=afterok:{':'.join(map(str, after_jobs))}"] if after_jobs else []),
           run.job_file]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    job = int(proc.stdout.strip().split(";")[0])
    with open(run.jobs_log, "a") as f:
        f.write(f"{job} submitted {time.strftime('%Y-%m-%d %H:%M:%S')}"
                + (f" after {','.join(map(str, after_jobs))}" if after_jobs else "") + "\n")
    return job


def local_env(r: Resources, environ: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment: on CPU ranks DeepSpeed's CPU accelerator and the machine's cores split among them
    (one rank: all of them; BENCHMARKS.md "CPU layouts"), unless ``environ`` sets them."""
    env = dict(environ)
    if not r.gpu:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // r.gpus_per_node)))
    return env


def run_local(variant: Variant) -> None:
    """Train the run on this machine: torchrun with the run's ranks (one node), the command train.sbatch runs."""
    r = variant.resources
    if r.nodes != 1:
        raise ConfigError(f"{variant.name} needs {r.nodes} nodes; run it with --submit, or give it one node "
                          "(--nodes 1 --gpus-per-node N)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r.gpus_per_node}",
           "-m", "pipeline.train.entry", "--config", variant.ds_config,
           "--experiment", RunDir(os.path.abspath(variant.experiment.run_dir)).experiment_yaml]
    print(f"== {variant.name}: {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, cwd=REPO, env=local_env(r, os.environ)).returncode
    if rc != 0:
        raise RuntimeError(f"{variant.name} failed (exit status {rc}, its output is above); fix it and run the same "
                           "command again: finished runs are skipped and this one resumes")


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
    everything = grid.variants(smoke=request.smoke, out=os.path.abspath(request.out),
                               overrides=dict(parse_overrides(request.overrides)), resources=resources)
    selected = select(everything, request.only)
    queued = queued_jobs([v.name for v in everything]) if request.action == "submit" else {}
    states = run_states(everything, queued)
    print(table(selected, states))
    sweep = Sweep(request, grid, selected, states,
                  in_order([v for v in selected if states[v.name].kind != "finished"], everything, states))
    for v in sweep.todo if request.action != "show" else ():
        if states[v.name].kind != "queued":
            write_run(grid, v, states[v.name])
    if request.action in ("submit", "local"):
        for v in sweep.todo:
            check_inputs(v)
    return sweep


def act(sweep: Sweep) -> None:
    """Print what the sweep holds, then submit its runs in order (each after the jobs of the runs it reads) or
    train them here one after another."""
    request, states = sweep.request, sweep.states
    done = sum(states[v.name].kind == "finished" for v in sweep.selected)
    print(f"\n{len(sweep.selected)} runs: {done} finished, {len(sweep.todo)} to do; " + (
        "nothing written (--write, --submit or --local to act)" if request.action == "show"
        else f"run directories under {request.out}/"))
    if request.action == "submit":
        jobs = {name: s.job for name, s in states.items() if s.kind == "queued"}
        for v in sweep.todo:
            if states[v.name].kind == "queued":
                print(f"{v.name}: already queued as job {jobs[v.name]}")
                continue
            after = [jobs[d] for d in v.after if d in jobs]
            jobs[v.name] = submit(v, after)
            print(f"{v.name}: submitted job {jobs[v.name]}" + (f" (after job {', '.join(map(str, after))})"
                                                                if after else ""))
    elif request.action == "local":
        for v in sweep.todo:
            run_local(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", help="grid file, e.g. experiments/mlm_vs_clm/grid.yaml")
    p.add_argument("--smoke", action="store_true", help="the -smoke twins (tiny model, sample corpus, CPU ranks)")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="runs whose name matches this shell pattern, e.g. 'switch-610m-*' (repeatable)")
    p.add_argument("--out", default="runs", help="parent directory of the run directories (default: runs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set an experiment field in every run, e.g. data.shards=/data/shards (repeatable)")
    p.add_argument("--nodes", type=int, help="nodes per run (default: the grid's resources)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the grid's resources)")
    p.add_argument("--time", help="SLURM time limit of one job, e.g. 24:00:00 (the run requeues itself)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--write", dest="action", action="store_const", const="write",
                        help="write the run directories and job files, submit nothing")
    action.add_argument("--submit", dest="action", action="store_const", const="submit",
                        help="sbatch the unfinished runs")
    action.add_argument("--local", dest="action", action="store_const", const="local",
                        help="train the unfinished runs here, one after another")
    p.set_defaults(action="show")
    request = SweepRequest(**vars(p.parse_args(argv)))
    try:
        sweep = prepare(request)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        act(sweep)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
