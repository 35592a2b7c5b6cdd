"""Reproduce the three papers' findings at CPU scale on real data, end to end (docs/results.md):

    python launch/reproduce.py [--quick] [--study llm2vec --study mlm_vs_clm --study magnet]
        [--out runs/reproduce] [--results docs/results] [--page docs/results.md]

Needs `make real-data real-model` first (`make reproduce` / `make reproduce-quick` do both). Re-running skips what
is finished and resumes unfinished training runs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from pipeline.reproduce.studies import STUDIES

    names = [s.name for s in STUDIES]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the grids' -smoke twins and a few examples (<= 20 min)")
    p.add_argument("--study", action="append", choices=names, help="run only this study (repeatable; default: all)")
    p.add_argument("--out", help="run directories (default runs/reproduce, or runs/reproduce-quick with --quick)")
    p.add_argument("--results", default="docs/results", help="records, logs and plots go to RESULTS/full|quick")
    p.add_argument("--page", default="docs/results.md", help="the page whose generated blocks are rewritten")
    args = p.parse_args(argv)

    from pipeline.reproduce.data import RealDataError
    from pipeline.reproduce.driver import Driver

    out = args.out or ("runs/reproduce-quick" if args.quick else "runs/reproduce")
    try:
        Driver(args.quick, os.path.abspath(out), args.results, args.page, args.study or names).run()
    except (RealDataError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
