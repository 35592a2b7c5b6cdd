"""The step runner of ``make reproduce`` (:class:`Stages`): each step from the repository root, its output and its
child processes' appended to a log (this machine's paths replaced once it ends: the logs are committed), its seconds
counted per stage, this invocation's and, in OUT's ledger, every invocation's."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

from pipeline.io import REPO, read_json, write_json_atomic
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


def machine_paths(r: Reproduction) -> dict[str, str]:
    """What a log says instead of this machine's absolute paths, longest first: the interpreter is ``python``; the
    run and results directories outside the repository are ``$OUT`` and ``$RESULTS``; anything in the repository
    is relative to it (the steps run from its root)."""
    paths = {sys.executable: "python"}
    for where, name in ((r.results, "$RESULTS"), (r.out, "$OUT")):
        if os.path.isabs(where) and os.path.commonpath([REPO, os.path.abspath(where)]) != REPO:
            paths[os.path.abspath(where)] = name
    paths[REPO + os.sep] = ""
    return dict(sorted(paths.items(), key=lambda item: -len(item[0])))


def make_portable(log: str, start: int, paths: dict[str, str]) -> None:
    """Rewrite what ``log`` holds from byte ``start`` on with ``paths`` replaced, so a committed log names no
    machine's directories."""
    with open(log, "rb+") as f:
        f.seek(start)
        text = f.read()
        for path, name in paths.items():
            text = text.replace(os.fsencode(path), os.fsencode(name))
        f.seek(start)
        f.write(text)
        f.truncate()


class Stages:
    """Runs each step from the repository root, its output appended to logs/STAGE.log, and counts its seconds: this
    invocation's per stage (``timings``) and, at once, every invocation's in OUT's ledger (a run killed later keeps
    both)."""

    def __init__(self, r: Reproduction):
        self.logs, self.out, self.ledger = r.logs, r.out, r.ledger
        self.paths = machine_paths(r)
        self.timings: dict[str, float] = {}  # this invocation's seconds per stage
        self.mark = time.time()  # the time "total" has been counted up to

    def run(self, stage: str, what: str, step: Callable[[], None]) -> None:
        """Run a step; a failure stops with the log named (relative paths of the steps are the repository's). What
        the step wrote to the log names no absolute path of this machine once it ends (:func:`machine_paths`)."""
        log = os.path.join(self.logs, f"{stage}.log")
        os.makedirs(self.logs, exist_ok=True)
        print(f"== {stage}: {what} (log: {log})", flush=True)
        t0, start = time.time(), os.path.getsize(log) if os.path.exists(log) else 0
        try:
            with _in_repo_logged_to(log):
                step()
        except Exception as e:
            raise RuntimeError(f"{stage} failed ({type(e).__name__}: {e}); see {log}, fix it and run the same "
                               "command again (finished steps are skipped)") from e
        finally:
            make_portable(log, start, self.paths)
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
