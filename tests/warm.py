"""Processes forked from a warm one: the project's scripts as ranks (or as one plain process) that start without
importing anything.

A rank launched by torchrun spends ~8 CPU seconds importing torch, transformers, DeepSpeed and the trainer before
its first line of work, and the launcher ~2 more: most of what a short CPU run costs, and most of what the suite
spends (docs/testing.md). Here a forkserver imports all of that once per test process, and each rank is a fork of
it: a real process with its own pid, environment, working directory, stdout and stderr, running the real script
as ``__main__`` (``runpy``) with torchrun's rank environment and rendezvous, and a run whose rank fails ends its
other ranks as torchrun does. What a launcher itself does (its signals, its exit codes, its ports) stays tested
through the real ones (``launcher="torchrun"`` / ``"deepspeed"`` in :func:`helpers.launch_training`, the demo, the
SLURM tests).

A forked process keeps the server's ``sys.path`` and imported modules, so a test that hides a package with
``PYTHONPATH`` must use a real launcher: :func:`run` refuses such an environment rather than test the wrong thing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import connection, forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
SERVER = "PIPELINE_WARM_SERVER"  # set in the forkserver's environment: it imports what every rank imports
GRACE_S = 30  # torchrun's SIGTERM-then-SIGKILL grace for the ranks of a failed run


def _preload() -> None:
    """What a rank of launch/train.py imports before its first step (the server's start, once per test process)."""
    sys.path.insert(0, LAUNCH)
    import _repo  # noqa: F401
    import deepspeed  # noqa: F401
    import matplotlib.pyplot  # noqa: F401  (the run's loss plot)
    import transformers.models.llama.modeling_llama  # noqa: F401

    import pipeline.export.hf  # noqa: F401
    import pipeline.train.entry  # noqa: F401
    import pipeline.train.trainer  # noqa: F401


if os.environ.get(SERVER) == "1":
    _preload()


_context = None


def _forkserver():
    """The forkserver context, started on first use with the heavy imports done in the server."""
    global _context
    if _context is None:
        multiprocessing.set_forkserver_preload([__name__])
        saved = dict(os.environ)
        os.environ.update({SERVER: "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), REPO])})
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = multiprocessing.get_context("forkserver")
    return _context


def _child(script: str | None, code: str | None, args: list[str], env: dict[str, str], cwd: str, out: str,
           err: str) -> None:
    """In the forked process: become ``python SCRIPT ARGS`` (or ``python -c CODE ARGS``) started with ``env`` in
    ``cwd``, writing to ``out`` and ``err``."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.pop(SERVER, None)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # what a fresh process reads from its environment
    if script is not None:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        sys.modules.pop("_repo", None)  # a launch/ script's first import sets the environment up, as in a fresh rank
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = ["-c", *args]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


@contextlib.contextmanager
def _rendezvous(nproc: int):
    """torchrun's rank environment around a store this process holds (the ranks join it as torchrun's do)."""
    from helpers import rendezvous

    with rendezvous(nproc) as rdzv:
        yield {**rdzv, "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(nproc)}


def run(script: str | None = None, args: list[str] = (), *, code: str | None = None, nproc: int | None = None,
        env: dict[str, str] | None = None, cwd: str = REPO, timeout: float = 900) -> subprocess.CompletedProcess:
    """``script`` (a path) or ``code`` (``python -c``) with ``args``, forked from the warm server.

    ``nproc``: that many ranks, as ``torchrun --standalone --nproc_per_node=N`` starts them (RANK, LOCAL_RANK,
    WORLD_SIZE, a rendezvous store; returncode 1 when a rank fails, whose peers then get SIGTERM and, after
    torchrun's grace, SIGKILL). None: one plain process (``python script args``) and its own exit status (-N for a
    signal, as subprocess reports). Raises :class:`subprocess.TimeoutExpired` past ``timeout``, killing them all."""
    env = dict(os.environ if env is None else env)
    _check_env(env)
    ctx = _forkserver()
    with tempfile.TemporaryDirectory() as tmp, (_rendezvous(nproc) if nproc else contextlib.nullcontext({})) as rdzv:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        envs = [{**env, **rdzv, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)] if nproc else [env]
        procs = [ctx.Process(target=_child, args=(script, code, list(args), e, cwd, out, err)) for e in envs]
        for p in procs:
            p.start()
        codes = _wait(procs, time.monotonic() + timeout)
        if codes is None:
            _end(procs, signal.SIGKILL)
            raise subprocess.TimeoutExpired([script or "-c", *args], timeout)
        with open(out) as o, open(err) as e:
            stdout, stderr = o.read(), e.read()
    rc = (1 if any(codes) else 0) if nproc else codes[0]
    return subprocess.CompletedProcess([script or "-c", *args], rc, stdout, stderr)


def _check_env(env: dict[str, str]) -> None:
    """A forked process keeps what the server imported: its ``sys.path`` and DeepSpeed's CPU accelerator."""
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) not in
             {REPO, LAUNCH, *map(os.path.abspath, sys.path)}]
    if added:
        raise ValueError(f"PYTHONPATH adds {added}, which a warm process cannot take (it keeps the server's "
                         "sys.path and imported modules): start this one with a real launcher")
    if env.get("DS_ACCELERATOR", "cpu") != "cpu":
        raise ValueError("a warm process runs DeepSpeed's CPU accelerator (the server's): start a GPU run for real")


def _wait(procs: list, deadline: float) -> list[int] | None:
    """Each process's exit code (None: some still ran at ``deadline``); once one fails, the others get SIGTERM,
    then SIGKILL after the grace."""
    failed_at = None
    while any(p.exitcode is None for p in procs):
        until = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
        connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=max(0.0, until - time.monotonic()))
        if failed_at is None and any(p.exitcode for p in procs if p.exitcode is not None):
            failed_at = time.monotonic()
            _end(procs, signal.SIGTERM)
        elif failed_at is not None and time.monotonic() >= failed_at + GRACE_S:
            _end(procs, signal.SIGKILL)
        if time.monotonic() >= deadline and any(p.exitcode is None for p in procs):
            return None
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _end(procs: list, sig: int) -> None:
    for p in procs:
        if p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
