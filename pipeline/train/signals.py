"""Stopping a run: signals and a launcher that went away.

Which process gets what (docs/training.md, "Failure modes"):

- SIGUSR1/SIGTERM/SIGINT to a rank: during start-up the rank exits at once with status 0 (nothing is trained yet,
  and every start-up step is safe to redo); once training runs, every rank checkpoints at the next step boundary and exits.
- A failure wins over the signal it causes: when one rank fails, the launcher terminates the others, so the signal
  may reach rank 0 before rank 0 has said why. A signal before the rank has read its config waits for the config
  check (a config error is then reported, not the signal); a rank that is reporting its own failure ignores signals;
  and a start-up stop on rank 0 reports another rank's logged error instead of "stopped" when there is one.
- The launcher (``deepspeed``, its per-node ``deepspeed.launcher.launch``, or ``torchrun``) forwards SIGTERM/SIGINT
  to the ranks, or dies of the signal without forwarding it (``deepspeed`` itself ends on SIGTERM/SIGUSR1 and leaves
  its ranks running). So every rank also watches its launcher: when it is gone, the rank stops as if signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from pipeline.train.deepspeed_ops import exit_after_builds

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
DS_NODE_LAUNCHER = "deepspeed.launcher.launch"  # the ``deepspeed`` command's per-node child, the ranks' parent


def _parent_of(pid: int) -> int | None:
    """The parent pid from /proc (Linux); None when ``pid`` is gone or /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launcher_chain() -> list[tuple[int, int]]:
    """(pid, its parent) pairs to watch: this rank's parent, and when that is DeepSpeed's per-node launcher, the
    ``deepspeed`` command above it too. A pair whose pid got another parent means that parent died."""
    chain = [(os.getpid(), os.getppid())]
    if DS_NODE_LAUNCHER in _cmdline(os.getppid()):
        grand = _parent_of(os.getppid())
        if grand is not None:
            chain.append((os.getppid(), grand))
    return [(pid, parent) for pid, parent in chain if parent > 1]


class StopRequest:
    """Created first thing in a rank (this module imports nothing heavy, so a signal early in start-up is handled
    too). Its periods: the signal is held until :meth:`config_checked`, then "exit now" until
    :meth:`training_started`, then "checkpoint, then exit"; :meth:`failing` holds it for good."""

    def __init__(self, rank: int, poll_s: float = 1.0):
        self.rank = rank
        self.reason: str | None = None
        self._period = "config"  # config -> start-up -> training; or failing
        self._run_dir: str | None = None
        self._started = time.time()
        self._group = None  # the process group the ranks agree over (:meth:`agreed`)
        self._closed = threading.Event()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        self._see_signals_in_c_calls()
        chain = launcher_chain()
        if chain:
            threading.Thread(target=self._watch, args=(chain, poll_s), daemon=True, name="launcher-watch").start()

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def _handle(self, signum, frame) -> None:
        self._stop(signal.Signals(signum).name)
        # the request stands; repeats (launch/slurm/train.sbatch resends USR1) are ignored, since Python restores
        # default handlers at exit and a late USR1 would then kill a rank that stopped cleanly
        signal.signal(signum, signal.SIG_IGN)

    def _see_signals_in_c_calls(self) -> None:
        """Python runs a handler only when the main thread is back in bytecode, so a rank blocked in the rendezvous
        (rank 0 failed, or its store never answers) saw the launcher's SIGTERM only as the SIGKILL 30 s later. The
        wakeup fd tells a thread of each signal at once; in start-up it exits the rank as the handler would."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._wakeup = (signal.set_wakeup_fd(write, warn_on_full_buffer=False), write)  # (the one before, ours)
        threading.Thread(target=self._wake, args=(read,), daemon=True, name="signal-wake").start()

    def _wake(self, fd: int) -> None:
        stops = {int(s) for s in STOP_SIGNALS}
        while data := os.read(fd, 64):  # b"": :meth:`close` closed the write end
            for signum in data:
                if signum in stops and self._period == "start-up":
                    self._stop(signal.Signals(signum).name)
        os.close(fd)

    def _watch(self, chain: list[tuple[int, int]], poll_s: float) -> None:
        while not self._closed.wait(poll_s):
            for pid, parent in chain:
                if _parent_of(pid) != parent:
                    self._stop(f"the launcher's exit (pid {parent})")
                    return

    def _stop(self, why: str) -> None:
        """Exit 0 in start-up, as a stop with a checkpoint does: launch/slurm/train.sbatch requeues a run whose
        ranks stopped cleanly. Held (only recorded) before the config check, in training and while failing."""
        self.reason = self.reason or why
        if self._period == "start-up":
            self._exit_in_start_up()

    def _exit_in_start_up(self) -> None:
        """Exit now, or, while this process holds a lock of DeepSpeed's op build, once the build releases it (an
        exit that left it would hang every later start of the run on it)."""
        if not exit_after_builds(self._exit_now):
            self._exit_now()

    def _exit_now(self) -> None:
        if self.rank == 0:
            other = self._other_rank_failure()
            if other is not None:  # the signal is the launcher's answer to that failure: report the failure
                print(f"error: {other[0]}\n(traceback: {other[1]})", file=sys.stderr, flush=True)
                os._exit(1)
            print(f"stopped during start-up on {self.reason}; nothing was trained in this start: run the same "
                  f"command again to continue", file=sys.stderr, flush=True)
        os._exit(0)

    def _other_rank_failure(self) -> tuple[str, str] | None:
        if self._run_dir is None:
            return None
        from pipeline.train.errors import (
            first_other_failure,  # torch is loaded by now: the config check imports it
        )

        return first_other_failure(self._run_dir, self._started, wait_s=0.0)

    def close(self) -> None:
        """End the watching threads and give the wakeup fd back: the entry's ``main`` calls it as it returns, so it
        can run in one process again and again (the tests' in-process checks) without a thread left per call. The
        signal handlers stay: a signal until the exit is still this request's."""
        self._closed.set()
        before, ours = self._wakeup
        if signal.set_wakeup_fd(before) == ours:
            os.close(ours)

    def config_checked(self, run_dir: str) -> None:
        """The config is valid: a held signal stops the rank now, and later ones at once."""
        self._run_dir, self._period = run_dir, "start-up"
        if self.requested:
            self._exit_in_start_up()

    def failing(self) -> None:
        """The rank is reporting its own failure, which must not be lost to the signal that failure causes."""
        self._period = "failing"

    def training_started(self) -> None:
        self._period = "training"

    def agreed(self) -> bool:
        """All ranks must stop at the same step: a signal may reach them at different times. The ranks agree over a
        CPU (gloo) group, so agreeing waits for no device's queue (an NCCL all-reduce and its read-back would, at
        every step); one rank agrees with itself."""
        import torch
        import torch.distributed as dist

        if dist.get_world_size() == 1:
            return self.requested
        if self._group is None:  # every rank calls this at the same steps, so every rank creates the group here
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        flag = torch.tensor([float(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
