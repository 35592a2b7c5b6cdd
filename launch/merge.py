"""Merge exports of one architecture with mergekit: ``python launch/merge.py --method linear|slerp|task_arithmetic
--models DIR DIR ... --output DIR [--weights W ...] [--t T] [--base DIR] [--lambda L]`` (options:
``pipeline.export.merge.main``)."""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.export.merge import main

if __name__ == "__main__":
    sys.exit(main())
