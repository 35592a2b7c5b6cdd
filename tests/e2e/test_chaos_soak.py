"""The chaos soak's short form: bench/chaos_soak.py as a user runs it (docs/reliability.md, "Chaos soak"), with one
fault of each kind (three kills: SIGKILL, SIGTERM, SIGKILL mid-write; and a full disk where a tmpfs can be mounted)
on 2 ZeRO-3 ranks under the ``deepspeed`` command, each followed by a restart: six launches (the uninterrupted run,
four faults, the finish), ~20 s of start-up each on a quiet machine (10.5 min in all on a loaded one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, cpu_env

SOAK = os.path.join(REPO, "bench", "chaos_soak.py")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_killed_each_way_logs_the_uninterrupted_losses_and_keeps_its_complete_checkpoints(shards, tmp_path):
    out = tmp_path / "soak"
    faults = 4 if os.geteuid() == 0 else 3  # a tmpfs for the full disk needs root
    proc = subprocess.run([sys.executable, SOAK, "--kills", str(faults), "--every", "3", "--seed", "0", "--out",
                           str(out), "--set", f"data.shards={shards}", "--set", "data.seq_len=64", "--set",
                           "data.build_if_missing=false"],
                          capture_output=True, text=True, cwd=REPO, env=cpu_env(), timeout=2400)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and not summary["problems"], proc.stdout[-4000:] + proc.stderr[-4000:]
    kinds = [kill["kind"] for kill in summary["kills"]]
    assert sorted(kinds) == sorted(["SIGKILL", "SIGTERM", "SIGKILL mid-write", "full disk"][:faults])
    assert f"kills survived: {faults} of {faults} " in proc.stdout
    for kill in summary["kills"]:  # each one ended its job: in an error, or SIGTERM's stop with a checkpoint
        assert (kill["exit_status"] == 0) == (kill["kind"] == "SIGTERM"), kill
    # every loss logged, the replayed steps' too, equals the uninterrupted run's bit for bit
    assert summary["losses_differing"] == 0 and summary["losses_compared"] > summary["steps"]
    assert "bit-identical to the uninterrupted run's" in proc.stdout and "steps repeated per kill: " in proc.stdout
    assert summary["complete_seen"][-1] == summary["steps"]
