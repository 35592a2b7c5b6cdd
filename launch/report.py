"""The ablation report of a set of runs: a markdown table per paper and PNG plots.

    python launch/report.py runs/clm runs/mlm-40 runs/clm-25-mlm ... --out reports/grid

Reads each run's experiment.json (the variant), metrics.jsonl (loss curves) and eval/*.json (written by
launch/evaluate.py). Writes OUT/report.md (every table, the plots inline), OUT/<paper>.md (one table per paper),
OUT/loss_curves.png, OUT/metrics_vs_clm_share.png and OUT/metrics_vs_mask_ratio.png.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)

    from pipeline.eval.report.write import write_report

    try:
        print(write_report(args.runs, args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
