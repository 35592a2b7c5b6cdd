"""DeepSpeed's JIT-built ops stay apart per install and version (issue 43: an install loaded the op another
DeepSpeed had built into the one per-user cache, and stopped at start-up). The rank's side, a 2-rank run through
DeepSpeed's launcher: tests/e2e/test_deepspeed_ops_ranks.py."""

from __future__ import annotations

import os
import subprocess
import sys

import deepspeed
import torch
from helpers import REPO, venv_without

from pipeline.train.deepspeed_ops import ENV, install_ops_dir, ops_dir_name, use_install_ops_dir


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
