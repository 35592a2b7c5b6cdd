"""The chaos soak: train on 2 CPU ZeRO-3 ranks while a seeded driver kills a random rank at random times, restart
after each kill, and check the losses and checkpoints against an uninterrupted run of the same config.

The job is ``make demo``'s: the ``deepspeed`` command, ``ds_configs/zero3.json``, the default experiment (the tiny
preset, CLM, the sample corpus's shards), with the overrides below (more steps per checkpoint, every step logged,
``checkpoint.async_save``, no HF export). The faults, one per restart, drawn in turn from a seeded shuffle of:

- ``SIGKILL``: a random rank, a random time into a random step;
- ``SIGTERM``: the same, to the rank alone (it and the others must stop at one step with a checkpoint);
- ``SIGKILL mid-write``: a random rank killed by the checkpointer's own fault hook (``PIPELINE_FAULT``,
  pipeline/train/async_checkpoint.py) while its writer thread writes a checkpoint's files, after the first;
- ``full disk``: the run directory lives on a tmpfs of its own (mounted here; needs root, else this kind is left
  out and said so), filled before a start with a ballast file up to half a checkpoint short of the next save;
  the save fails, the job exits, the ballast goes.

Checked at the end, failing the soak (exit 1) otherwise: every loss ever logged, replayed steps included, equals
the uninterrupted run's at that step bit for bit; no checkpoint marked ``COMPLETE`` disappeared except by the
keep_last pruning; every restart resumed from the newest complete checkpoint; no launch hung. It prints the kills
survived and the steps repeated per kill, and writes ``OUT/summary.json``. Figures: docs/reliability.md, "Chaos soak".

    python bench/chaos_soak.py --kills 20 --seed 0 --out /tmp/soak/long
    python bench/chaos_soak.py --kills 4 --out /tmp/soak/short --set data.seq_len=64   # the slow suite's short form
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from helpers import training_launch  # noqa: E402  (the suite's launch: the rendezvous port held while it runs)

from pipeline.eval.report.runs import read_history  # noqa: E402
from pipeline.run_dir import RunDir  # noqa: E402
from pipeline.train.signals import DS_NODE_LAUNCHER  # noqa: E402

KINDS = ("SIGKILL", "SIGTERM", "SIGKILL mid-write", "full disk")
FIRST_STEP_S = 0.1  # the step time assumed until two logged steps of a launch are seen: shorter is safe (earlier)
LAUNCH_TIMEOUT_S = 900  # a launch still running this long after its fault (or its start) counts as a hang
SETTINGS = ["train.log_every=1", "checkpoint.async_save=true", "train.export_hf=false"]


@dataclasses.dataclass
class Kill:
    """One fault and what followed it."""
    kind: str
    rank: int  # -1: every rank
    target: int  # the step it was aimed at (for mid-write and full disk: the checkpoint's step)
    logged_until: int = 0  # the newest step the killed job logged
    resumed_from: int = 0  # the newest complete checkpoint when it ended (the next start resumes there)
    exit_status: int | None = None

    @property
    def repeated(self) -> int:
        return max(self.logged_until - self.resumed_from, 0)


class Soak:
    """The driver over one run directory: launches, faults, and what it saw of the checkpoints."""

    def __init__(self, out: str, overrides: list[str], steps: int, every: int, rng: random.Random):
        self.out, self.steps, self.every, self.rng = out, steps, every, rng
        self.overrides = [*SETTINGS, f"train.steps={steps}", f"checkpoint.every={every}", *overrides]
        self.keep_last = next((int(o.split("=", 1)[1]) for o in reversed(self.overrides)
                               if o.startswith("checkpoint.keep_last=")), 2)
        self.seen_complete: set[int] = set()
        self.problems: list[str] = []
        self.logged: list[dict[str, dict[int, float]]] = []  # each launch's losses, before the next start drops any
        self.launches = 0
        self.launched_at = 0.0
        self.step_s = FIRST_STEP_S  # seconds a training step took, as the last launch was seen logging them
        self.checkpoint_bytes = 0  # one checkpoint of the uninterrupted run: what the full disk is sized by

    @contextlib.contextmanager
    def launch(self, run_dir: str, env: dict | None = None):
        """The job (the ``deepspeed`` command) running in the block, its output appended to OUT/launches.log."""
        self.launches += 1
        self.launched_at = time.time()
        with (training_launch(run_dir, None, *self.overrides, launcher="deepspeed", env=env) as (cmd, launch_env),
              open(os.path.join(self.out, "launches.log"), "a") as log):
            log.write(f"\n==== launch {self.launches}: {' '.join(cmd)} {env or ''}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=launch_env,
                                    start_new_session=True)
            try:
                yield proc
            finally:
                self.end(proc)

    def end(self, proc: subprocess.Popen) -> None:
        """Wait for the job; a hang is a problem, and its processes are killed."""
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.problems.append(f"launch {self.launches} hung: still running {LAUNCH_TIMEOUT_S} s later")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def watch(self, run: RunDir) -> None:
        """Record the complete checkpoints now; a step seen complete must stay so unless keep_last newer ones are."""
        now = set(run.complete_steps())
        for step in sorted(self.seen_complete - now):
            if len([s for s in now if s > step]) < self.keep_last:
                self.problems.append(f"the complete checkpoint of step {step} disappeared (complete now: "
                                     f"{sorted(now)})")
        self.seen_complete |= now

    def wait_for(self, run: RunDir, proc: subprocess.Popen, step: int) -> bool:
        """Wait until the job has logged ``step`` (itself: the killed launch before it may have, and the job drops
        those records only once it has started); False when it ended first. Meanwhile ``step_s`` follows the time
        between two newly logged steps of this launch (the first one's wait is its start-up, not a step)."""
        seen, at = None, 0.0
        while proc.poll() is None:
            self.watch(run)
            newest = newest_logged(run)
            if os.path.exists(run.metrics) and os.stat(run.metrics).st_mtime > self.launched_at:
                if seen is not None and newest > seen:
                    self.step_s = (time.monotonic() - at) / (newest - seen)
                if newest != seen:
                    seen, at = newest, time.monotonic()
                if newest >= step:
                    return True
            time.sleep(0.05)
        return False

    def record_losses(self, run: RunDir) -> None:
        """Keep what this launch logged (whole lines only: a kill may tear the last one)."""
        if not os.path.exists(run.metrics):
            return
        whole = os.path.join(self.out, "metrics-whole-lines.jsonl")
        with open(run.metrics) as f, open(whole, "w") as w:
            w.writelines(line for line in f if line.endswith("\n"))
        self.logged.append(read_history(whole))

    def strike(self, run: RunDir, kill: Kill, disk: str | None) -> None:
        """One launch that ends in ``kill``."""
        env = {"PIPELINE_FAULT": f"kill-mid-write:{kill.target}:{kill.rank}"} if kill.kind == "SIGKILL mid-write" \
            else None
        ballast = os.path.join(disk, "ballast") if kill.kind == "full disk" else None
        if ballast:
            fill(ballast, run, self.checkpoint_bytes // 2)
        with self.launch(run.path, env) as proc:
            if kill.kind in ("SIGKILL", "SIGTERM") and self.wait_for(run, proc, kill.target):
                # a random time into the next step: a fixed delay could outlast the run's last steps on a fast
                # machine (0.2 s a step here), and the kill would miss
                time.sleep(self.rng.uniform(0.0, 1.0) * self.step_s)
                victim = rank_processes(proc).get(kill.rank)  # None when it failed meanwhile: its exit shows why
                if victim is not None:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        victim.send_signal(getattr(signal, kill.kind))
            else:
                self.wait_for(run, proc, self.steps + 1)
        if ballast:
            os.remove(ballast)
        kill.exit_status = proc.returncode
        self.watch(run)
        self.record_losses(run)
        kill.logged_until = newest_logged(run)
        kill.resumed_from = run.latest_complete() or 0

    def draw(self, kind: str, start: int) -> Kill:
        """The next fault of ``kind`` on a random rank, aimed 1..2 checkpoint intervals past ``start`` (a
        mid-write kill at the second checkpoint after it, so that the first can complete)."""
        rank = self.rng.randrange(2) if kind != "full disk" else -1  # a full disk meets every rank
        if kind in ("SIGKILL mid-write", "full disk"):
            saves = 2 if kind == "SIGKILL mid-write" else 1
            return Kill(kind, rank, min((start // self.every + saves) * self.every, self.steps))
        return Kill(kind, rank, min(start + self.rng.randint(1, 2 * self.every), self.steps - 1))


def newest_logged(run: RunDir) -> int:
    """The newest step in ``metrics.jsonl`` (0 when none; a line torn by a kill is skipped)."""
    if not os.path.exists(run.metrics):
        return 0
    steps = [0]
    with open(run.metrics) as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError):
                steps.append(int(json.loads(line)["step"]))
    return max(steps)


def rank_processes(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """Rank -> the training process of that rank under the launcher ``proc``: a child of DeepSpeed's per-node
    launcher (not a process a rank forks)."""
    ranks = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if DS_NODE_LAUNCHER in " ".join(child.parent().cmdline()):
                ranks[int(child.environ()["RANK"])] = child
    return ranks


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def fill(ballast: str, run: RunDir, leave: int) -> None:
    """Write ``ballast`` so that ``leave`` bytes stay free once the next start has dropped the run's half-written
    checkpoints."""
    complete = set(run.complete_steps())
    half_written = sum(directory_bytes(run.checkpoint(s)) for s in run.checkpoint_steps() if s not in complete)
    size = shutil.disk_usage(os.path.dirname(ballast)).free + half_written - leave
    with open(ballast, "wb") as f:
        for _ in range(size >> 20):
            f.write(bytes(1 << 20))


@contextlib.contextmanager
def small_disk(path: str, size_bytes: int):
    """A tmpfs of ``size_bytes`` at ``path`` (None, said once, where it cannot be mounted: not root)."""
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        print(f"no full-disk faults: cannot mount a tmpfs at {path} ({proc.stderr.strip() or proc.returncode})")
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", path], capture_output=True)


def compare(baseline: dict[str, dict[int, float]], launches: list[dict[str, dict[int, float]]]) -> tuple[int, list]:
    """(loss values compared, the differing ones as (launch, key, step, value, baseline's))."""
    compared, differ = 0, []
    for i, history in enumerate(launches, 1):
        for key, steps in history.items():
            for step, value in steps.items():
                compared += 1
                if baseline.get(key, {}).get(step) != value:
                    differ.append((i, key, step, value, baseline.get(key, {}).get(step)))
    return compared, differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="faults to inject (one per restart)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the faults' kinds, ranks and times")
    ap.add_argument("--every", type=int, default=5, help="checkpoint.every")
    ap.add_argument("--steps", type=int, default=0, help="train.steps (0: every x (kills + 3))")
    ap.add_argument("--out", required=True, help="a new directory for the runs, the launches' log and summary.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an experiment override for both runs (e.g. data.shards=..., data.seq_len=64)")
    args = ap.parse_args()
    steps = args.steps or args.every * (args.kills + 3)
    os.makedirs(args.out)
    rng = random.Random(args.seed)
    soak = Soak(args.out, args.set, steps, args.every, rng)

    started = time.time()
    base = RunDir(os.path.join(args.out, "uninterrupted"))
    with soak.launch(base.path) as proc:
        pass
    if proc.returncode != 0 or newest_logged(base) != steps:
        print(f"the uninterrupted run failed (exit {proc.returncode}); see {args.out}/launches.log")
        return 1
    baseline_s = time.time() - started
    soak.checkpoint_bytes = directory_bytes(base.checkpoint(steps))
    checkpoints = steps // args.every + soak.keep_last + 2

    started = time.time()
    kills: list[Kill] = []
    with small_disk(os.path.join(args.out, "disk"), soak.checkpoint_bytes * checkpoints + (64 << 20)) as disk:
        run = RunDir(os.path.join(disk or args.out, "soak"))
        kinds = [k for k in KINDS if disk or k != "full disk"]
        order: list[str] = []
        while len(kills) < args.kills and (run.latest_complete() or 0) < steps:
            if not order:
                order = rng.sample(kinds, len(kinds))
            start = run.latest_complete() or 0
            kill = soak.draw(order.pop(0), start)
            if kill.kind in ("SIGKILL", "SIGTERM") and kill.target <= start:
                break  # too few steps left to aim at
            soak.strike(run, kill, disk)
            kills.append(kill)
            if kill.exit_status == 0 and (kill.kind != "SIGTERM" or kill.logged_until == steps):
                soak.problems.append(f"kill {len(kills)} ({kill.kind}) missed: the job ended as if untouched")
            if kill.resumed_from != max(soak.seen_complete, default=0):
                soak.problems.append(f"after kill {len(kills)} the newest complete checkpoint is "
                                     f"{kill.resumed_from}, but {max(soak.seen_complete)} was complete")
            who = f"rank {kill.rank}" if kill.rank >= 0 else "every rank"
            print(f"kill {len(kills)}/{args.kills}: {kill.kind} {who} at step {kill.target} (exit "
                  f"{kill.exit_status}, logged up to step {kill.logged_until}): resumes from step "
                  f"{kill.resumed_from}, {kill.repeated} steps repeated", flush=True)
        with soak.launch(run.path) as proc:
            soak.wait_for(run, proc, steps + 1)
        soak.watch(run)
        soak.record_losses(run)
        if proc.returncode != 0 or newest_logged(run) != steps or run.latest_complete() != steps:
            soak.problems.append(f"the last launch did not finish the run (exit {proc.returncode}, logged up to step "
                                 f"{newest_logged(run)}, newest complete checkpoint {run.latest_complete()})")
        final, kept = read_history(run.metrics), run.complete_steps()
    soak_s = time.time() - started

    expected = read_history(base.metrics)
    compared, differ = compare(expected, soak.logged)
    if final != expected:
        soak.problems.append("the soaked run's metrics.jsonl differs from the uninterrupted run's")
    soak.problems += [f"launch {i}: {key} at step {step} is {value!r}, uninterrupted {ref!r}"
                      for i, key, step, value, ref in differ[:10]]
    if len(kills) < args.kills:
        soak.problems.append(f"only {len(kills)} of {args.kills} kills fit in {steps} steps; raise --steps")
    repeated = [k.repeated for k in kills]
    by_kind = {kind: sum(k.kind == kind for k in kills) for kind in KINDS}
    print(f"kills survived: {len(kills)} of {args.kills} ("
          + ", ".join(f"{kind} {n}" for kind, n in by_kind.items()) + ")")
    if repeated:
        print(f"steps repeated per kill: mean {sum(repeated) / len(repeated):.1f}, max {max(repeated)} "
              f"(each: {' '.join(map(str, repeated))})")
    print(f"losses: {compared} values logged over {soak.launches - 1} launches, "
          f"{'bit-identical to' if not differ else f'{len(differ)} differ from'} the uninterrupted run's {steps} steps")
    print(f"complete checkpoints seen: {sorted(soak.seen_complete)}; kept: {kept}")
    print(f"wall time: {soak_s:.0f} s soaked, {baseline_s:.0f} s uninterrupted")
    summary = {"kills": [dataclasses.asdict(k) | {"repeated": k.repeated} for k in kills], "kills_asked": args.kills,
               "by_kind": by_kind, "steps": steps, "every": args.every, "seed": args.seed,
               "losses_compared": compared, "losses_differing": len(differ), "launches": soak.launches,
               "complete_seen": sorted(soak.seen_complete), "problems": soak.problems,
               "soak_s": round(soak_s), "uninterrupted_s": round(baseline_s)}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for problem in soak.problems:
        print(f"problem: {problem}")
    return 1 if soak.problems else 0


if __name__ == "__main__":
    sys.exit(main())
