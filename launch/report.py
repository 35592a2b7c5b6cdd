"""The ablation report of a set of runs: ``python launch/report.py RUN_DIR ... --out DIR`` (a markdown table per
paper and PNG plots; options: ``pipeline.eval.report.write.main``)."""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.eval.report.write import main

if __name__ == "__main__":
    sys.exit(main())
