"""Reproduce the three papers' findings at CPU scale on real data, end to end (docs/results.md):

    python launch/reproduce.py [--quick | --scale full|quick|paper|gpu-short] [--dry-run] [--device auto|cuda|cpu]
        [--study llm2vec --study mlm_vs_clm --study magnet]
        [--out runs/reproduce] [--results docs/results] [--page docs/results.md]

Needs `make real-data real-model` first (`make reproduce` / `make reproduce-quick` do both; `--scale gpu-short`,
the MLM-vs-CLM study alone in <= 8 min on one H200, needs only `make real-data`). Training and evaluation run on the
GPU where torch sees one. Re-running skips what is finished and resumes unfinished training runs. Also installed as
``pipeline-reproduce``; the driver is pipeline/reproduce/driver.py.
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.reproduce.driver import main

if __name__ == "__main__":
    sys.exit(main())
