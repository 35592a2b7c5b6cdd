"""A sweep's status: each run's state (new, started, queued, finished) and the table the sweep prints."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.grid import Variant
from pipeline.io import REPO
from pipeline.model.presets import PRESETS
from pipeline.objectives import OBJECTIVES
from pipeline.run_dir import RunDir


@dataclass(frozen=True)
class RunState:
    progress: str  # new | started | queued | finished
    step: int = 0  # newest complete checkpoint
    job: int | None = None  # SLURM job id of a queued run

    def describe(self, steps: int) -> str:
        if self.progress == "queued":
            return f"queued (job {self.job}, step {self.step}/{steps})"
        return {"new": "new", "finished": "finished"}.get(self.progress, f"started (step {self.step}/{steps})")


def run_dir(variant: Variant) -> RunDir:
    """The variant's run directory from wherever the sweep runs: its ``run_dir`` is relative to the repository root
    (where the jobs run) when inside the repository, so that the records it writes read the same in every clone."""
    return RunDir(os.path.join(REPO, variant.experiment.run_dir))


def is_finished(variant: Variant) -> bool:
    """Trained to the last step and, when the run exports, its HF directory written."""
    exp, run = variant.experiment, run_dir(variant)
    return run.latest_complete() == exp.train.steps and (not exp.train.export_hf or run.has_hf())


def run_states(variants: list[Variant], queued: dict[str, int]) -> dict[str, RunState]:
    states = {}
    for v in variants:
        step = run_dir(v).latest_complete() or 0
        if is_finished(v):
            states[v.name] = RunState("finished", step)
        elif v.name in queued:
            states[v.name] = RunState("queued", step, queued[v.name])
        else:
            states[v.name] = RunState("started" if step else "new", step)
    return states


def _objective_label(spec) -> str:
    return f"{spec.name}{round(spec.ratio * 100)}" if OBJECTIVES[spec.name].masks else spec.name


def phases_label(variant: Variant) -> str:
    """``clm 3000 -> mlm40 9000``: each phase's objectives and length in steps."""
    exp = variant.experiment
    ends = [*exp.phase_starts()[1:], exp.train.steps]
    return " -> ".join(f"{'+'.join(_objective_label(o) for o in p.objectives)} {end - start}"
                       for p, start, end in zip(exp.phases, exp.phase_starts(), ends))


def tokens_label(variant: Variant) -> str:
    t, r = variant.experiment.train, variant.resources
    tokens = t.steps * t.global_batch(r.world_size) * variant.experiment.data.seq_len
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.1f}{unit}"
    return str(tokens)


def table(variants: list[Variant], states: dict[str, RunState]) -> str:
    header = ("run", "model", "steps", "tokens", "phases", "starts from", "state")
    rows = []
    for v in variants:
        m = v.experiment.model
        model = m.shape or (m.init if m.init in PRESETS else os.path.basename(m.init.rstrip("/")))
        rows.append((v.name, model, str(v.experiment.train.steps), tokens_label(v), phases_label(v),
                     ", ".join(v.after) or "-", states[v.name].describe(v.experiment.train.steps)))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
