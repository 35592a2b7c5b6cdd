"""The run directory's lock on NFS (issue 55, item 4), where clusters keep run directories: NFS emulates ``flock``
with POSIX locks (``man 2 flock``, "NFS details"), which take an exclusive lock only on a file open for writing.
Here ``flock`` goes through ``lockf`` as NFS routes it, in this process and in the holder's."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from pipeline.lock import DirLock, LockHeld

AS_ON_NFS = """
import fcntl
def flock(fd, op):  # NFS's flock: a POSIX lock of the whole file (EBADF on a file open read-only)
    return fcntl.lockf(fd, op)
fcntl.flock = flock
"""
HOLD = AS_ON_NFS + """
import sys, time
from pipeline.lock import DirLock
DirLock(sys.argv[1], "run directory x").acquire()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def nfs(monkeypatch):
    monkeypatch.setattr(fcntl, "flock", fcntl.lockf)


def test_a_lock_file_left_by_a_finished_run_is_free_on_nfs(tmp_path, nfs):
    """Every run leaves its lock file: the check before a resume (and ``--check``) finds it free."""
    path = str(tmp_path / ".lock")
    with DirLock(path, "run directory x"):
        pass
    DirLock(path, "run directory x").check_free()
    with DirLock(path, "run directory x") as lock:
        assert lock.stale is None


def test_a_lock_held_on_nfs_is_named_by_the_check(tmp_path, nfs):
    path = str(tmp_path / ".lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=rf"^run directory x is in use by host \S+ pid {holder.pid} "):
            DirLock(path, "run directory x").check_free()
    finally:
        holder.kill()
        holder.wait()
