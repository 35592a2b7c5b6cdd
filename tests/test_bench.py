"""The GPU benchmark's CPU dry run: real data prep, a real DeepSpeed ZeRO-3 engine and ``train_step`` for every
objective of the tiny preset with SDPA, the flex rows marked as not measurable on CPU, the AdamW kernels last,
results written as JSON and a markdown table (~30 s, mostly start-up). Its budget: the alarm that ends a row at the
deadline, the optimizers' process killed with its children, a run out of budget from the start."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_GPU = os.path.join(REPO, "bench", "gpu", "bench_gpu.py")
spec = importlib.util.spec_from_file_location("bench_gpu", BENCH_GPU)
bench_gpu = sys.modules["bench_gpu"] = importlib.util.module_from_spec(spec)  # (dataclasses look their module up)
spec.loader.exec_module(bench_gpu)


def dry_run(out, *options: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, BENCH_GPU, "--dry-run", "--out", str(out), *options], capture_output=True,
                          text=True, timeout=600, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu",
                                                                 "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.e2e
@pytest.mark.slow  # ~1 min of launches: the slow suite keeps make test under 20 min
def test_gpu_bench_dry_run_measures_every_objective(tmp_path):
    out = tmp_path / "out"
    proc = dry_run(out)
    # the optimizers last (FusedAdam's build may take minutes), in their own process
    assert proc.stdout.index("AdamW none: ") > proc.stdout.index("tiny clm sdpa full: ")
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


@pytest.mark.e2e
def test_gpu_bench_out_of_budget_marks_every_row_and_still_writes_results(tmp_path):
    dry_run(tmp_path, "--budget-s", "0")
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["error"] for r in results["rows"] + results["optimizers"]} == {bench_gpu.OVER_BUDGET}
    assert len(results["rows"]) == len(bench_gpu.VARIANTS) and len(results["optimizers"]) == 3


def test_the_budget_alarm_ends_what_runs_at_the_deadline():
    previous = signal.getsignal(signal.SIGALRM)
    with pytest.raises(bench_gpu.OverBudget, match="cut at --budget-s"):
        with bench_gpu.deadline_alarm(time.time() + 0.2):
            time.sleep(60)  # a step, a compile or an engine build that would run on
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is previous
    with pytest.raises(bench_gpu.OverBudget, match="skipped"), bench_gpu.deadline_alarm(time.time() - 1):
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.e2e
def test_run_until_kills_the_process_group_at_the_deadline():
    """As FusedAdam's JIT build runs the compilers: a child with its own child, both still running at the deadline."""
    child = ("import subprocess, time; p = subprocess.Popen(['sleep', '600']); print(p.pid, flush=True); "
             "time.sleep(600)")
    output, killed = bench_gpu.run_until([sys.executable, "-c", child], time.time() + 5)
    assert killed and output.strip().isdigit()  # what it printed before the deadline is kept
    grandchild = int(output)
    for _ in range(100):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert bench_gpu.run_until([sys.executable, "-c", "print('done')"], time.time() + 60) == ("done\n", False)


@pytest.mark.e2e
def test_encode_bench_dry_run_checks_agreement_then_times_all_three(tmp_path):
    """bench/bench_encode.py's dry run (~20 s): the exported tiny model embeds alike in encode() and
    sentence-transformers before any timing, then encode(), sentence-transformers' encode and its pool are timed."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_encode.py"), "--dry-run", "--out",
                           str(tmp_path / "encode.json")], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "agreement on 64 sentences: max |diff|" in proc.stdout
    results = json.loads((tmp_path / "encode.json").read_text())
    rates = results["sentences_per_s"]
    assert list(rates) == ["encode()", "sentence-transformers encode", "sentence-transformers pool (1 processes)"]
    assert all(rate > 0 for rate in rates.values()) and results["sentences"] == 96
    assert results["ratio_to_sentence_transformers"]["sentence-transformers encode"] == 1.0
    assert proc.stdout.rstrip().endswith(f"{rates['encode()'] / rates['sentence-transformers encode']:.2f}x")
