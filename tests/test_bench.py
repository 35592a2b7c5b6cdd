"""The GPU benchmark's CPU dry run: real data prep, a real DeepSpeed ZeRO-3 engine and ``train_step`` for every
objective of the tiny preset with SDPA, the flex rows marked as not measurable on CPU, the AdamW kernels, results
written as JSON and a markdown table (~30 s, mostly start-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.e2e
def test_gpu_bench_dry_run_measures_every_objective(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu", "bench_gpu.py"), "--dry-run",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    flex = [r for r in results["rows"] if r["attention"] == "flex"]
    assert [r["objective"] for r in flex] == ["clm", "mlm", "mntp", "magnet"]
    assert all(r["error"].startswith("not measurable on CPU") for r in flex)
    full_head = [r for r in results["rows"] if r["head"] == "full"]
    assert [(r["objective"], r["attention"], r["error"]) for r in full_head] == [("clm", "sdpa", "")]
    assert results["chunked_vs_full_head"]["tiny clm sdpa"]["step_time"] > 0
    rows = {r["objective"]: r for r in results["rows"] if r["attention"] == "sdpa" and r["head"] == "chunked"}
    assert list(rows) == ["clm", "mlm", "mntp", "magnet"]
    for row in rows.values():
        assert row["preset"] == "tiny" and row["head"] == "chunked" and not row["error"], row
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0, row
    # target shares follow the objectives: CLM predicts (almost) every token, MLM 30 %, MNTP 20 % of them
    assert rows["clm"]["targets_per_token"] > 0.9
    assert abs(rows["mlm"]["targets_per_token"] - 0.3) < 0.05
    assert abs(rows["mntp"]["targets_per_token"] - 0.2) < 0.05
    assert results["magnet_vs_causal"]["tiny sdpa"] > 0
    optimizers = {o["kind"]: o for o in results["optimizers"]}
    assert optimizers["none"]["step_ms"] > 0 and optimizers["torch"]["error"] == "CUDA only"
    table = (out / "results.md").read_text()
    assert "| tiny | magnet | sdpa | chunked | 2 |" in table and "MAGNET / causal step time, tiny sdpa" in table
    assert "| tiny | clm | flex | chunked | 2 | not measurable on CPU" in table
    assert "| none |" in table
