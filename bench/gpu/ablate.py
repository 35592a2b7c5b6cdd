"""The GPU ablation in one command, the most valuable row first, on one GPU (bench/gpu/run.sh runs it):

    best            the a-priori best configuration of the 1b preset, attributed: varlen attention, compiled
                    layers, and the ZeRO stage and micro-batch the planner gives the GPU present (the largest
                    micro-batch that divides a >= 64k-token step and fits with the planner's 10 % headroom, at the
                    least sharding that fits it: ``planned_batch``), accumulated to >= 64k tokens a step
    2026-12-04      the configuration measured on 2026-12-04 (14.5 % MFU on an H200: ds_configs/zero3.json, micro 4,
                    SDPA with the dense document mask, eager), again on this card, beside the best row
    then by value   best eager (compile's worth; its loss beside best's checks the compiled numerics); best eager
                    with SDPA (varlen's worth over the dense-mask SDPA); best on zero2.json; the 210m preset's best;
                    best with SDPA, with flex; half the micro-batch; zero3.json; twice the micro-batch with
                    activation checkpointing, full and selective; DeepSpeed's compiler
                    (ds_configs/zero1_deepcompile.json); the 7b preset with the planner's choice (its memory estimate
                    beside the peak); last, best with DeepSpeed's FusedAdam (``optim.fused=deepspeed``: an nvcc
                    build of minutes)
    smoke, last     bench/gpu/smoke.py's last checks (FlexAttention's), with the time kept for them

Every row is the trainer's own engine (bench/gpu/attribute.py: ``build_engine``, ``train_step`` on packed synthetic
shards at seq 2048, 128k vocabulary, CLM, bf16), in its own process, so a crash, hang or out-of-memory costs that
row only, and prints its seconds a step and tokens/s beside its MFU (MFU counts attention per document now, so
tokens/s is what compares with the 2026-12-04 numbers and across cards). A lever is the trainer's switch, a
``--set`` override or a DeepSpeed JSON; one this checkout does not know fails its row with the config error, before
any process starts, and the run goes on.

The call's plan comes first: one device call of :data:`CALL_S` seconds, priced part by part from the constants
below (install and check, the smoke test's first checks, the shards, each row's start, engine build, cold or warm
compile, op builds, steps and attribution, the smoke test's last checks), with the running total; rows past it are
skipped unless time is left. run.sh passes the seconds the call has run (``--elapsed-s``): the ablation's deadline is the
call's, less the time kept for the last smoke checks; a running row is killed at it. Results are rewritten as each
row ends (OUT/results.json, OUT/results.md, printed at the end with OUT/attribution.md), so a kill keeps every
finished row. The compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, unless set) and the shards go to the
temporary directory, so OUT holds results alone.

    python bench/gpu/ablate.py --out OUT [--elapsed-s S | --budget-s S] [--rows best 2026-12-04 ...]
    python bench/gpu/ablate.py --dry-run --out OUT      # CPU: tiny preset, seq 64, fp32, 1 timed step a row
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import smoke  # noqa: E402
from attribute import DRY_RUN, Data, RunConfig, experiment_overrides  # noqa: E402

ROW_LINE = "ablation row: "  # a child's result line (DeepSpeed logs to stdout too)
ATTRIBUTION_STEPS = 1
VARLEN, COMPILED, EAGER = "model.attn_implementation=varlen", "model.compile=true", "model.compile=false"
SCRATCH = os.path.join(tempfile.gettempdir(), "bench-gpu")  # caches and shards: OUT holds results alone


@dataclass(frozen=True)
class Settings:
    base: RunConfig
    step_tokens: int  # a best row's tokens per GPU step (at least)
    small_preset: str  # the second preset's best row
    big_preset: str  # the planner's row
    gpu: str | None  # the planner's GPU (pipeline.planner.estimates.GPUS key); None: the GPU present (planner_gpu)
    warmup: int
    steps: int
    min_row_s: float  # a row is skipped with less than this left
    best_levers: tuple[str, ...]  # the best row's switches
    call_s: float  # the call's deadline, from run.sh's start


# One device call's command runs at most 600 s; the plan keeps 60 for the tool's transfers and a margin.
CALL_S = 540.0
FULL = Settings(RunConfig(), step_tokens=65536, small_preset="210m", big_preset="7b", gpu=None, warmup=2, steps=3,
                min_row_s=40, best_levers=(VARLEN, COMPILED), call_s=CALL_S)
# CPU: no varlen kernel, and a compile costs minutes on two cores: the dry run's best row is SDPA and eager; its
# timings mean nothing, so the call's deadline is far (the plan it prints is the GPU's)
DRY = Settings(DRY_RUN, step_tokens=4 * DRY_RUN.micro_batch * DRY_RUN.seq_len, small_preset="tiny",
               big_preset="tiny", gpu="h100", warmup=1, steps=1, min_row_s=0, best_levers=(), call_s=3600)

# The plan's prices, in seconds on one H100 (conservative: estimates from issue 32's H200 runs and the builds' usual
# lengths, not yet measured against this ablation).
INSTALL_S = 30.0  # install.sh from the carried wheels and check_stack.py's imports
DATA_S = 20.0  # the ablation's own start and its synthetic shards (prepare_data)
START_S = 20.0  # a row's interpreter, imports and process group
ENGINE_S = {"tiny": 2.0, "210m": 5.0, "1b": 10.0, "7b": 45.0}  # the engine build (on the GPU below ZeRO-3)
COMPILE_S = 70.0  # a cold compile of the decoder layer, forward and backward
COMPILE_WARM_S = 25.0  # one an earlier row compiled (same preset, attention, micro-batch, checkpointing): cached
BUILD_S = 180.0  # a JIT-built DeepSpeed op (FusedAdam, DeepCompile's, CPU Adam): nvcc or a C++ compiler, cold
DEEPCOMPILE_S = 2 * COMPILE_S  # DeepCompile compiles the whole module, not one layer
OFFLOAD_STEP_S = 10.0  # a CPU optimizer step over 7b's parameters (ZeRO-3 offload), each step
SECONDS_PER_TOKEN = {"tiny": 2e-5, "210m": 1.5e-5, "1b": 4.5e-5, "7b": 3.2e-4}  # the 2026-12-04 speeds
ATTRIBUTION_S = 30.0  # the profiled step's trace: export, report, the trimmed gzip


@dataclass
class Row:
    group: str
    setting: str
    config: RunConfig
    attribute: bool = False  # profile one more step into OUT/attribution.*
    step_s: float = 0.0
    tokens_per_step: int = 0
    tokens_per_s: float = 0.0
    flops_per_token: float = 0.0
    mfu: float | None = None
    peak_mem_gib: float | None = None
    loss: float | None = None  # the last timed step's
    estimate_gib: float | None = None  # the planner's memory estimate (7b row)
    seconds: float = 0.0  # the row's process, start to end
    error: str = ""


def planned_batch(s: Settings, preset: str, gpu: str) -> tuple[str, int, int]:
    """(DeepSpeed JSON, micro-batch, accumulation) for ``preset`` on one ``gpu`` at ``s.step_tokens`` a step,
    without activation checkpointing: the largest micro-batch that divides the step's sequences and leaves the
    planner's :data:`~pipeline.planner.report.THIN_HEADROOM`, at the least sharding that fits it
    (``launch/plan.py``'s memory and choice). The step then is exactly ``s.step_tokens``."""
    from pipeline.planner.report import DS_CONFIGS, THIN_HEADROOM, PlannerInput, memory

    sequences = max(1, s.step_tokens // s.base.seq_len)
    for micro in (m for m in range(sequences, 0, -1) if sequences % m == 0):
        mem = memory(PlannerInput(model=preset, nodes=1, gpus_per_node=1, gpu=gpu, micro_batch=micro,
                                  seq_len=s.base.seq_len, vocab=s.base.vocab))
        if mem.fits and mem.headroom >= THIN_HEADROOM:
            return DS_CONFIGS[(mem.zero, False)], micro, sequences // micro
    raise ValueError(f"the planner fits no micro-batch of {preset} at seq {s.base.seq_len} on one {gpu}")


def best_config(s: Settings, preset: str, gpu: str) -> RunConfig:
    """The a-priori best configuration of ``preset``: :attr:`Settings.best_levers` at :func:`planned_batch`."""
    ds_config, micro, accum = planned_batch(s, preset, gpu)
    return replace(s.base, preset=preset, ds_config=ds_config, micro_batch=micro, grad_accum=accum,
                   overrides=s.best_levers)


def ablation_rows(s: Settings, gpu: str) -> list[Row]:
    """Every row, in the order of their value (the budget cuts from the end): the best configuration (attributed),
    the 2026-12-04 one, then each a change of the best."""
    best = best_config(s, s.base.preset, gpu)
    b = f"{best.ds_config.removeprefix('ds_configs/')}, micro {best.micro_batch} x accumulation {best.grad_accum}"

    def vary(group: str, label: str, *overrides: str, **changes) -> Row:
        return Row(group, label, replace(best, overrides=best.overrides + overrides, **changes))

    micro, accum = best.micro_batch, best.grad_accum
    return [
        Row("best", f"{' '.join(best.overrides) or 'sdpa, eager'}, {b}", best, attribute=True),
        Row("2026-12-04", "ds_configs/zero3.json, micro 4, sdpa, eager (14.5 % MFU on an H200)",
            replace(s.base, ds_config="ds_configs/zero3.json", grad_accum=1)),
        vary("compile", "best, eager", EAGER),
        vary("attention", "best, eager, sdpa (dense document mask)", EAGER, "model.attn_implementation=sdpa"),
        vary("engine", "best on ds_configs/zero2.json", ds_config="ds_configs/zero2.json"),
        Row("preset", f"{s.small_preset}'s best", best_config(s, s.small_preset, gpu)),
        vary("attention", "best, sdpa (dense document mask)", "model.attn_implementation=sdpa"),
        vary("attention", "best, flex", "model.attn_implementation=flex"),
        vary("batch", f"best at micro {max(1, micro // 2)} x accumulation {accum * 2 if micro > 1 else accum}",
             micro_batch=max(1, micro // 2), grad_accum=accum * 2 if micro > 1 else accum),
        vary("engine", "best on ds_configs/zero3.json", ds_config="ds_configs/zero3.json"),
        vary("checkpointing", f"best at micro {2 * micro}, on", "model.activation_checkpointing=true",
             micro_batch=2 * micro, grad_accum=max(1, accum // 2)),
        # selective checkpointing with compile is refused (pipeline.train.compiling.check_compile): eager
        vary("checkpointing", f"best at micro {2 * micro}, selective, eager", "model.activation_checkpointing=selective",
             EAGER, micro_batch=2 * micro, grad_accum=max(1, accum // 2)),
        # DeepSpeed's own compiler (it refuses model.compile: true) against the best row's per-layer compile
        vary("deepcompile", "best on ds_configs/zero1_deepcompile.json", EAGER,
             ds_config="ds_configs/zero1_deepcompile.json"),
        planner_row(s, gpu),
        vary("optimizer", "best with DeepSpeed's FusedAdam (optim.fused=deepspeed)", "optim.fused=deepspeed"),
    ]


def planner_row(s: Settings, gpu: str) -> Row:
    """The planner's choice for ``s.big_preset`` on one ``gpu`` at micro 1: ``launch/plan.py``'s least sharding
    that fits (``least_sharding``), without activation checkpointing, else with it, else ZeRO-3 offload with it;
    its memory estimate (model states by DeepSpeed's estimators, activations, the runtime reserve) goes beside the
    measured peak."""
    from pipeline.model.flops import param_counts
    from pipeline.model.presets import get_preset
    from pipeline.planner.estimates import GIB, GPUS, activation_bytes, largest_layer_params, model_states
    from pipeline.planner.report import DS_CONFIGS, PlannerInput, least_sharding

    config = get_preset(s.big_preset).to_config(s.base.vocab)
    plan = PlannerInput(model=s.big_preset, nodes=1, gpus_per_node=1, gpu=gpu, micro_batch=1, seq_len=s.base.seq_len)
    params, largest, memory = param_counts(config).total, largest_layer_params(config), GPUS[gpu].memory_gib

    def estimate_gib(zero: int, offload: bool, checkpointing: str) -> float:
        states = model_states(params, largest, zero, offload, 1, 1)
        acts = activation_bytes(config, plan.seq_len, plan.targets, checkpointing, plan.lm_head_chunk)
        return (states.gpu + sum(acts.values())) / GIB + plan.reserve_gib

    for checkpointing, offload in (("none", False), ("full", False), ("full", True)):
        zero = least_sharding(lambda z, o=offload, c=checkpointing: estimate_gib(z, o, c) <= memory, offload)
        if estimate_gib(zero, offload, checkpointing) <= memory:
            break
    ds_config = DS_CONFIGS[(zero, offload)]
    overrides = ("model.activation_checkpointing=true",) if checkpointing == "full" else ()
    return Row(s.big_preset, f"planner ({gpu}): {ds_config}" + (", activation checkpointing" if overrides else ""),
               replace(s.base, preset=s.big_preset, ds_config=ds_config, micro_batch=1, grad_accum=1,
                       overrides=overrides), estimate_gib=round(estimate_gib(zero, offload, checkpointing), 1))


def planner_gpu() -> str:
    """The planner's key of the GPU present (an H100's 80 GiB, not an H200's 141), H100 where none or unknown."""
    import torch

    from pipeline.planner.estimates import gpu_key

    if not torch.cuda.is_available():
        return "h100"
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    return gpu_key(torch.cuda.get_device_name(), memory) or "h100"


def setting(cfg: RunConfig, key: str, default: str) -> str:
    """The value of the experiment key ``key`` in ``cfg``'s overrides (the last wins, as in the trainer)."""
    return next((o.split("=", 1)[1] for o in reversed(cfg.overrides) if o.startswith(key + "=")), default)


def expected_seconds(row: Row, s: Settings, compiled_before: set) -> dict[str, float]:
    """The row's planned seconds on the GPU by part; ``compiled_before`` holds the layer graphs earlier rows
    compiled (a row's own is added), whose compile is then a warm one."""
    c = row.config
    tokens = (s.warmup + s.steps + (1 if row.attribute else 0)) * c.micro_batch * c.grad_accum * c.seq_len
    graph = (c.preset, setting(c, "model.attn_implementation", "sdpa"), c.micro_batch,
             setting(c, "model.activation_checkpointing", "false"))
    deepcompile = "deepcompile" in c.ds_config
    compile_s = 0.0
    if deepcompile:
        compile_s = DEEPCOMPILE_S
    elif setting(c, "model.compile", "false") == "true":
        compile_s = COMPILE_WARM_S if graph in compiled_before else COMPILE_S
        compiled_before.add(graph)
    offload = "offload" in c.ds_config
    builds = BUILD_S * sum((deepcompile, offload, setting(c, "optim.fused", "auto") == "deepspeed"))
    parts = {"start": START_S, "engine": ENGINE_S.get(c.preset, 30.0), "builds": builds, "compile": compile_s,
             "steps": tokens * SECONDS_PER_TOKEN.get(c.preset, 1e-4)
             + (OFFLOAD_STEP_S * (s.warmup + s.steps) if offload else 0.0),
             "attribution": ATTRIBUTION_S if row.attribute else 0.0}
    return {k: round(v, 1) for k, v in parts.items()}


def plan(rows: list[Row], s: Settings) -> tuple[list[str], float]:
    """The call's plan against :data:`CALL_S`: what runs before the ablation, each row with its expected seconds
    and the running total, and the smoke test's last checks, whose time is kept; and the total of what fits."""
    last = smoke.price_s(last=True)
    lines = [f"plan of one call (expected seconds on one H100, cold; prices in bench/gpu/ablate.py and "
             f"bench/gpu/smoke.py): {CALL_S:.0f} s, {last:.0f} of them kept for the smoke test's last checks"]
    total = 0.0

    def add(label: str, parts: dict[str, float], fits: bool = True) -> None:
        nonlocal total
        seconds = sum(parts.values())
        total += seconds if fits else 0.0
        lines.append(f"  {label}: {seconds:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if v)
                     + f"); total {total:.0f} s" + ("" if fits else "  (past the budget: skipped unless time is left)"))

    add("install and check", {"install": INSTALL_S})
    first = [c for c in smoke.CHECKS if not c.last]
    add("smoke test, first checks", {"start": smoke.START_S} | {c.name: c.price_s for c in first})
    add("the ablation's start and shards", {"data": DATA_S})
    compiled: set = set()
    fitting = True
    for row in rows:
        parts = expected_seconds(row, s, compiled)
        fitting = fitting and total + sum(parts.values()) + last <= CALL_S
        add(f"{row.group} {row.setting}", parts, fitting)
    add("smoke test, last checks", {"start": smoke.START_S} | {c.name: c.price_s for c in smoke.CHECKS if c.last})
    lines.append(f"planned: {total:.0f} s of {CALL_S:.0f}, the install included")
    return lines, total


def config_error(cfg: RunConfig, data: Data) -> str:
    """Why the trainer would refuse ``cfg`` (a switch this checkout lacks, a missing JSON), or ''."""
    from pipeline.config import ConfigError
    from pipeline.experiment import load_experiment

    if not os.path.exists(os.path.join(REPO, cfg.ds_config)):
        return f"config error: {cfg.ds_config} does not exist in this checkout"
    try:
        load_experiment(None, experiment_overrides(cfg, data, "unused"))
    except ConfigError as e:
        return f"config error: {e}"[:200]
    return ""


def run_row(row: Row, s: Settings, data: Data, out: str, deadline: float) -> None:
    """``row`` in a child process (this script with --row), killed at ``deadline``; fills the row in place."""
    from bench_gpu import CUT_AT_BUDGET, run_until

    started = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--row", json.dumps(asdict(row.config)), "--data-json",
           json.dumps(asdict(data)), "--out", out, "--warmup", str(s.warmup), "--steps", str(s.steps)]
    output, killed = run_until(cmd + (["--attribute"] if row.attribute else []), deadline)
    row.seconds = time.time() - started
    measured = [json.loads(line.removeprefix(ROW_LINE)) for line in output.splitlines() if line.startswith(ROW_LINE)]
    print("\n".join(line for line in output.splitlines() if not line.startswith(ROW_LINE)), flush=True)
    if measured:
        for key, value in measured[-1].items():
            setattr(row, key, value)
    else:
        row.error = CUT_AT_BUDGET if killed else "no result: the row's process failed (its traceback is above)"


def child(args: argparse.Namespace) -> None:
    """One row (``--row``): time it, and with ``--attribute`` profile one step into OUT/attribution.*; prints its
    :data:`ROW_LINE`."""
    from attribute import opened_engine, profile_step, single_process, timed, write_attribution
    from bench_gpu import _failure

    from pipeline.model.flops import device_peak_tflops

    raw = json.loads(args.row)
    cfg, data = RunConfig(**{**raw, "overrides": tuple(raw["overrides"])}), Data(**json.loads(args.data_json))
    device = single_process()
    cuda = device.type == "cuda"
    result: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ablate_") as work, opened_engine(cfg, data, work, device) as e:
            perf = timed(e, args.warmup, args.steps, device_peak_tflops(0.0) if cuda else 0.0)
            result = {k: perf[k] for k in ("step_s", "tokens_per_step", "tokens_per_s", "flops_per_token", "mfu",
                                           "peak_mem_gib", "loss")}
            if args.attribute:
                write_attribution(args.out, cfg, perf, profile_step(e, args.out))
    except Exception as e:  # (a row's failure, e.g. out of memory, is its result)
        result["error"] = _failure(e, cuda)
    print(ROW_LINE + json.dumps(result), flush=True)


def summary(r: Row) -> str:
    """The row's line: seconds a step and tokens/s beside the MFU (which compare across MFU definitions and cards),
    the loss."""
    return r.error or (f"{r.step_s:.3f} s/step, {r.tokens_per_s:,.0f} tokens/s"
                       + (f", MFU {r.mfu:.1%}" if r.mfu is not None else "")
                       + (f", loss {r.loss:.4f}" if r.loss is not None else ""))


def write_results(out: str, meta: dict, rows: list[Row]) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    best = next((r for r in rows if r.group == "best" and r.tokens_per_s), None)
    lines = [f"# GPU ablation: {meta['device']}", "",
             f"seq {meta['seq_len']}, vocab {meta['vocab']}, {meta['dtype']}, CLM on packed documents with document "
             f"masking; {meta['warmup']} warm-up + {meta['steps']} timed steps a row, each in its own process; "
             "tokens/s, FLOPs and MFU as the training log computes them (perf/*: attention counted per document); "
             "the loss is the last timed step's.", "",
             "| lever | setting | preset | engine | micro x accum | tokens/step | step (s) | tokens/s | MFU | loss "
             "| peak GiB | planner GiB | vs best | row s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.config
        cells = [r.group, r.setting, c.preset, c.ds_config.removeprefix("ds_configs/"),
                 f"{c.micro_batch} x {c.grad_accum}"]
        planner = f"{r.estimate_gib:.1f}" if r.estimate_gib is not None else ""
        if r.error or not r.tokens_per_s:
            lines.append("| " + " | ".join(cells + [r.error or "not run", "", "", "", "", "", planner, "",
                                                    f"{r.seconds:.0f}" if r.seconds else ""]) + " |")
            continue
        versus = f"{r.tokens_per_s / best.tokens_per_s:.2f}x" if best and c.preset == best.config.preset else "-"
        cells += [f"{r.tokens_per_step:,}", f"{r.step_s:.3f}", f"{r.tokens_per_s:,.0f}",
                  f"{r.mfu:.1%}" if r.mfu is not None else "-", f"{r.loss:.4f}" if r.loss is not None else "-",
                  f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-", planner, versus, f"{r.seconds:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    from pipeline.train.deepspeed_ops import use_install_ops_dir

    use_install_ops_dir()  # DeepSpeed's ops, this process's and its children's, in this install's folder
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for results.json, results.md, attribution.*")
    parser.add_argument("--dry-run", action="store_true", help="CPU check: tiny preset, seq 64, fp32, 1 step a row")
    parser.add_argument("--elapsed-s", type=float, default=0.0,
                        help=f"seconds the device call has run before (run.sh's); the ablation ends by {CALL_S:.0f}")
    parser.add_argument("--budget-s", type=float, help="the ablation's own limit in seconds, instead")
    parser.add_argument("--rows", nargs="+", help="only the rows of these groups (best, 2026-12-04, compile, "
                        "attention, engine, preset, batch, checkpointing, deepcompile, optimizer, the planner's "
                        "preset) and, with smoke, the smoke test's last checks")
    parser.add_argument("--data", help="where the synthetic shards are (built there when missing; default "
                        f"{os.path.join(SCRATCH, 'data')})")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child: the RunConfig as JSON
    parser.add_argument("--data-json", help=argparse.SUPPRESS)
    parser.add_argument("--attribute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.makedirs(args.out, exist_ok=True)
    if args.row:
        child(args)
        return 0
    run(DRY if args.dry_run else FULL, args, started)
    return 0


def run(s: Settings, args: argparse.Namespace, started: float) -> None:
    """The plan, the data, the rows in order while the budget allows, then the smoke test's last checks."""
    from attribute import prepare_data
    from bench_gpu import OVER_BUDGET, run_until

    gpu = s.gpu or planner_gpu()
    deadline = started + (args.budget_s if args.budget_s is not None else s.call_s - args.elapsed_s)
    last = smoke.price_s(last=True)
    out = os.path.abspath(args.out)
    print("\n".join(plan(ablation_rows(FULL, gpu), FULL)[0]), flush=True)  # the GPU's, printed on a dry run too
    print(f"this run: {deadline - time.time():.0f} s left, {last:.0f} of them kept for the last smoke checks",
          flush=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(SCRATCH, "inductor-cache"))  # shared by the rows
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(SCRATCH, "triton-cache"))
    rows = ablation_rows(s, gpu)
    wanted = set(args.rows or [])
    most = max((r.config for r in rows), key=lambda c: c.micro_batch * c.grad_accum)
    data = prepare_data(args.data or os.path.join(SCRATCH, "data"), s.base,
                        (s.warmup + s.steps + ATTRIBUTION_STEPS) * most.micro_batch * most.grad_accum)
    print(f"data ready ({time.time() - started:.0f} s)", flush=True)
    meta = {"device": device_name(args.dry_run), "planner_gpu": gpu, "seq_len": s.base.seq_len,
            "vocab": s.base.vocab, "dtype": "bf16" if s.base.bf16 else "fp32", "warmup": s.warmup, "steps": s.steps,
            "data": asdict(data)}
    done: list[Row] = []
    for row in rows:
        if wanted and row.group not in wanted:
            continue
        done.append(row)
        row.error = config_error(row.config, data)
        if not row.error and deadline - last - time.time() < max(s.min_row_s, 0.0):
            row.error = OVER_BUDGET
        if not row.error:
            run_row(row, s, data, out, deadline - last)
        print(f"{row.group} {row.setting}: {summary(row)}", flush=True)
        write_results(out, meta, done)
    if not wanted or "smoke" in wanted:
        output, _ = run_until([sys.executable, smoke.__file__, "--last"] + (["--dry-run"] if args.dry_run else []),
                              deadline)
        print(output, end="", flush=True)
        with open(os.path.join(out, "smoke.log"), "a") as f:
            f.write(output)
    text = open(os.path.join(out, "results.md")).read() if done else "no rows\n"
    attribution = os.path.join(out, "attribution.md")
    if os.path.exists(attribution):
        text += "\n" + open(attribution).read()
    print("\n" + text + f"\ndone in {time.time() - started:.0f} s; wrote {out}/results.md and results.json", flush=True)


def device_name(dry_run: bool) -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() and not dry_run else "CPU (dry run)"


if __name__ == "__main__":
    sys.exit(main())
