"""The project's own way, end to end: `launch/build_ops.py` builds DeepSpeed's CPU collectives op into this install's
folder (the login-node step of docs/slurm.md), and the ranks that DeepSpeed's launcher starts use that folder, with
no TORCH_EXTENSIONS_DIR from outside (~1 min; the first build in an environment, ~1 min more)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from deepspeed.accelerator import get_accelerator
from helpers import REPO, training_launch

from pipeline.train.deepspeed_ops import ENV, install_ops_dir
from pipeline.train.distributed import CPU_COMM_OP


@pytest.mark.slow
@pytest.mark.e2e
def test_ranks_of_the_deepspeed_launcher_build_and_load_the_op_in_the_installs_folder(shards, tmp_path):
    # torch's default folder, were the setting lost on the way to a rank: new, so any build there shows
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"XDG_CACHE_HOME": str(cache), "DS_ACCELERATOR": "cpu"}
    built = os.path.join(install_ops_dir(), CPU_COMM_OP, f"{CPU_COMM_OP}.so")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "build_ops.py")], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{CPU_COMM_OP}: built or loaded in" in proc.stdout and f"in {install_ops_dir()}\n" in proc.stdout
    assert os.path.isfile(built)

    with training_launch(str(tmp_path / "run"), None, f"data.shards={shards}", "data.seq_len=64",
                         "data.build_if_missing=false", "train.steps=1", "train.export_hf=false",
                         launcher="deepspeed") as (cmd, launch_env):
        del launch_env[ENV]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                              env=launch_env | {"XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # only the install's folder holds the op: a rank that lost the setting would build it into torch's default
    # folder; and no rank claims a build of the op it loaded (DeepSpeed's "built successfully" of each load is
    # dropped where the op was built before: test_failure_modes.py's
    # test_deepspeeds_built_successfully_is_said_only_of_a_build loads the real op each way)
    assert os.path.isfile(built) and not (cache / "torch_extensions").exists()
    op = get_accelerator().create_op_builder("ShareMemCommBuilder").absolute_name()
    assert f"DeepSpeed {op} built successfully" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
