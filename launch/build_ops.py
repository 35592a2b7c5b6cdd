"""Build DeepSpeed's JIT ops into this install's own folder ahead of a run, e.g. on a cluster's login node before
sbatch (docs/slurm.md):

    python launch/build_ops.py [--op BUILDER ...] [--print-dir]

Also installed as ``pipeline-build-ops``. The folder: pipeline/train/deepspeed_ops.py (docs/training.md).
"""

import sys

import _repo  # noqa: F401  (first: the checkout's root on sys.path, installed or not)

from pipeline.train.deepspeed_ops import main

if __name__ == "__main__":
    sys.exit(main())
