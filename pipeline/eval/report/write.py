"""Write the ablation report of a set of runs into a directory: ``report.md`` (every table, the plots inline), one
``<paper>.md`` table per paper with numbers, and the PNG plots (``launch/report.py``, ``make reproduce``)."""

from __future__ import annotations

import argparse
import os
import sys

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


USAGE = """The ablation report of a set of runs: a markdown table per paper and PNG plots.

    python launch/report.py runs/clm runs/mlm-40 runs/clm-25-mlm ... --out reports/grid

Reads each run's experiment.json (the variant), metrics.jsonl (loss curves) and eval/*.json (written by
launch/evaluate.py). Writes OUT/report.md (every table, the plots inline), OUT/<paper>.md (one table per paper),
OUT/loss_curves.png, OUT/metrics_vs_clm_share.png and OUT/metrics_vs_mask_ratio.png.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    try:
        print(write_report(args.runs, args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
