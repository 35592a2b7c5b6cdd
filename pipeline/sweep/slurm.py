"""The sweep's SLURM backend: one sbatch file per run (launch/slurm/train.sbatch's directives with the run's name,
size and log), the runs queued already (squeue), and submission in dependency order (sbatch ``afterok``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from pipeline.grid import Grid, Variant
from pipeline.io import REPO
from pipeline.sweep.status import RunState, run_dir

TRAIN_SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")


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
    run = run_dir(variant)
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


def submit(variant: Variant, after_jobs: list[int]) -> int:
    """sbatch the run's job file from the repository root; returns the job id (also logged in RUN/jobs.txt)."""
    run = run_dir(variant)
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


def submit_all(todo: list[Variant], states: dict[str, RunState]) -> None:
    """Submit the runs in order, each after the jobs of the runs it reads; a queued run is left alone."""
    jobs = {name: s.job for name, s in states.items() if s.progress == "queued"}
    for v in todo:
        if states[v.name].progress == "queued":
            print(f"{v.name}: already queued as job {jobs[v.name]}")
            continue
        after = [jobs[d] for d in v.after if d in jobs]
        jobs[v.name] = submit(v, after)
        print(f"{v.name}: submitted job {jobs[v.name]}" + (f" (after job {', '.join(map(str, after))})"
                                                            if after else ""))
