"""Errors a person can read: one line from rank 0 naming the file and the fix, the traceback in a log file.

Every rank writes its traceback to ``RUN/logs/error-rank{r}.log`` (its first line is the one-line message) and stays
silent; rank 0 prints the message. When rank 0 only saw the consequence (another rank died, so a collective failed),
it prints the message of the rank that failed first, read from that rank's log.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import sys
import tempfile
import time
import traceback

from pipeline.run_dir import RunDir

PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "DistBackendError", "DistNetworkError",
                "NCCL error", "Broken pipe")


def one_line(exc: BaseException) -> str:
    """The message a user needs: a full disk names the path; a DataLoader worker's wrapper is removed."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return f"no space left on device: {e.filename}" if e.filename else e.strerror
    text = str(exc).strip()
    if "Original Traceback" in text:  # re-raised from a DataLoader worker: its last line is the error
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return " ".join(text.split()) or type(exc).__name__


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def log_dirs(run_dir: str) -> tuple[str, str]:
    """``RUN/logs``, and where logs go when it cannot be written (a full disk, an unwritable run_dir)."""
    fallback = os.path.join(tempfile.gettempdir(), "train-errors", os.path.abspath(run_dir).strip("/").replace("/", "_"))
    return RunDir(run_dir).logs, fallback


def _write_log(exc: BaseException, run_dir: str, rank: int) -> str:
    text = one_line(exc) + "\n\n" + "".join(traceback.format_exception(exc))
    for directory in log_dirs(run_dir):
        path = os.path.join(directory, f"error-rank{rank}.log")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            return path
        except OSError:
            with contextlib.suppress(OSError):  # a full disk may leave an empty file behind
                os.remove(path)
    return "(not written: no writable location)"


def _is_peer_failure(exc: BaseException) -> bool:
    return any(word in f"{type(e).__name__}: {e}" for e in _chain(exc) for word in PEER_FAILURE)


def first_other_failure(run_dir: str, since: float, wait_s: float) -> tuple[str, str] | None:
    """(message, log path) of the earliest other rank's error log written since ``since``."""
    deadline = time.time() + wait_s
    while True:
        logs = [p for d in log_dirs(run_dir) for p in glob.glob(os.path.join(d, "error-rank*.log"))
                if not p.endswith("rank0.log") and os.path.getmtime(p) >= since]
        if logs:
            first = min(logs, key=os.path.getmtime)
            with open(first) as f:
                return f.readline().strip(), first
        if time.time() > deadline:
            return None
        time.sleep(0.2)


def report(exc: BaseException, run_dir: str, rank: int, started: float, prefix: str = "error") -> None:
    """Log ``exc`` for this rank; on rank 0 print the one line that explains the failure."""
    path = _write_log(exc, run_dir, rank)
    if rank != 0:
        return
    message = one_line(exc)
    if _is_peer_failure(exc):
        other = first_other_failure(run_dir, started, wait_s=5.0)
        if other:
            message, path = other
        else:
            message = f"another rank stopped ({message}); see {RunDir(run_dir).logs} and the launcher's output"
    print(f"{prefix}: {message}\n(traceback: {path})", file=sys.stderr, flush=True)
