"""The sweep's local backend: the runs trained on this machine one after another, each as train.sbatch would run
it (torchrun with the run's ranks on one node, from the repository root)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

from pipeline.config import ConfigError
from pipeline.grid import Resources, Variant
from pipeline.io import REPO
from pipeline.sweep.status import run_dir


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
           "--experiment", run_dir(variant).experiment_yaml]
    print(f"== {variant.name}: {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, cwd=REPO, env=local_env(r, os.environ)).returncode
    if rc != 0:
        raise RuntimeError(f"{variant.name} failed (exit status {rc}, its output is above); fix it and run the same "
                           "command again: finished runs are skipped and this one resumes")
