"""The studies over training steps: each run's evaluated numbers at its kept checkpoints (``checkpoint.keep_every``,
evaluated into ``RUN/eval/stepN/STUDY.json``) and at its end, placed at the steps of the whole chain (a run that
starts from another run's export, as SimCSE from MNTP's, continues that run's axis), the claims' verdicts at each
budget, and one PNG of the numbers against steps per study.

The papers' own figures read this way (LLM2Vec's STS against steps, MAGNET's repetition): where an ordering appears,
holds or flips says more than the last point."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.eval.report.runs import continued_from  # noqa: E402
from pipeline.eval.results import EvalResults  # noqa: E402
from pipeline.run_dir import RunDir  # noqa: E402

Curve = dict[int, dict[str, float]]  # steps of the chain -> headline numbers there


def chain_offset(run: RunDir) -> int:
    """Steps trained before this run's first step: those of the run it started from, and of that run's start."""
    start = continued_from(run)
    return 0 if start is None else start.experiment().train.steps + chain_offset(start)


def kept_steps(run: RunDir) -> list[int]:
    """The run's complete checkpoints before its last step (its end is read through its export)."""
    return [s for s in run.complete_steps() if s < run.experiment().train.steps]


def evaluated_steps(run: RunDir, study: str) -> list[int]:
    """The steps before the run's last whose checkpoint has results for ``study`` (``eval/stepN/``): the kept
    checkpoints evaluated, which a run's records keep without the checkpoints."""
    steps = {int(os.path.basename(os.path.dirname(p)).removeprefix("step")) for p in run.step_eval_results()
             if os.path.basename(p) == f"{study}.json"}
    return sorted(s for s in steps if s < run.experiment().train.steps)


def run_curve(run: RunDir, study: str) -> Curve:
    """The run's numbers for ``study`` at each evaluated kept checkpoint and at its end, on the chain's steps; a
    continued run starts at its start's end (the export it trained from)."""
    offset, curve, start = chain_offset(run), {}, continued_from(run)
    if start is not None and os.path.isfile(start.eval_results(study)):
        curve[offset] = EvalResults.read(start.eval_results(study)).headline
    last = run.experiment().train.steps
    for step in [*evaluated_steps(run, study), None]:
        path = run.eval_results(study, step)
        if os.path.isfile(path):
            curve[offset + (last if step is None else step)] = EvalResults.read(path).headline
    return curve


def over_steps(better: Curve, worse: Curve, key: str, lower_is_better: bool) -> str:
    """Where "better beats worse" holds along the steps both curves have ``key`` at, e.g. "reproduced at 96, 144;
    not reproduced at 192" (one run each: the sign of the difference); "—" without a common step. A step where both
    read the same model (a continued run's start is the end of the run it continued) compares nothing."""
    at: dict[str, list[int]] = {}
    for x in sorted(set(better) & set(worse)):
        a, b = better[x].get(key), worse[x].get(key)
        if a is None or b is None or better[x] == worse[x]:
            continue
        diff = (b - a) if lower_is_better else (a - b)
        at.setdefault("reproduced" if diff > 0 else "not reproduced" if diff < 0 else "tied", []).append(x)
    return "; ".join(f"{verdict} at {', '.join(map(str, xs))}" for verdict, xs in at.items()) or "—"


def plot_curves(curves: dict[str, Curve], constants: dict[str, dict[str, float]], keys: list[tuple[str, str]],
                path: str, title: str) -> str | None:
    """One panel per (header, key): a line per run over the chain's steps, a dashed line per untrained model; None
    (nothing written) when no run has two points of any key."""
    drawn = [(header, key) for header, key in keys
             if any(sum(key in h for h in curve.values()) >= 2 for curve in curves.values())]
    if not drawn:
        return None
    cols = min(2, len(drawn))
    rows = -(-len(drawn) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    fig.suptitle(title)
    for ax, (header, key) in zip(axes.ravel(), drawn):
        for label, curve in curves.items():
            points = sorted((x, h[key]) for x, h in curve.items() if key in h)
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=label)
        for i, (label, headline) in enumerate(constants.items()):
            if key in headline:
                ax.axhline(headline[key], linestyle="--", linewidth=1, color=f"C{len(curves) + i}", label=label)
        if "ppl" in key.split("/")[0]:
            ax.set_yscale("log")
        ax.set_title(header)
        ax.set_xlabel("training steps (a continued run after its start's)")
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(drawn):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
