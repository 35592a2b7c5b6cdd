"""Export a training checkpoint as an HF directory: ``python launch/export_hf.py --run RUN_DIR [--step N] --output DIR
[--dtype fp32|bf16] [--sentence-transformers [--pooling P] [--layout L]] [--truncate-dim N]`` (options:
``pipeline.export.hf.main``)."""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.export.hf import main

if __name__ == "__main__":
    sys.exit(main())
