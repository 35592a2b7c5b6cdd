"""DeepSpeed's import in every launch/ script skips its autotuner's ``import mlflow`` (3 of its 7 CPU seconds), and
the MLflow tracker still imports mlflow (tests/unit/train/test_trackers.py runs it)."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO

PROBE = """
import importlib.util, sys
import _repo
assert importlib.util.find_spec('mlflow'), 'mlflow is not installed: deepspeed would not import it anyway'
import deepspeed
from deepspeed.autotuning import autotuner
print('mlflow' in sys.modules, autotuner.has_mlflow)
import mlflow
print(mlflow.__name__)
"""


def test_a_launch_script_imports_deepspeed_without_mlflow_and_mlflow_still_loads_after():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.path.join(REPO, "launch")}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False", "mlflow"]
