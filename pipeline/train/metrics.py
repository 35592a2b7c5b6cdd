"""Rank-0 progress: one compact line every N steps, the same numbers in metrics.jsonl and the trackers
(TensorBoard, W&B, MLflow: ``pipeline.train.trackers``), a final summary."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
from dataclasses import dataclass

import torch

from pipeline.run_dir import RunDir
from pipeline.tasks import SPECS
from pipeline.train.fit_summary import FitSummary
from pipeline.train.trackers import Trackers, TrackersSpec

# on the eval line: the headline scores of every task that runs during training (eval.evaluators)
EVALUATOR_SCALARS = tuple(f"eval/{key}" for spec in SPECS.values() if spec.in_training for key in spec.keys)


def memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@dataclass(frozen=True)
class Throughput:
    """The ``perf/*`` scalars of a step: tokens per second, the share spent waiting for data, the step's model FLOPs
    (``pipeline.model.flops.work_flops``) per token, MFU (those FLOPs against ``world`` devices' dense peak; 0
    without a known peak) and peak memory. bench/gpu reports its rows through this too, so the log and the bench
    agree on one config."""
    peak_tflops: float
    world: int

    def scalars(self, tokens: int, seconds: float, data_seconds: float, flops: float) -> dict[str, float]:
        mfu = flops / seconds / (self.world * self.peak_tflops * 1e12) if self.peak_tflops else 0.0
        return {"perf/tokens_per_s": tokens / seconds, "perf/data_wait": data_seconds / seconds,
                "perf/flops_per_token": flops / max(tokens, 1), "perf/mfu": mfu, "perf/mem_gib": memory_gib()}


class MetricsLogger:
    """``start_step``: the step training continues from; lines of later steps (logged before the checkpoint the
    run resumes from was overtaken by a kill) are dropped, so a replayed step is in ``metrics.jsonl`` once.
    ``trackers``: the trackers that get the scalars too (None: TensorBoard alone)."""

    def __init__(self, run: RunDir, enabled: bool, log_every: int, start_step: int = 0,
                 trackers: TrackersSpec | None = None):
        self.run, self.enabled, self.log_every = run, enabled, log_every
        self.trackers = None
        self.history_path = run.metrics
        if enabled:
            logged_until = _drop_after(self.history_path, start_step)
            self.trackers = Trackers(trackers or TrackersSpec(), run, start_step, logged_until)
        self.start = time.time()

    def log(self, step: int, scalars: dict[str, float], phase: str) -> None:
        """Every step goes to the trackers, then metrics.jsonl (so a kill between them leaves no tracker short
        of a step the restart counts as logged); every ``log_every``-th step, and every step with a validation
        (``eval/*``), also to stdout."""
        if not self.enabled:
            return
        self.trackers.log(step, scalars)
        with open(self.history_path, "a") as f:
            f.write(json.dumps({"step": step, "phase": phase, **scalars}) + "\n")
        if step % self.log_every == 0 or step == 1:
            losses = " ".join(f"{k.split('/', 1)[1]}={v:.4f}" for k, v in scalars.items() if k.startswith("loss/"))
            mfu = f" mfu={scalars['perf/mfu']:.1%}" if scalars.get("perf/mfu") else ""
            skipped = f" skipped={scalars['optim/skipped_steps']}" if scalars.get("optim/skipped_steps") else ""
            ratios = "".join(f" {k}={v:.3f}" for k, v in scalars.items() if k.startswith("mask_ratio/"))
            print(f"step {step:>6} [{phase}] {losses}{ratios} lr={scalars['optim/lr']:.2e} "
                  f"gnorm={scalars['optim/grad_norm']:.3f}{skipped} tok/s={scalars['perf/tokens_per_s']:,.0f}{mfu} "
                  f"data_wait={scalars['perf/data_wait']:.1%} mem={scalars['perf/mem_gib']:.2f}GiB", flush=True)
        if "eval/seconds" in scalars:
            shown = " ".join(f"{k.split('/', 1)[1]}={v:.4f}" for k, v in scalars.items()
                             if k.startswith(("eval/loss/", "eval/probe/", "eval/probe_ppl/", *EVALUATOR_SCALARS)))
            print(f"eval {step:>6} [{phase}] {shown} ({scalars['eval/seconds']:.1f}s)", flush=True)

    def close(self, summary: FitSummary) -> FitSummary:
        """Close the trackers, draw loss.png and print the summary line (rank 0); returns ``summary`` with the
        plot's path."""
        if not self.enabled:
            return summary
        self.trackers.close()
        summary = dataclasses.replace(summary, loss_plot=plot_losses(self.history_path, self.run.loss_plot))
        print(summary.line(), flush=True)
        return summary


def _drop_after(path: str, step: int) -> int:
    """Rewrite ``path`` (atomically) without the records of steps after ``step``; returns the newest step it held
    (0 when none)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    steps = [_step_of(line) for line in lines]
    newest = max((s for s in steps if s != float("inf")), default=0)
    kept = [line for line, s in zip(lines, steps) if s <= step]
    if len(kept) == len(lines):
        return newest
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return newest


def _step_of(line: str) -> float:
    """A record's step; a line torn by a kill counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")


def plot_losses(history_path: str, out: str) -> str:
    """loss.png: every objective's loss against the step (a resumed run's replayed steps keep their last value),
    the validation losses and probes as dashed lines with a marker at each evaluation, and the phase boundaries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step: dict[int, dict] = {}
    with open(history_path) as f:
        for line in f:
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({k for r in by_step.values() for k in r if k.startswith(("loss/", "eval/loss/", "eval/probe/"))}):
        xs = [s for s in steps if key in by_step[s]]
        held_out = key.startswith("eval/")
        ax.plot(xs, [by_step[s][key] for s in xs], label=key.split("/", 1)[1] if not held_out else key,
                **({"linestyle": "--", "marker": "o", "markersize": 3} if held_out else {}))
    for prev, cur in zip(steps, steps[1:]):
        if by_step[cur]["phase"] != by_step[prev]["phase"]:
            ax.axvline(cur, color="grey", linestyle=":")
            ax.text(cur, ax.get_ylim()[1], f" {by_step[cur]['phase']}", va="top", fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per target token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
