"""The one checkpoint path: DeepSpeed engine state + our client state + a completion marker.

Layout: ``RUN/checkpoints/step{N:08d}/`` holds DeepSpeed's files, ``rng-rank{r}.pt`` per rank, and ``COMPLETE``
(written by rank 0 after a barrier, once every rank has finished writing). A directory without ``COMPLETE`` is a
half-written checkpoint and is never resumed from; DeepSpeed's ``latest`` file is not trusted.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

from pipeline.data.manifest import write_json_atomic

MARKER = "COMPLETE"
_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def complete_steps(run_dir: str) -> list[int]:
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(root)
                  if (m := _TAG.match(d)) and os.path.exists(os.path.join(root, d, MARKER)))


def latest_complete(run_dir: str) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, run_dir: str, step: int, client_state: dict, extra_files: dict[str, dict], keep_last: int,
         keep_every: int) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    root, tag = checkpoint_root(run_dir), tag_for(step)
    path = os.path.join(root, tag)
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine.save_checkpoint(root, tag=tag, client_state=client_state)
    torch.save(rng_state(), os.path.join(path, f"rng-rank{rank}.pt"))
    if os.environ.get("PIPELINE_FAULT") == f"kill-before-marker:{step}":  # fault injection for the tests
        os.kill(os.getpid(), signal.SIGKILL)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        for name, obj in extra_files.items():
            write_json_atomic(os.path.join(path, name), obj)
        write_json_atomic(os.path.join(path, MARKER), {"step": step, "time": time.time(),
                                                        "world_size": dist.get_world_size() if dist.is_initialized() else 1})
        prune(run_dir, keep_last, keep_every)
    if dist.is_initialized():
        dist.barrier()
    return path


def prune(run_dir: str, keep_last: int, keep_every: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints and every ``keep_every``-th step; drop the rest and any
    incomplete directory older than the newest complete one."""
    root = checkpoint_root(run_dir)
    steps = complete_steps(run_dir)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    newest = steps[-1] if steps else -1
    for d in os.listdir(root):
        m = _TAG.match(d)
        if m and int(m.group(1)) not in keep and int(m.group(1)) <= newest:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def load(engine, run_dir: str, step: int) -> dict:
    """Collective. Restores the engine (weights, optimizer, lr scheduler) and this rank's RNG; returns client state."""
    root, tag = checkpoint_root(run_dir), tag_for(step)
    path = os.path.join(root, tag)
    if not os.path.exists(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path}: no complete checkpoint at step {step}; complete ones: {complete_steps(run_dir)}")
    load_path, client = engine.load_checkpoint(root, tag=tag, load_module_strict=True)
    if load_path is None:
        raise RuntimeError(f"{path}: DeepSpeed could not load this checkpoint (files missing?)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = os.path.join(path, f"rng-rank{rank}.pt")
    if os.path.exists(rng_file):  # absent when resuming on more ranks than saved; the loop draws no randomness
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client
