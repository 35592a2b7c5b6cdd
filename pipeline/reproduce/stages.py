"""The step runner of ``make reproduce`` (:class:`Stages`): each step from the repository root, its output and its
child processes' appended to a log, its seconds counted per stage, this invocation's and, in OUT's ledger, every
invocation's."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

from pipeline.experiment import REPO
from pipeline.io import read_json, write_json_atomic
from pipeline.reproduce.invocation import Reproduction


@contextlib.contextmanager
def _in_repo_logged_to(log: str) -> Iterator[None]:
    """Run the body from the repository root with everything it and its child processes print appended to ``log``
    (file descriptors 1 and 2 and sys.stdout/sys.stderr), a failure's traceback too; then restore both."""
    sys.stdout.flush()
    sys.stderr.flush()
    cwd, saved = os.getcwd(), (os.dup(1), os.dup(2))
    with open(log, "a", buffering=1) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            os.chdir(REPO)
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                try:
                    yield
                except BaseException:
                    traceback.print_exc()
                    raise
        finally:
            os.chdir(cwd)
            f.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


class Stages:
    """Runs each step from the repository root, its output appended to logs/STAGE.log, and counts its seconds: this
    invocation's per stage (``timings``) and, at once, every invocation's in OUT's ledger (a run killed later keeps
    both)."""

    def __init__(self, r: Reproduction):
        self.logs, self.out, self.ledger = r.logs, r.out, r.ledger
        self.timings: dict[str, float] = {}  # this invocation's seconds per stage
        self.mark = time.time()  # the time "total" has been counted up to

    def run(self, stage: str, what: str, step: Callable[[], None]) -> None:
        """Run a step; a failure stops with the log named (relative paths of the steps are the repository's)."""
        log = os.path.join(self.logs, f"{stage}.log")
        os.makedirs(self.logs, exist_ok=True)
        print(f"== {stage}: {what} (log: {log})", flush=True)
        t0 = time.time()
        try:
            with _in_repo_logged_to(log):
                step()
        except Exception as e:
            raise RuntimeError(f"{stage} failed ({type(e).__name__}: {e}); see {log}, fix it and run the same "
                               "command again (finished steps are skipped)") from e
        finally:
            self.spend({stage: time.time() - t0})

    def spend(self, seconds: dict[str, float]) -> dict[str, float]:
        """Add ``seconds`` per stage, and the time since the last call as "total", to this invocation's timings and
        to OUT's ledger; returns the ledger."""
        now, spent = time.time(), self.spent()
        for stage, s in {**seconds, "total": now - self.mark}.items():
            self.timings[stage] = round(self.timings.get(stage, 0.0) + s, 1)
            spent[stage] = round(spent.get(stage, 0.0) + s, 1)
        self.mark = now
        os.makedirs(self.out, exist_ok=True)
        write_json_atomic(self.ledger, {"stages_s": spent})
        return spent

    def spent(self) -> dict[str, float]:
        """Seconds per stage over the invocations that wrote OUT (none yet: empty)."""
        if not os.path.isfile(self.ledger):
            return {}
        return read_json(self.ledger, "remove it to count from zero", what="timings ledger")["stages_s"]
