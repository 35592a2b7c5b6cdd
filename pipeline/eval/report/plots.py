"""PNG plots of the ablation: loss curves per objective across variants, and each evaluated number against the
CLM share and against the masking ratio. Each figure says so when it has nothing to show, instead of being absent.

A line joins only runs that differ in the plotted setting alone: same model scale, same non-CLM objectives, same
other setting (``series``), through the mean of the runs (seeds) at each x; its legend names what varies between the
lines. Each run is a point, labelled once per name without its seed. A number's axis (its unit, a log scale for
perplexities) is its task's spec's (:class:`pipeline.tasks.HeadlineKey`)."""

from __future__ import annotations

import math
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.eval.report.papers import PAPERS  # noqa: E402
from pipeline.eval.report.runs import RunSummary  # noqa: E402
from pipeline.tasks import headline_key  # noqa: E402

MAX_PANELS = 12
# the papers' numbers first, so they get panels when there are more than MAX_PANELS numbers
FIRST = ("ppl", "mlm_acc", "mntp_acc", *dict.fromkeys(key for p in PAPERS for _, key in p.columns))
HEADERS = {key: header for p in PAPERS for header, key in p.columns}
SEED = re.compile(r"-s\d+(?=-smoke$|$)")  # the shipped grids name their seed values sN: runs NAME-sN


def _grid(n: int, title: str):
    cols = min(3, max(1, n))
    rows = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    fig.suptitle(title)
    return fig, axes.ravel()


def _save(fig, path: str) -> str:
    fig.tight_layout(rect=(0, 0, 1, 0.96))  # room for the suptitle
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _empty(path: str, title: str, message: str) -> str:
    fig, (ax,) = _grid(1, title)
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    return _save(fig, path)


def loss_curves(runs: list[RunSummary], path: str) -> str:
    """One panel per objective (``loss/<name>`` of metrics.jsonl), one line per run."""
    keys = sorted({k for run in runs for k in run.history})
    if not keys:
        return _empty(path, "Training loss", "no metrics.jsonl with losses in these runs")
    fig, axes = _grid(len(keys), "Training loss per objective")
    for ax, key in zip(axes, keys):
        for run in runs:
            if key in run.history:
                steps = sorted(run.history[key])
                ax.plot(steps, [run.history[key][s] for s in steps], label=run.recipe.name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    for ax in axes[len(keys):]:
        ax.axis("off")
    return _save(fig, path)


def log_scale(key: str) -> bool:
    """Perplexities (``ppl``, ``infill_ppl_*``) span orders of magnitude across runs: a log axis, where the task's
    spec says so."""
    declared = headline_key(key)
    return declared is not None and declared.log


def unit(key: str) -> str:
    """The y axis of a headline number: its unit where the task's spec is certain of it, else the key itself."""
    declared = headline_key(key)
    return declared.unit if declared is not None and declared.unit else key


def series(points: list[tuple[float, float, RunSummary]], axis: str) -> dict[str, list[tuple[float, float]]]:
    """The lines of one panel: label -> points sorted by x. Runs share a line only when they differ in ``axis``
    alone (scale, non-CLM objectives and the other setting equal); the label names what varies between lines."""
    other = "mask_ratio" if axis == "clm_share" else "clm_share"

    def key(r: RunSummary) -> tuple:
        return (("model", r.recipe.scale), ("objectives", "+".join(sorted(r.recipe.objectives - {"clm"})) or "clm"),
                (other.replace("_", " "), getattr(r.recipe, other)))

    keys = {key(r) for _, _, r in points}
    varies = [i for i in range(3) if len({k[i][1] for k in keys}) > 1]
    lines: dict[str, list[tuple[float, float]]] = {}
    for x, y, r in points:
        k = key(r)
        label = ", ".join(f"{k[i][0]} = {k[i][1] if k[i][1] is not None else 'none'}" for i in varies) or "all runs"
        lines.setdefault(label, []).append((x, y))
    return {label: sorted(line) for label, line in sorted(lines.items())}


def mean_line(line: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """One point per x, the mean of the runs there (the seeds of one setting): a line through them, not a zigzag."""
    xs = sorted({x for x, _ in line})
    return [(x, sum(y for u, y in line if u == x) / sum(1 for u, _ in line if u == x)) for x in xs]


def metric_against(runs: list[RunSummary], path: str, axis: str) -> str:
    """One panel per headline number against ``axis`` ("clm_share" or "mask_ratio"); each run is a point, and runs
    that differ in ``axis`` alone are joined by a line through their means (``series``, ``mean_line``)."""
    label = {"clm_share": "CLM share of the training budget", "mask_ratio": "masking ratio"}[axis]
    placed = [r for r in runs if getattr(r.recipe, axis) is not None]
    found = {k for r in placed for k in r.headline}
    keys = ([k for k in FIRST if k in found] + sorted(found - set(FIRST)))[:MAX_PANELS]
    if not keys:
        return _empty(path, f"Metrics against the {label}",
                      f"no evaluated run with a {label}: run launch/evaluate.py on the runs first")
    fig, axes = _grid(len(keys), f"Evaluation metrics against the {label}")
    for ax, key in zip(axes, keys):
        points = [(getattr(r.recipe, axis), r.headline[key], r) for r in placed if key in r.headline]
        for name, line in series(points, axis).items():
            means = mean_line(line)
            drawn = ax.plot([x for x, _ in means], [y for _, y in means], label=name)
            ax.scatter([x for x, _ in line], [y for _, y in line], color=drawn[0].get_color(), s=16, zorder=3)
        if log_scale(key):
            ax.set_yscale("log")
        named = {}
        for x, y, r in points:  # one label per run name without its seed, at the highest of its points
            base = SEED.sub("", r.recipe.name)
            named[(base, x)] = max(y, named.get((base, x), y))
        for (base, x), y in named.items():
            ax.annotate(base, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{HEADERS[key]} ({key})" if key in HEADERS else key)
        ax.set_ylabel(unit(key))
        ax.set_xlabel(label)
        ax.set_xlim(-0.05, 1.05)
        ax.legend(fontsize=7)
    for ax in axes[len(keys):]:
        ax.axis("off")
    return _save(fig, path)


def all_plots(runs: list[RunSummary], out: str) -> list[str]:
    """The three PNGs in ``out``; returns their file names."""
    paths = [loss_curves(runs, os.path.join(out, "loss_curves.png")),
             metric_against(runs, os.path.join(out, "metrics_vs_clm_share.png"), "clm_share"),
             metric_against(runs, os.path.join(out, "metrics_vs_mask_ratio.png"), "mask_ratio")]
    return [os.path.basename(p) for p in paths]
