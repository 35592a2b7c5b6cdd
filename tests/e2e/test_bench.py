"""The GPU benchmark's CPU dry run: real data prep, a real DeepSpeed ZeRO-3 engine and ``train_step`` for every
objective of the tiny preset with SDPA, the flex rows marked as not measurable on CPU, the AdamW kernels last,
results written as JSON and a markdown table (~30 s, mostly start-up). Its budget: the alarm that ends a row at the
deadline, the optimizers' process killed with its children, a run out of budget from the start."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ONE_RANK, launch_training, logged_steps

from pipeline.planner import report as plan_cli

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
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


@pytest.mark.e2e
@pytest.mark.slow  # a benchmark's plumbing (~35 s): one rank, the trainer and a bare engine built side by side
def test_trainer_bench_times_trainer_fit_against_a_bare_engine(tmp_path):
    """bench/bench_trainer.py on one rank, 1 + 2 steps, validating at step 3: ``Trainer.fit`` trains every step
    (its metrics.jsonl), a bare step runs before each, and the report has each part and both ratios."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_trainer.py"), "--nproc", "1",
                           "--steps", "2", "--warmup", "1", "--eval-every", "3", "--eval-samples", "8",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO,
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
    """bench/gpu/ablate.py's CPU dry run: its best row (with no lever rows run, the baseline's config) in its own
    process on real shards and the trainer's engine, timed and attributed with the report's full shape; then
    launch/train.py on the same shards with the same experiment logs, for the step the bench timed, the FLOPs per
    token the bench reported (one ``Throughput`` over ``train_step``'s ``Work``). ~25 s on a quiet machine."""
    out, data = tmp_path / "out", tmp_path / "data"
    proc = subprocess.run([sys.executable, ablate.__file__, "--dry-run", "--out", str(out), "--data", str(data),
                           "--rows", "best"], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    [row] = results["rows"]
    assert row["group"] == "best" and row["setting"] == "the baseline" and not row["error"], row
    assert row["step_s"] > 0 and row["tokens_per_step"] > 0 and row["flops_per_token"] > 0, row
    report = json.loads((out / "attribution.json").read_text())["attribution"]
    assert set(report) == {"device", "step_ms", "busy_ms", "busy_share", "idle_ms", "idle_gaps",
                           "kernel_ms_by_category", "top_kernels", "host_syncs", "dtoh_copies", "kernel_launches",
                           "ranges_ms"}
    assert 0 < report["busy_ms"] <= report["step_ms"] and report["kernel_ms_by_category"]["matmul"] > 0
    assert all(report["ranges_ms"][r]["host"] > 0 for r in attribute.RANGES) and report["top_kernels"]
    assert "| best | the baseline | tiny | zero2.json | 2 x 1 |" in proc.stdout
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
    before a process starts; the best row combines the fastest measured settings; the planner's 7b row for the GPU
    present (here none: an H100's 80 GiB) is launch/plan.py's, its estimate beside it."""
    data = attribute.Data(str(tmp_path / "shards"), str(tmp_path / "tokenizer"))
    base = ablate.DRY.base
    assert ablate.config_error(base, data) == ""
    missing = ablate.config_error(dataclasses.replace(base, overrides=("model.no_such_lever=true",)), data)
    assert missing.startswith("config error: ") and "no_such_lever" in missing
    assert "ds_configs/zero9.json does not exist" in ablate.config_error(
        dataclasses.replace(base, ds_config="ds_configs/zero9.json"), data)

    first, rest = ablate.lever_rows(ablate.FULL)
    rows = first + rest
    assert [r.group for r in first] == ["baseline", "attention", "compile", "engine", "batch"]  # by value
    assert {r.group for r in rest} == {"engine", "attention", "checkpointing", "batch", "deepcompile"}
    batch = [r.config for r in rows if r.group == "batch"]
    assert all(c.micro_batch * c.grad_accum * c.seq_len >= 65536 for c in batch)
    speed = {"baseline": 1.0, "ds_configs/zero3.json": 0.8, "ds_configs/zero1.json": 1.3, "varlen": 1.5,
             "ds_configs/zero1_deepcompile.json": 1.4,  # faster, but the best row never takes it
             "flex": 1.2, "true": 0.9, f"micro 4 x accumulation {batch[0].grad_accum}": 2.0}
    for r in rows:
        r.tokens_per_s = speed.get(r.group if r.group == "baseline" else r.setting, 0.0)
    best = ablate.best_row(rows, ablate.FULL.base)
    assert best.config.ds_config == "ds_configs/zero1.json" and best.config.micro_batch == 4
    assert best.config.overrides == ("model.attn_implementation=varlen",)  # compile lost to the baseline
    assert best.config.grad_accum == batch[0].grad_accum

    planner = ablate.planner_row(ablate.FULL)  # what launch/plan.py says for the same GPU, model and batch
    assert planner.config.preset == "7b" and planner.setting.startswith("planner (h100)")
    assert 0 < planner.estimate_gib <= 80
    assert plan_cli.main(["--model", "7b", "--nodes", "1", "--gpus-per-node", "1", "--gpu", "h100", "--micro-batch",
                          "1", "--seq-len", str(ablate.FULL.base.seq_len), "--checkpointing", "full"]
                         + (["--offload"] if "offload" in planner.config.ds_config else [])) == 0
    assert f"({planner.config.ds_config})" in capsys.readouterr().out


@pytest.mark.e2e
def test_gpu_run_dry_run_smokes_then_plans_and_ablates(tmp_path):
    """bench/gpu/run.sh OUT --dry-run on the CPU: the smoke test's CPU form first (each check a line; the CUDA ones
    skip), then the ablation's: the GPU plan with each row's expected seconds against the budget, and its best row
    run; nothing of the user's command. ~80 s on a quiet machine."""
    out = tmp_path / "out"
    proc = subprocess.run([os.path.join(REPO, "bench", "gpu", "run.sh"), str(out), "--dry-run", "--rows", "best",
                           "--data", str(tmp_path / "data")], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    smoke = [line for line in proc.stdout.splitlines() if line.startswith("smoke ")]
    assert [line.split(":")[0] for line in smoke] == [f"smoke {name}" for name, *_ in smoke_checks()]
    assert all(": pass," in line or ": skip," in line for line in smoke), smoke
    assert "smoke varlen-causal: skip" in proc.stdout and "smoke zero3: pass" in proc.stdout
    assert proc.stdout.index("smoke: ") < proc.stdout.index("plan (expected seconds")
    plan = proc.stdout[proc.stdout.index("plan (expected seconds"):].splitlines()
    assert any(line.startswith("  best ") for line in plan) and any(line.startswith("  7b ") for line in plan)
    assert "| best | the baseline | tiny |" in proc.stdout and not (out / "user-run.log").exists()
    log = (out / "smoke.log").read_text()
    assert all(line in log for line in smoke) and f"smoke: {len(smoke)} of {len(smoke)} passed or skipped" in log


def test_the_bench_processes_rewrite_the_arch_list(monkeypatch):
    """The bench's processes (``_single_process_env``: attribute.py, ablate.py's rows, smoke.py) give DeepSpeed's
    op builds (DeepCompile's, FusedAdam's) the arch list they can read, as the trainer's start does: ``9.0a`` -> ``9.0``."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so undone after the test, unlike delenv of an absent key
        monkeypatch.delenv(key)
    _bench_module("bench_gpu")._single_process_env()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


def smoke_checks():
    sys.path.insert(0, os.path.dirname(BENCH_GPU))
    return importlib.import_module("smoke").CHECKS


def test_ablation_rows_are_what_they_say_on_cuda(tmp_path):
    """Each row's real overrides, resolved as the trainer would on a bf16 CUDA run: the baseline is eager and SDPA
    (``model.compile`` auto would compile it), the compile row alone compiles among the first rows, the varlen row
    runs varlen; the plan's first rows and ``best`` fit the default budget (the rest run when it grows)."""
    from pipeline.experiment import load_experiment
    from pipeline.train.compiling import body_compiles
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.kernels import attn_implementation

    data = attribute.Data(str(tmp_path / "shards"), str(tmp_path / "tokenizer"))
    first, rest = ablate.lever_rows(ablate.FULL)
    resolved = {}
    for r in first + rest:
        exp = load_experiment(None, attribute.experiment_overrides(r.config, data, str(tmp_path / "run")))
        ds = resolve_ds_config(load_ds_config(os.path.join(REPO, r.config.ds_config)), exp, 1, True)
        resolved[(r.group, r.setting)] = (body_compiles(exp, ds, cuda=True), attn_implementation(exp.model, True))
    assert resolved[("baseline", first[0].setting)] == (False, "sdpa")
    assert resolved[("attention", "varlen")] == (False, "pipeline_varlen")
    assert resolved[("compile", "true")] == (True, "sdpa")
    assert [compiled for compiled, _ in (resolved[(r.group, r.setting)] for r in first)] == [
        False, False, True, False, False]
    planned = [(r, False) for r in first] + [(ablate.best_row([], ablate.FULL.base), True)]
    lines = ablate.plan_lines(planned, ablate.FULL)
    assert len(lines) == 1 + len(planned) and not any("past the budget" in line for line in lines)
    assert "compile 70" in next(line for line in lines if line.startswith("  compile true"))


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
