"""The GPU benchmark's CPU dry run: real data prep, a real DeepSpeed ZeRO-3 engine and ``train_step`` for every
objective of the tiny preset with SDPA, the flex rows marked as not measurable on CPU, the AdamW kernels last,
results written as JSON and a markdown table (~30 s, mostly start-up). Its budget: the alarm that ends a row at the
deadline, the optimizers' process killed with its children, a run out of budget from the start."""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import warm
from helpers import ONE_RANK, gone, launch_training, logged_steps

from pipeline.planner import report as plan_cli

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BENCH_GPU = os.path.join(REPO, "bench", "gpu", "bench_gpu.py")
spec = importlib.util.spec_from_file_location("bench_gpu", BENCH_GPU)
bench_gpu = sys.modules["bench_gpu"] = importlib.util.module_from_spec(spec)  # (dataclasses look their module up)
spec.loader.exec_module(bench_gpu)


def dry_run(out, *options: str) -> subprocess.CompletedProcess:
    proc = warm.run(BENCH_GPU, ["--dry-run", "--out", str(out), *options], timeout=600,
                    env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
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


@pytest.mark.e2e
def test_run_until_kills_the_process_group_at_the_deadline():
    """As FusedAdam's JIT build runs the compilers: a child with its own child, both still running at the deadline."""
    child = ("import subprocess, time; p = subprocess.Popen(['sleep', '600']); print(p.pid, flush=True); "
             "time.sleep(600)")
    output, killed = bench_gpu.run_until([sys.executable, "-c", child], time.time() + 5)
    assert killed and output.strip().isdigit()  # what it printed before the deadline is kept
    grandchild = int(output)
    for _ in range(100):
        if gone(grandchild):
            break
        time.sleep(0.1)
    assert gone(grandchild)
    assert bench_gpu.run_until([sys.executable, "-c", "print('done')"], time.time() + 60) == ("done\n", False)


@pytest.mark.e2e
def test_encode_bench_dry_run_checks_agreement_then_times_all_three(tmp_path):
    """bench/bench_encode.py's dry run (~20 s): the exported tiny model embeds alike in encode() and
    sentence-transformers before any timing, then encode(), sentence-transformers' encode and its pool are timed."""
    proc = warm.run(os.path.join(REPO, "bench", "bench_encode.py"), ["--dry-run", "--out", str(tmp_path / "encode.json")],
                    timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "agreement on 64 sentences: max |diff|" in proc.stdout
    results = json.loads((tmp_path / "encode.json").read_text())
    rates = results["sentences_per_s"]
    assert list(rates) == ["encode()", "sentence-transformers encode", "sentence-transformers pool (1 processes)"]
    assert all(rate > 0 for rate in rates.values()) and results["sentences"] == 96
    assert results["ratio_to_sentence_transformers"]["sentence-transformers encode"] == 1.0
    assert proc.stdout.rstrip().endswith(f"{rates['encode()'] / rates['sentence-transformers encode']:.2f}x")


@pytest.mark.e2e
@pytest.mark.slow  # a benchmark's plumbing (~35 s): one rank, the trainer and a bare engine built side by side
def test_trainer_bench_times_trainer_fit_against_a_bare_engine(tmp_path):
    """bench/bench_trainer.py on one rank, 1 + 2 steps, validating at step 3: ``Trainer.fit`` trains every step
    (its metrics.jsonl), a bare step runs before each, and the report has each part and both ratios."""
    proc = warm.run(os.path.join(REPO, "bench", "bench_trainer.py"), ["--nproc", "1", "--steps", "2", "--warmup", "1",
                    "--eval-every", "3", "--eval-samples", "8", "--work-dir", str(tmp_path)], timeout=600,
                    env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = [json.loads(line) for line in open(tmp_path / "tiny" / "run" / "metrics.jsonl")]
    assert [r["step"] for r in history] == [1, 2, 3] and "eval/loss/clm" in history[-1]
    out = proc.stdout
    assert f"first step loss: ours {history[0]['loss/clm']:.4f}" in out and "first step loss: bare " in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(" ")}
    for part in ("forward", "backward", "step", "total"):
        assert len(rows[part]) == 2 and all(float(ms) > 0 for ms in rows[part]), rows
    assert len(rows["other"]) == 2  # the rest of each step (a few ms, barriers included)
    assert rows["data"][0] == "-" and float(rows["data"][1]) > 0  # only the trainer reads shards
    assert "trainer / bare DeepSpeed step time: " in out
    assert "validation: 1 evaluations of 8 held-out samples" in out


def _bench_module(name: str):
    """A bench/gpu script as a module (they import each other by file name)."""
    sys.path.insert(0, os.path.dirname(BENCH_GPU))
    return importlib.import_module(name)


ablate = _bench_module("ablate")
attribute = _bench_module("attribute")


@pytest.mark.e2e
def test_gpu_ablation_dry_run_and_the_training_log_agree_on_flops(tmp_path):
    """bench/gpu/ablate.py's CPU dry run: its best row alone (the planner's engine and batch; on the CPU SDPA and
    eager) in its own process on real shards and the trainer's engine, timed and attributed with the report's full
    shape; then launch/train.py on the same shards with the same experiment logs, for the step the bench timed, the
    FLOPs per token the bench reported (one ``Throughput`` over ``train_step``'s ``Work``). ~25 s on a quiet
    machine."""
    out, data = tmp_path / "out", tmp_path / "data"
    proc = subprocess.run([sys.executable, ablate.__file__, "--dry-run", "--out", str(out), "--data", str(data),
                           "--rows", "best"], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    [row] = results["rows"]
    assert row["group"] == "best" and row["setting"] == "sdpa, eager, zero1.json, micro 8 x accumulation 1"
    assert not row["error"] and (row["config"]["micro_batch"], row["config"]["grad_accum"]) == (8, 1), row
    assert row["step_s"] > 0 and row["tokens_per_step"] > 0 and row["flops_per_token"] > 0 and row["loss"] > 0, row
    report = json.loads((out / "attribution.json").read_text())["attribution"]
    assert set(report) == {"device", "step_ms", "busy_ms", "busy_share", "idle_ms", "idle_gaps",
                           "kernel_ms_by_category", "top_kernels", "host_syncs", "dtoh_copies", "kernel_launches",
                           "ranges_ms", "trace"}
    assert report["trace"].startswith("the whole step") and (out / "trace.json.gz").exists()
    assert 0 < report["busy_ms"] <= report["step_ms"] and report["kernel_ms_by_category"]["matmul"] > 0
    assert all(report["ranges_ms"][r]["host"] > 0 for r in attribute.RANGES) and report["top_kernels"]
    assert "| best | sdpa, eager, zero1.json, micro 8 x accumulation 1 | tiny | zero1.json | 8 x 1 |" in proc.stdout
    assert "## Step attribution: tiny" in proc.stdout and "| matmul |" in proc.stdout

    cfg = attribute.RunConfig(**{**row["config"], "overrides": ()})
    run_dir = tmp_path / "run"
    sets = attribute.experiment_overrides(cfg, attribute.Data(**results["data"]), str(run_dir))[1:]
    launch_training(str(run_dir), None, *sets, "train.steps=2", "train.log_every=1", "train.export_hf=false",
                    **ONE_RANK)
    steps = logged_steps(str(run_dir))  # the bench timed the step after its one warm-up step
    assert steps[2]["perf/flops_per_token"] == pytest.approx(row["flops_per_token"], rel=1e-12)
    assert steps[1]["perf/flops_per_token"] != steps[2]["perf/flops_per_token"]  # else any step would match


def test_an_ablation_row_whose_switch_this_checkout_lacks_fails_alone(tmp_path, capsys):
    """Levers come from other branches: an unknown override or DeepSpeed JSON is that row's config error, found
    before a process starts. The best row comes first and is the a-priori best, not assembled from measured rows:
    varlen and compiled at the planner's engine and largest micro-batch for the GPU (an H100's 80 GiB holds micro 8,
    an H200's 141 micro 16), accumulated to 64k tokens; then the 2026-12-04 configuration. The planner's 7b row for
    the GPU present (here none: an H100) is launch/plan.py's, its estimate beside it."""
    data = attribute.Data(str(tmp_path / "shards"), str(tmp_path / "tokenizer"))
    base = ablate.DRY.base
    assert ablate.config_error(base, data) == ""
    missing = ablate.config_error(dataclasses.replace(base, overrides=("model.no_such_lever=true",)), data)
    assert missing.startswith("config error: ") and "no_such_lever" in missing
    assert "ds_configs/zero9.json does not exist" in ablate.config_error(
        dataclasses.replace(base, ds_config="ds_configs/zero9.json"), data)

    for gpu, micro in (("h100", 8), ("h200", 16)):
        rows = ablate.ablation_rows(ablate.FULL, gpu)
        best, then = rows[0].config, rows[1].config
        assert [r.group for r in rows[:2]] == ["best", "2026-12-04"] and rows[0].attribute
        assert (best.preset, best.ds_config, best.micro_batch) == ("1b", "ds_configs/zero1.json", micro)
        assert best.micro_batch * best.grad_accum * best.seq_len == 65536
        assert best.overrides == ("model.attn_implementation=varlen", "model.compile=true")
        assert (then.ds_config, then.micro_batch, then.grad_accum, then.overrides) == ("ds_configs/zero3.json", 4, 1, ())
        assert [r.group for r in rows if r.attribute] == ["best"] and rows[-1].group == "optimizer"

    planner = ablate.planner_row(ablate.FULL, "h100")  # what launch/plan.py says for the GPU, model and batch
    assert planner.config.preset == "7b" and planner.setting.startswith("planner (h100)")
    assert 0 < planner.estimate_gib <= 80
    assert plan_cli.main(["--model", "7b", "--nodes", "1", "--gpus-per-node", "1", "--gpu", "h100", "--micro-batch",
                          "1", "--seq-len", str(ablate.FULL.base.seq_len), "--checkpointing", "full"]
                         + (["--offload"] if "offload" in planner.config.ds_config else [])) == 0
    assert f"({planner.config.ds_config})" in capsys.readouterr().out


@pytest.mark.e2e
def test_gpu_run_dry_run_smokes_then_plans_and_ablates(tmp_path):
    """bench/gpu/run.sh OUT --dry-run on the CPU: the smoke test's first checks in their CPU form (each a line; the
    CUDA ones skip), then the ablation's: the call's plan, best first, its total with the install at most 540 s, the
    best row run, then the smoke test's last checks; nothing of the user's command, and OUT holds results alone.
    ~80 s on a quiet machine."""
    out = tmp_path / "out"
    proc = subprocess.run([os.path.join(REPO, "bench", "gpu", "run.sh"), str(out), "--dry-run", "--rows", "best",
                           "smoke", "--data", str(tmp_path / "data")], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env={**os.environ, "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu",
                                         "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = smoke_module().CHECKS
    smoke = [line for line in proc.stdout.splitlines() if line.startswith("smoke ")]
    assert [line.split(":")[0] for line in smoke] == [f"smoke {c.name}" for c in checks if not c.last] + [
        f"smoke {c.name}" for c in checks if c.last]
    assert all(": pass," in line or ": skip," in line for line in smoke), smoke
    assert "smoke varlen-causal: skip" in proc.stdout and "smoke zero3: pass" in proc.stdout
    assert proc.stdout.index("smoke: ") < proc.stdout.index("plan of one call") < proc.stdout.index("smoke flex-64")
    plan = proc.stdout[proc.stdout.index("plan of one call"):].splitlines()
    assert plan[1].startswith("  install and check") and plan[4].startswith("  best ")
    assert plan[5].startswith("  2026-12-04 ")
    total = next(line for line in plan if line.startswith("planned: "))
    assert int(total.split()[1]) <= 540, total
    assert "| best | sdpa, eager, zero1.json, micro 8 x accumulation 1 | tiny |" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["attribution.json", "attribution.md", "results.json",
                                                     "results.md", "smoke.log", "trace.json.gz"]
    log = (out / "smoke.log").read_text()
    assert all(line in log for line in smoke)
    assert "smoke: 3 passed, 0 off, 2 skipped, 0 crashed (skip: varlen-causal, varlen-bidirectional)" in log
    assert "smoke: 0 passed, 0 off, 2 skipped, 0 crashed (skip: flex-64, flex-2048)" in log  # appended by ablate.py


def test_the_bench_processes_rewrite_the_arch_list(monkeypatch):
    """The bench's processes (``_single_process_env``: attribute.py, ablate.py's rows, smoke.py) give DeepSpeed's
    op builds (DeepCompile's, FusedAdam's) the arch list they can read, as the trainer's start does: ``9.0a`` -> ``9.0``."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so undone after the test, unlike delenv of an absent key
        monkeypatch.delenv(key)
    _bench_module("bench_gpu")._single_process_env()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


def smoke_module():
    sys.path.insert(0, os.path.dirname(BENCH_GPU))
    return importlib.import_module("smoke")


def test_the_smoke_test_stops_the_run_on_a_crash_alone(capsys):
    """Numerics outside their tolerance are reported ("off") and the run goes on; an exception or a non-finite
    result is a crash, the one status that makes smoke.py exit 1 and run.sh stop; a check that cannot run here
    skips. Each line carries its seconds beside its price."""
    smoke = smoke_module()

    def broken() -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def cuda_only() -> float:
        raise smoke.Skip("needs CUDA")

    checks = [smoke.Check("near", lambda: 0.01, 0.1, 5), smoke.Check("far", lambda: 0.5, 0.1, 5),
              smoke.Check("nan", lambda: float("nan"), 0.1, 5), smoke.Check("raises", broken, 0.1, 5),
              smoke.Check("cuda", cuda_only, 0.1, 5)]
    assert [status for _, status, *_ in smoke.run_checks(checks)] == ["pass", "off", "crash", "crash", "skip"]
    out = capsys.readouterr().out
    assert "smoke far: off," in out and "(priced 5)" in out and "illegal memory access" in out
    assert smoke.price_s(last=False) == smoke.START_S + sum(c.price_s for c in smoke.CHECKS if not c.last)


def test_a_trace_over_the_limit_is_trimmed_to_it(tmp_path):
    """Every file in OUT must come back from the lent GPU: a trace over the limit loses the host's aten ops first
    (kernels, runtime calls and ranges stay), then the end of the step, until its gzip fits."""
    import random

    rng = random.Random(0)
    events = [{"ph": "X", "cat": cat, "name": f"{cat}-{rng.getrandbits(64):x}", "ts": i, "dur": 1}
              for i in range(6000) for cat in ("cpu_op", "kernel")]
    path = tmp_path / "trace.json.gz"
    assert attribute.write_trace({"traceEvents": events}, str(path), limit=10**6) == (
        f"the whole step ({path.stat().st_size / 2**20:.2f} MiB)")
    note = attribute.write_trace({"traceEvents": events}, str(path), limit=50_000)
    kept = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert path.stat().st_size <= 50_000 and note.startswith("the step's first ") and "without the host's" in note
    assert kept and {e["cat"] for e in kept} == {"kernel"} and kept == [e for e in events if e["cat"] == "kernel"][
        :len(kept)]


def test_ablation_rows_are_what_they_say_on_cuda(tmp_path):
    """Each row's real overrides, resolved as the trainer would on a bf16 CUDA run: the best row is varlen and
    compiled, the 2026-12-04 row SDPA and eager (``model.compile`` auto would compile it), the eager rows eager. The
    call's plan, on either card: install and the smoke test's first checks, then best (priced as itself: a cold
    compile and 64k-token steps) and 2026-12-04, both inside the call, whose total with the install is at most 540 s."""
    from pipeline.experiment import load_experiment
    from pipeline.train.compiling import body_compiles
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.kernels import attn_implementation

    data = attribute.Data(str(tmp_path / "shards"), str(tmp_path / "tokenizer"))
    rows = ablate.ablation_rows(ablate.FULL, "h100")
    resolved = {}
    for r in rows:
        exp = load_experiment(None, attribute.experiment_overrides(r.config, data, str(tmp_path / "run")))
        ds = resolve_ds_config(load_ds_config(os.path.join(REPO, r.config.ds_config)), exp, 1, True)
        resolved[(r.group, r.setting)] = (body_compiles(exp, ds, cuda=True), attn_implementation(exp.model, True))
    assert [resolved[(r.group, r.setting)] for r in rows[:4]] == [
        (True, "pipeline_varlen"), (False, "sdpa"), (False, "pipeline_varlen"), (False, "sdpa")]
    assert resolved[("attention", "best, flex")] == (True, "pipeline_flex")
    for gpu in ("h100", "h200"):
        lines, total = ablate.plan(ablate.ablation_rows(ablate.FULL, gpu), ablate.FULL)
        labels = [line.split(":")[0].strip() for line in lines[1:-1]]
        assert labels[:4] == ["install and check", "smoke test, first checks", "the ablation's start and shards",
                              "best model.attn_implementation=varlen model.compile=true, zero1.json, micro "
                              + ("8 x accumulation 4" if gpu == "h100" else "16 x accumulation 2")]
        assert labels[4].startswith("2026-12-04") and labels[-1] == "smoke test, last checks"
        assert not any("past the budget" in line for line in lines[:6]), lines
        assert "compile 70" in lines[4] and "attribution 30" in lines[4] and "compile" not in lines[5].split(":")[1]
        assert total <= ablate.CALL_S == 540 and lines[-1] == f"planned: {total:.0f} s of 540, the install included"


def test_attribution_of_a_cuda_trace():
    """The CUDA side of the report, which the CPU dry run cannot reach, on a hand-written trace: kernels placed
    in the engine range whose launch they follow, busy and idle time, syncs, device-to-host copies, launches."""
    def x(name, cat, ts, dur, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args, "tid": 1}

    events = [x("STEP", "user_annotation", 0, 10_000), x("ENGINE_forward", "user_annotation", 0, 2_000),
              x("ENGINE_backward", "user_annotation", 2_000, 3_000), x("ENGINE_step", "user_annotation", 5_000, 4_000),
              x("cudaLaunchKernel", "cuda_runtime", 100, 10, correlation=1),
              x("cudaLaunchKernel", "cuda_runtime", 2_100, 10, correlation=2),
              x("cudaLaunchKernel", "cuda_runtime", 5_100, 10, correlation=3),
              x("cudaMemcpyAsync", "cuda_runtime", 5_200, 10, correlation=4),
              x("cudaStreamSynchronize", "cuda_runtime", 5_300, 700),
              x("aten::item", "cpu_op", 5_290, 720),
              x("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 200, 1_000, correlation=1),
              x("pytorch_flash::flash_bwd_kernel", "kernel", 2_200, 2_000, correlation=2),
              x("multi_tensor_apply_kernel<AdamFunctor>", "kernel", 5_150, 100, correlation=3),
              x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 5_400, 50, correlation=4)]
    r = attribute.attribution(events, cuda=True)
    assert r["step_ms"] == 10.0 and r["busy_ms"] == 3.15 and r["idle_ms"] == 6.85
    assert r["kernel_ms_by_category"] == {"communication": 0.0, "copies": 0.05, "attention": 2.0, "matmul": 1.0,
                                          "optimizer": 0.1, "norm/elementwise": 0.0}
    assert r["host_syncs"]["count"] == 1 and r["host_syncs"]["blocked_ms"] == 0.7
    assert r["host_syncs"]["sync_ops"]["aten::item"] == 1 and r["dtoh_copies"] == 1 and r["kernel_launches"] == 3
    assert {k: v["device"] for k, v in r["ranges_ms"].items()} == {"forward": 1.0, "backward": 2.0, "step": 0.15,
                                                                  "other": 0.0}
    assert r["ranges_ms"]["step"]["host"] == 4.0 and r["top_kernels"][0]["name"] == "pytorch_flash::flash_bwd_kernel"
    assert r["idle_gaps"] == {"count": 3, "total_ms": 6.5, "largest_ms": [4.55, 1.0, 0.95]}
