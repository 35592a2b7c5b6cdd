"""Write the ablation report of a set of runs into a directory: ``report.md`` (every table, the plots inline), one
``<paper>.md`` table per paper with numbers, and the PNG plots (``launch/report.py``, ``make reproduce``)."""

from __future__ import annotations

import os

from pipeline.eval.report.papers import PAPERS
from pipeline.eval.report.plots import all_plots
from pipeline.eval.report.runs import load_run
from pipeline.eval.report.tables import paper_table, report_markdown


def write_report(run_dirs: list[str], out: str) -> str:
    """Write the report of ``run_dirs`` into ``out``; returns the line naming what was written. A directory that is
    not a run directory raises FileNotFoundError or ValueError before anything is written."""
    runs = [load_run(r) for r in run_dirs]
    os.makedirs(out, exist_ok=True)
    plots = all_plots(runs, out)
    for paper in PAPERS:
        table = paper_table(paper, runs)
        if table:
            with open(os.path.join(out, f"{paper.name}.md"), "w") as f:
                f.write(table)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report_markdown(runs, plots))
    return f"wrote {os.path.join(out, 'report.md')} and {', '.join(plots)}"
