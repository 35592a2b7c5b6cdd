"""The warm launcher the suite forks its ranks from (tests/warm.py) ends its processes as torchrun does: a failed
rank's peers are stopped, and a run past its timeout is killed and raises, so a hung rank fails its test instead of
training on beside the session."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import warm
from helpers import gone

# a rank that writes its pid to argv[1]-RANK, then (rank 1) fails at once or (rank 0, one plain process) hangs
RANK = """
import os, sys, time
rank = int(os.environ.get("RANK", 0))
with open(f"{sys.argv[1]}-{rank}", "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    sys.exit(3)
time.sleep(600)
"""


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 60
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone(pid)


def test_a_failed_rank_ends_its_peers_and_the_run_returns_1(tmp_path):
    proc = warm.run(code=RANK, args=[str(tmp_path / "pid")], nproc=2, timeout=120)
    assert proc.returncode == 1  # torchrun's code for a run with a failed rank; rank 0 got SIGTERM, not 600 s
    assert all(wait_gone(int((tmp_path / f"pid-{rank}").read_text())) for rank in (0, 1))


def test_a_process_past_its_timeout_is_killed_and_raises(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(code=RANK, args=[str(tmp_path / "pid")], timeout=3)
    assert wait_gone(int((tmp_path / "pid-0").read_text()))


def test_an_environment_a_fork_cannot_honour_is_refused(tmp_path):
    with pytest.raises(ValueError, match="start this one with a real launcher"):
        warm.run(code="pass", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    with pytest.raises(ValueError, match="start a GPU run for real"):
        warm.run(code="pass", env={**os.environ, "DS_ACCELERATOR": "cuda"})
