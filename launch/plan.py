"""The cluster planner: memory per GPU, step time, days for a run or a grid, data prep for a corpus.

    python launch/plan.py --model 7b --nodes 4 --gpus-per-node 8 --gpu h100 [--grid GRID] [--corpus-tokens N] ...

Also installed as ``pipeline-plan``; options: ``--help``. The planner is pipeline/planner/ (docs/planning.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.planner.report import main

if __name__ == "__main__":
    sys.exit(main())
