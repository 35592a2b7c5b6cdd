"""DeepSpeed's JIT-built ops stay apart per install and version (issue 43: an install loaded the op another
DeepSpeed had built into the one per-user cache, and stopped at start-up). The rank's side, a 2-rank run through
DeepSpeed's launcher: tests/e2e/test_deepspeed_ops_ranks.py."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import deepspeed
import torch
from helpers import REPO, venv_without
from torch.utils import file_baton
from torch.utils.file_baton import FileBaton

from pipeline.train import deepspeed_ops
from pipeline.train.deepspeed_ops import (
    ENV,
    exit_after_builds,
    install_ops_dir,
    ops_dir_name,
    track_build_locks,
    use_install_ops_dir,
)


def test_the_folder_is_named_by_deepspeeds_and_torchs_versions():
    names = {ops_dir_name(ds, pt) for ds in ("0.19.7", "0.19.8") for pt in ("2.13.0+cpu", "2.13.0+cu130")}
    assert len(names) == 4
    assert install_ops_dir() == os.path.join(sys.prefix, "torch_extensions",
                                             f"deepspeed-{deepspeed.__version__}-torch-{torch.__version__}")


def test_a_second_install_gets_its_own_folder_through_the_launch_scripts(tmp_path):
    """Another environment with the same packages (a venv seeing this one's site-packages): launch/build_ops.py
    (launch/_repo.py, as every launch script) names a folder under that environment, not this one's."""
    python, _ = venv_without(set(), tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    proc = subprocess.run([python, os.path.join(REPO, "launch", "build_ops.py"), "--print-dir"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = proc.stdout.strip()
    assert other == os.path.join(str(tmp_path / "venv"), "torch_extensions", os.path.basename(install_ops_dir()))
    assert other != install_ops_dir()


def test_the_users_folder_is_kept():
    env = {ENV: "/scratch/ops"}
    assert use_install_ops_dir(env) == "/scratch/ops" and env == {ENV: "/scratch/ops"}
    env = {ENV: ""}  # empty is unset, as torch reads it
    assert use_install_ops_dir(env) == install_ops_dir() == env[ENV]


def test_a_read_only_install_builds_into_the_users_cache_one_folder_per_install(tmp_path, monkeypatch):
    """A prefix this user cannot write (a cluster's shared environment; here one that does not exist, since root
    writes anywhere): the user's cache, still apart per install."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first, second = (install_ops_dir(str(tmp_path / name)) for name in ("shared-env-a", "shared-env-b"))
    assert os.path.dirname(first) == os.path.dirname(second) == str(tmp_path / "torch_extensions")
    assert first != second
    assert os.path.basename(first).startswith(os.path.basename(install_ops_dir()) + "-")


# A rank in start-up holding the build lock of an op (as torch's extension builder takes it while DeepSpeed builds
# or checks the CPU collectives op), sent USR1: it says whether it is still running, then the build releases the lock.
STOP_DURING_BUILD = """
import os, signal, sys, time
from torch.utils.file_baton import FileBaton
from pipeline.train.deepspeed_ops import track_build_locks
from pipeline.train.signals import StopRequest
track_build_locks()
stop = StopRequest(rank=0)
stop.config_checked(sys.argv[1])
baton = FileBaton(sys.argv[2])
assert baton.try_acquire()
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(1)
print("still building", flush=True)
baton.release()
print("not stopped", flush=True)
"""


def test_a_stop_during_an_op_build_exits_once_the_build_releases_its_lock(tmp_path):
    """A stop in start-up exits the rank at once (``os._exit``), which used to leave torch's build lock of the op
    behind: every later start of the run waited on it for good (a SLURM job signalled while its ranks loaded the
    CPU op restarted ten times, each stopped in start-up). Now the exit waits for the lock's release."""
    lock = tmp_path / "lock"
    proc = subprocess.run([sys.executable, "-c", STOP_DURING_BUILD, str(tmp_path / "run"), str(lock)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["still building"] and not lock.exists()
    assert "stopped during start-up on SIGUSR1" in proc.stderr


def test_a_stop_signal_anywhere_in_the_build_lock_tracking_exits_once_and_never_holding_the_lock(tmp_path):
    """The stop handler (``exit_after_builds``) runs between two bytecodes of the code it interrupts, which may be
    the lock tracking itself: a build takes and releases its lock, and a signal lands before each line the tracking
    (and torch's FileBaton under it) runs, one line per try. The stop never waits (a lock of the tracking held by the
    interrupted code hung the rank: issue 55, item 5), its exit runs exactly once, and no lock file is left when
    it does. An alarm breaks a hang into a failure."""
    track_build_locks()
    lock = tmp_path / "lock"
    exits: list[bool] = []

    def exit_now():  # stands in for os._exit: records whether the lock file is still there
        exits.append(lock.exists())

    def on_stop(signum, frame):
        if not exit_after_builds(exit_now):
            exit_now()

    def hung(signum, frame):
        raise TimeoutError("the stop handler waits on the build-lock tracking")

    watched = (deepspeed_ops.__file__, file_baton.__file__)

    def build_stopped_at(line: int) -> bool:
        """A build that takes and releases the lock, stopped before the ``line``-th line it runs in ``watched``;
        False when it ran fewer lines."""
        lines = itertools.count(1)

        def trace(frame, event, arg):
            if frame.f_code.co_filename not in watched:
                return None
            if event == "line" and next(lines) == line:
                signal.raise_signal(signal.SIGUSR1)
            return trace

        signal.setitimer(signal.ITIMER_REAL, 10)
        tracer = sys.gettrace()  # a debugger's or coverage's, put back after
        sys.settrace(trace)
        try:
            baton = FileBaton(str(lock))
            assert baton.try_acquire()
            baton.release()
        finally:
            sys.settrace(tracer)
            signal.setitimer(signal.ITIMER_REAL, 0)
        return next(lines) > line

    previous = signal.signal(signal.SIGUSR1, on_stop), signal.signal(signal.SIGALRM, hung)
    try:
        line = 1
        while build_stopped_at(line):
            assert exits == [False], f"a stop before line {line} of the build exited {exits}"
            exits.clear()
            line += 1
        assert line > 5 and not deepspeed_ops._held and not deepspeed_ops._after_builds
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGALRM, previous[1])
