"""Puts this checkout's root first on ``sys.path``: each launch/ script imports it before ``pipeline``, so that
``deepspeed launch/train.py`` (and every other script here) runs the checkout's own library whether or not it is
pip-installed, and a checkout beside an editable install of another runs its own code, not the other's. It also
keeps DeepSpeed's JIT-built ops in this install's own folder (``pipeline.train.deepspeed_ops``) and its import free of
the autotuner's mlflow (``pipeline.train.deepspeed_import``): every rank runs a launch/ script, whichever launcher
(DeepSpeed's, torchrun, srun) started it."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [ROOT]:
    sys.path.insert(0, ROOT)

from pipeline.train.deepspeed_import import skip_autotuner_mlflow  # noqa: E402  (after the root is on sys.path)
from pipeline.train.deepspeed_ops import use_install_ops_dir  # noqa: E402

skip_autotuner_mlflow()
use_install_ops_dir()
