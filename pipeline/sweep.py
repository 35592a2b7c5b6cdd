"""A sweep: a grid's runs as run directories, their state, one sbatch file each, submission in dependency order.

Per run ``OUT/NAME/``: ``experiment.yaml`` (the resolved experiment the job reads; training rewrites the same
content) and ``job.sbatch`` (launch/slurm/train.sbatch's directives with this run's name, size and log, then
train.sbatch itself on this run). Submitting again is safe: finished runs are skipped, queued ones left alone and
unfinished ones submitted again, to resume from their newest complete checkpoint. A run that reads another run's
output waits for that job (``--dependency=afterok``; train.sbatch requeues itself at the time limit, so the job
ends only when the run has finished).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import yaml

from pipeline.config import ConfigError, load_yaml, to_dict
from pipeline.data.manifest import MANIFEST
from pipeline.grid import SMOKE_SUFFIX, Grid, Variant
from pipeline.model.presets import PRESETS
from pipeline.objectives import OBJECTIVES
from pipeline.train import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")
EXPERIMENT_FILE, JOB_FILE, JOBS_LOG = "experiment.yaml", "job.sbatch", "jobs.txt"
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
    exp = variant.experiment
    if checkpoint.latest_complete(exp.run_dir) != exp.train.steps:
        return False
    hf = os.path.join(exp.run_dir, "hf")
    return not exp.train.export_hf or (os.path.isfile(os.path.join(hf, "config.json")) and
                                       any(".safetensors" in f for f in os.listdir(hf)))


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
        step = checkpoint.latest_complete(v.experiment.run_dir) or 0
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
    """train.sbatch's ``#SBATCH`` lines with this run's name, nodes, log file, time and GPUs or cores."""
    directives: dict[str, str | None] = {}
    with open(TRAIN_SBATCH) as f:
        for line in f:
            if m := re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line):
                directives[m.group(1)] = m.group(2)
    directives.update({"job-name": name, "nodes": str(resources.nodes), "output": log})
    if resources.time:
        directives["time"] = resources.time
    directives["gpus-per-node" if resources.gpu else "cpus-per-task"] = str(resources.gpus_per_node)
    return [f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in directives.items()]


def job_script(grid: Grid, variant: Variant) -> str:
    run_dir = os.path.abspath(variant.experiment.run_dir)
    r = variant.resources
    env = [f"export GPUS_PER_NODE={r.gpus_per_node}", f'export PYTHON="${{PYTHON:-{sys.executable}}}"']
    if not r.gpu:
        env.append('export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"')
    values = " ".join(f"{a}={v}" for a, v in variant.values.items())
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# {variant.name} of {grid.path} ({values}), written by launch/sweep.py.",
        "# Submit from the repository root (or with sweep.py --submit, which skips finished runs):",
        f"#   sbatch {os.path.relpath(os.path.join(run_dir, JOB_FILE), REPO)}",
        "# The directives are launch/slurm/train.sbatch's, with this run's name, size and log file.",
        *_sbatch_directives(r, variant.name, os.path.join(run_dir, "slurm-%j.out")),
        *env,
        f"exec bash {TRAIN_SBATCH} --config {os.path.abspath(grid.ds_config)} "
        f"--experiment {os.path.join(run_dir, EXPERIMENT_FILE)}",
        ""])


def write_run(grid: Grid, variant: Variant, state: RunState) -> None:
    """Write the run's experiment.yaml and job.sbatch. A started run keeps its experiment: a grid edit that
    changes it (other than grad_accum, which follows the resources) is an error."""
    exp = variant.experiment
    os.makedirs(exp.run_dir, exist_ok=True)
    path = os.path.join(exp.run_dir, EXPERIMENT_FILE)
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
    with open(os.path.join(exp.run_dir, JOB_FILE), "w") as f:
        f.write(job_script(grid, variant))


def check_inputs(variant: Variant) -> None:
    """Before a run is started: its shards (unless the trainer builds them) and tokenizer exist, so a placeholder
    path fails here instead of in a queued job. Relative paths are relative to the repository root, where jobs run."""
    data = variant.experiment.data
    if not data.build_if_missing and not os.path.isfile(os.path.join(REPO, data.shards, MANIFEST)):
        raise ConfigError(f"{variant.name}: data.shards {data.shards} has no {MANIFEST}; build the shards first "
                          "(docs/data_prep.md) or point the runs at them with --set data.shards=DIR")
    if not os.path.exists(os.path.join(REPO, data.tokenizer)):
        raise ConfigError(f"{variant.name}: data.tokenizer {data.tokenizer} does not exist; --set data.tokenizer=DIR "
                          "(the tokenizer the shards were built with)")


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
    job_file = os.path.join(variant.experiment.run_dir, JOB_FILE)
    cmd = ["sbatch", "--parsable", *([f"--dependency=afterok:{':'.join(map(str, after_jobs))}"] if after_jobs else []),
           job_file]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    job = int(proc.stdout.strip().split(";")[0])
    with open(os.path.join(variant.experiment.run_dir, JOBS_LOG), "a") as f:
        f.write(f"{job} submitted {time.strftime('%Y-%m-%d %H:%M:%S')}"
                + (f" after {','.join(map(str, after_jobs))}" if after_jobs else "") + "\n")
    return job


def run_local(grid: Grid, variant: Variant) -> None:
    """Train the run on this machine: torchrun with the run's ranks (one node), the command train.sbatch runs."""
    r = variant.resources
    if r.nodes != 1:
        raise ConfigError(f"{variant.name} needs {r.nodes} nodes; run it with --submit, or give it one node "
                          "(--nodes 1 --gpus-per-node N)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r.gpus_per_node}",
           os.path.join(REPO, "launch", "train.py"), "--config", os.path.abspath(grid.ds_config),
           "--experiment", os.path.join(os.path.abspath(variant.experiment.run_dir), EXPERIMENT_FILE)]
    env = dict(os.environ)
    if not r.gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    print(f"== {variant.name}: {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"{variant.name} failed (exit status {rc}, its output is above); fix it and run the same "
                           "command again: finished runs are skipped and this one resumes")
