"""Markdown tables: one per paper (rows = our variants, each followed by the paper's row where the scale matches)
and one of every headline number."""

from __future__ import annotations

from pipeline.eval.report.papers import PAPERS, Paper
from pipeline.eval.report.runs import RunSummary

VARIANT_HEADERS = ("run", "phases", "scale", "steps", "CLM share", "mask ratio")


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def _recipe_cells(run: RunSummary) -> list[str]:
    v = run.recipe
    return [v.name, v.phases, v.scale, str(v.steps), f"{v.clm_share:.2f}", fmt(v.mask_ratio)]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def paper_table(paper: Paper, runs: list[RunSummary]) -> str | None:
    """The paper's table, or None when no run has any of its numbers."""
    keys = [key for _, key in paper.columns]
    if not any(key in run.headline for run in runs for key in keys):
        return None
    rows = []
    for run in runs:
        rows.append(_recipe_cells(run) + [fmt(run.headline.get(k)) for k in keys])
        reference = paper.reference(run.recipe)
        if reference:
            label, numbers = reference
            rows.append([f"↳ paper: {label}", "", "", "", "", ""] + [fmt(numbers.get(k)) for k in keys])
    table = _table([*VARIANT_HEADERS, *(h for h, _ in paper.columns)], rows)
    return f"## {paper.title}\n\n{table}\n\n_{paper.note}; a paper row appears under a run of the same scale._\n"


def summary_table(runs: list[RunSummary]) -> str:
    keys = sorted({k for run in runs for k in run.headline})
    rows = [_recipe_cells(run) + [fmt(run.headline.get(k)) for k in keys] for run in runs]
    return f"## Every evaluated number\n\n{_table([*VARIANT_HEADERS, *keys], rows)}\n"


def report_markdown(runs: list[RunSummary], plots: list[str]) -> str:
    parts = ["# Ablation report\n", f"{len(runs)} runs: " + ", ".join(f"`{r.run_dir}`" for r in runs) + "\n"]
    tables = [t for t in (paper_table(p, runs) for p in PAPERS) if t]
    parts += tables or ["_No evaluation results yet: run `launch/evaluate.py --model RUN_DIR ...` for each run._\n"]
    parts.append(summary_table(runs))
    parts.append("## Plots\n\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n")
    return "\n".join(parts)
