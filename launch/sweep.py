"""Expand an experiment grid into run directories and submit them, or train them here:

    python launch/sweep.py GRID [--smoke] [--only PATTERN] [--out runs] [--set KEY=VALUE] [--write | --submit | --local]

Also installed as ``pipeline-sweep``; options: ``--help``. The sweep is pipeline/sweep/ (docs/experiments.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.sweep import main

if __name__ == "__main__":
    sys.exit(main())
