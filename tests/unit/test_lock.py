"""The run directory's lock on NFS (issue 55, item 4), where clusters keep run directories: NFS emulates ``flock``
with POSIX locks (``man 2 flock``, "NFS details"), which take an exclusive lock only on a file open for writing.
Here ``flock`` goes through ``lockf`` as NFS routes it, in this process and in the holder's."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
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


def test_without_flock_the_recorded_holder_decides(tmp_path, monkeypatch):
    """A filesystem with no flock at all (ENOLCK, ENOSYS, ...): a holder recorded on this host holds the lock while
    its process runs and is taken over once it is gone; one on another host holds it, with how to free it; any other
    error of flock is raised as it is. (The release's unlock raised ENOLCK, so every run there ended in a
    traceback.)"""
    path = str(tmp_path / ".lock")

    def recorded(host: str, pid: int) -> None:
        with open(path, "w") as f:
            json.dump({"host": host, "pid": pid, "time": 0, "command": "launch/train.py"}, f)

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorded(socket.gethostname(), running.pid)
        with pytest.raises(LockHeld, match=rf"^run directory x is in use by host \S+ pid {running.pid} .*another "
                                           r"directory$"):
            DirLock(path, "run directory x").acquire()
    finally:
        running.kill()
        running.wait()
    recorded(socket.gethostname(), running.pid)  # now gone
    lock = DirLock(path, "run directory x").acquire()
    assert lock.stale["pid"] == running.pid
    lock.release(remove=True)  # its unlock fails as the lock did: the release goes on
    assert not os.path.exists(path)
    recorded("another-node", 1)
    with pytest.raises(LockHeld, match=rf"host another-node is down and the lock stays held .*delete {path}$"):
        DirLock(path, "run directory x").check_free()

    def io_error(fd, op):
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(fcntl, "flock", io_error)
    with pytest.raises(OSError, match="input/output error"):
        DirLock(path, "run directory x").acquire()
