"""Exclusive locks on output directories: one training run per run directory, one ``build_shards`` job per job
index and output. Two writers of one directory would each "succeed" and leave files from both.

The lock is ``flock`` on a small file that records its holder (host, pid, start time, command). The kernel (or the
NFS lock server) drops an flock when its process dies however it dies, so a crashed holder never blocks the next
run; the file then still names it, and the next holder reports the stale lock it took over. On a filesystem
without flock (Lustre mounted without ``-o flock``) the recorded holder decides: a dead process on this host is a
stale lock, one on another host cannot be checked and is explained in the error.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time


class LockHeld(RuntimeError):
    pass


# flock's errors where a filesystem has none; EBADF: NFS refuses an exclusive lock on a file open read-only (man 2
# flock, "NFS details")
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.EBADF)
_HELD: set[int] = set()  # descriptors of the locks this process holds


def _close_held_in_child() -> None:
    """A forked child (a shard-building pool worker, a DataLoader worker) shares its parent's locks: closing its
    copies means a parent killed with SIGKILL frees them at once, instead of when its orphaned workers exit."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def _holder_alive(holder: dict) -> bool:
    """Whether the recorded holder may still run: checkable only on this host."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    return f"host {holder.get('host')} pid {holder.get('pid')} (since {started}: {holder.get('command', '?')})"


class DirLock:
    """``with DirLock(path, what):`` or :meth:`acquire` / :meth:`release`; ``what`` names the locked thing in
    errors ("run directory runs/x"). After acquiring, ``stale`` holds the dead holder a lock was taken over from."""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        self.stale: dict | None = None
        self._fd: int | None = None

    def _read(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 1 << 16)
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return {}

    def _refuse(self, holder: dict, fd: int) -> None:
        os.close(fd)
        remote = holder.get("host") != socket.gethostname()
        hint = (f"; if host {holder.get('host')} is down and the lock stays held (a network filesystem may keep a "
                f"dead host's lock until its lease expires), delete {self.path}" if remote else "")
        raise LockHeld(f"{self.what} is in use by {describe(holder)}; wait for that process to finish or stop it, "
                       f"or use another directory{hint}")

    def acquire(self) -> DirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        holder = self._read(fd)
        self._flock(fd, holder)
        self.stale = holder or None
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _HELD.add(fd)
        return self

    def _flock(self, fd: int, holder: dict) -> None:
        """Take the flock on ``fd`` or raise :class:`LockHeld` naming ``holder`` (the fd closed)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(holder, fd)
        except OSError as e:  # no flock on this filesystem: the recorded holder decides
            if e.errno not in NO_FLOCK:
                os.close(fd)
                raise
            if holder and _holder_alive(holder):
                self._refuse(holder, fd)

    def check_free(self) -> None:
        """Raise :class:`LockHeld` as :meth:`acquire` would, but keep nothing and write nothing: the check before a
        start (``launch/train.py --check``, rank 0's checks before the process group) leaves no file behind."""
        if not os.path.exists(self.path):  # a lock is held through its file: none, no holder
            return
        try:  # for writing, not to write: NFS emulates flock with POSIX locks, which an exclusive lock needs
            fd = os.open(self.path, os.O_RDWR)
        except PermissionError:  # a lock file of another user's run: read-only, and the recorded holder decides
            fd = os.open(self.path, os.O_RDONLY)
        self._flock(fd, self._read(fd))
        os.close(fd)  # drops the flock taken here

    def release(self, remove: bool = False) -> None:
        """Clear the holder record (so the next holder sees no stale lock) and unlock; a process that dies
        without calling it loses the flock anyway. ``remove`` deletes the lock file first: only for work that is
        final, since a process that opened it meanwhile then holds a lock nobody else sees (it must find the work
        done under its lock)."""
        if self._fd is None:
            return
        if remove:
            os.unlink(self.path)
        os.ftruncate(self._fd, 0)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError as e:  # no flock here: the cleared record frees it (and closing drops any flock)
            if e.errno not in NO_FLOCK:
                raise
        _HELD.discard(self._fd)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
