"""The GPU ablation in one command: each speed lever on and off on the 1b preset, the best combination with the
attribution of its step, and a 7b row with the planner's choice, on one GPU (bench/gpu/run.sh runs it).

Every row is the trainer's own engine (bench/gpu/attribute.py: ``build_train_model``, ``deepspeed.initialize``,
``train_step`` on packed synthetic shards at seq 2048, 128k vocabulary, CLM, bf16), in its own process, so a crash,
hang or out-of-memory costs that row only. The levers are the trainer's switches, passed as ``--set`` overrides or
DeepSpeed JSONs; the baseline is the issue's fastest measured config (``ds_configs/zero2.json``, micro 4, SDPA with
the dense document mask, really eager: ``model.compile=false``, since auto compiles on CUDA), and each row changes
one thing. In the order of their value (the budget cuts from the end):

    baseline        zero2, sdpa, eager, micro 4
    attention       model.attn_implementation = varlen
    compile         model.compile = true
    engine          ds_configs/zero1.json
    batch           micro 4 x accumulation 8 (>= 64k tokens a GPU step)
    best            the fastest engine, attention and compile rows at the fastest >= 64k-token batch, attributed
    then            ds_configs/zero3.json; micro 8 x accumulation 4; flex; micro 8 without and with
                    model.activation_checkpointing (true, selective: eager, as compile refuses it);
                    ds_configs/zero1_deepcompile.json (DeepSpeed's compiler path), to read against zero1.json
    7b              the planner's choice for the GPU present (launch/plan.py's least sharding that fits, without
                    activation checkpointing, else with it, else offload) with its memory estimate beside the peak

The run first prints the plan: each row's expected seconds (start, engine build, compile, steps, attribution) and
the running total against the budget. The rows share one inductor and Triton cache under OUT
(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, unless set) and the shards under OUT/data. ``auto`` rows are gone: on a
bf16 GPU ``attn_implementation: auto`` is varlen and ``compile: auto`` is true, rows above.

A switch the checkout does not know (a lever another branch adds) or a missing JSON fails that row, before any
process starts, with the config error; the run goes on. Rows run in this order and each is skipped once the
``--budget-s`` deadline would be passed (a running row is killed at it). Results are rewritten after every row:
OUT/results.json, OUT/results.md (printed at the end, with the attribution, OUT/attribution.md).

    python bench/gpu/ablate.py --out OUT [--budget-s 390] [--rows baseline best ...]
    python bench/gpu/ablate.py --dry-run --out OUT      # CPU: tiny preset, seq 64, fp32, 1 timed step a row
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attribute import DRY_RUN, Data, RunConfig, experiment_overrides  # noqa: E402

ROW_LINE = "ablation row: "  # a child's result line (DeepSpeed logs to stdout too)
GROUPS = ("engine", "attention", "compile")  # the levers the best row combines
ATTRIBUTION_STEPS = 1


@dataclass(frozen=True)
class Settings:
    base: RunConfig
    step_tokens: int  # the batch rows' tokens per GPU step
    big_preset: str  # the planner's row
    gpu: str | None  # the planner's GPU (pipeline.planner.estimates.GPUS key); None: the GPU present (planner_gpu)
    warmup: int
    steps: int
    budget_s: float
    min_row_s: float  # a row is skipped with less than this left


FULL = Settings(RunConfig(), step_tokens=65536, big_preset="7b", gpu=None, warmup=2, steps=3, budget_s=390,
                min_row_s=40)
DRY = Settings(DRY_RUN, step_tokens=4 * DRY_RUN.micro_batch * DRY_RUN.seq_len, big_preset="tiny", gpu="h100",
               warmup=1, steps=1, budget_s=600, min_row_s=0)

# What a row costs on one H100/H200, by part, for the plan (an estimate from issue 32's H200 runs, not yet measured
# against this ablation): the child's interpreter, imports and process group; the engine build (on the GPU below
# ZeRO-3); a cold compile of the decoder layer (forward and backward; the inductor cache under OUT shares what an
# earlier row compiled); the steps at the preset's seconds per token; the profiled step of the attributed row.
START_S = 20.0
ENGINE_S = {"tiny": 2.0, "210m": 5.0, "1b": 10.0, "7b": 45.0}
COMPILE_S = 70.0
SECONDS_PER_TOKEN = {"tiny": 2e-5, "210m": 1.5e-5, "1b": 4.5e-5, "7b": 3.2e-4}
ATTRIBUTION_S = 15.0


@dataclass
class Row:
    group: str
    setting: str
    config: RunConfig
    step_s: float = 0.0
    tokens_per_step: int = 0
    tokens_per_s: float = 0.0
    flops_per_token: float = 0.0
    mfu: float | None = None
    peak_mem_gib: float | None = None
    estimate_gib: float | None = None  # the planner's memory estimate (7b row)
    seconds: float = 0.0  # the row's process, start to end
    error: str = ""


def lever_rows(s: Settings) -> tuple[list[Row], list[Row]]:
    """(the rows ``best`` combines, in the order of their value: the really eager baseline, varlen, compile, ZeRO-1,
    the >= 64k-token batch; the rest, run after ``best``). ``auto`` rows are gone: on a bf16 GPU run auto is varlen
    and compiled, the rows above."""
    b = s.base
    accum = max(1, math.ceil(s.step_tokens / (b.micro_batch * b.seq_len)))

    def row(group: str, setting: str, *overrides: str, **changes) -> Row:
        return Row(group, setting, replace(b, overrides=overrides, **changes))

    first = [
        row("baseline", f"{b.ds_config}, sdpa, eager (model.compile=false), micro {b.micro_batch}"),
        row("attention", "varlen", "model.attn_implementation=varlen"),
        row("compile", "true", "model.compile=true"),
        row("engine", "ds_configs/zero1.json", ds_config="ds_configs/zero1.json"),
        row("batch", f"micro {b.micro_batch} x accumulation {accum}", grad_accum=accum),
    ]
    return first, [
        row("engine", "ds_configs/zero3.json", ds_config="ds_configs/zero3.json"),
        row("batch", f"micro {2 * b.micro_batch} x accumulation {max(1, accum // 2)}", micro_batch=2 * b.micro_batch,
            grad_accum=max(1, accum // 2)),
        row("attention", "flex", "model.attn_implementation=flex"),
        row("checkpointing", f"micro {2 * b.micro_batch}, off", micro_batch=2 * b.micro_batch),
        row("checkpointing", f"micro {2 * b.micro_batch}, on", "model.activation_checkpointing=true",
            micro_batch=2 * b.micro_batch),
        # selective checkpointing with compile is refused (pipeline.train.compiling.check_compile): this row is eager
        row("checkpointing", f"micro {2 * b.micro_batch}, selective", "model.activation_checkpointing=selective",
            micro_batch=2 * b.micro_batch),
        # DeepSpeed's own compiler against zero1.json; not a lever the best row combines (it excludes model.compile)
        row("deepcompile", "ds_configs/zero1_deepcompile.json", ds_config="ds_configs/zero1_deepcompile.json"),
    ]


def best_row(rows: list[Row], base: RunConfig) -> Row:
    """The fastest measured setting of each of :data:`GROUPS` (the baseline's where none beat it) at the fastest
    measured batch row (the baseline's batch where none ran)."""
    ok = [r for r in rows if r.tokens_per_s > 0]
    baseline = next((r for r in ok if r.group == "baseline"), None)
    config, chosen = base, []
    for group in GROUPS:
        fastest = max((r for r in ok if r.group == group), key=lambda r: r.tokens_per_s, default=None)
        if fastest and (baseline is None or fastest.tokens_per_s > baseline.tokens_per_s):
            config = replace(config, overrides=config.overrides + fastest.config.overrides,
                             ds_config=fastest.config.ds_config if group == "engine" else config.ds_config)
            chosen.append(f"{group} {fastest.setting}")
    batch = max((r for r in ok if r.group == "batch"), key=lambda r: r.tokens_per_s, default=None)
    if batch:
        config = replace(config, micro_batch=batch.config.micro_batch, grad_accum=batch.config.grad_accum)
        chosen.append(batch.setting)
    return Row("best", ", ".join(chosen) or "the baseline", config)


def planner_row(s: Settings) -> Row:
    """The planner's choice for ``s.big_preset`` on one ``s.gpu`` at micro 1: ``launch/plan.py``'s least sharding
    that fits (``least_sharding``), without activation checkpointing, else with it, else ZeRO-3 offload with it;
    its memory estimate (model states by DeepSpeed's estimators, activations, the runtime reserve) goes beside the
    measured peak."""
    from pipeline.model.flops import param_counts
    from pipeline.model.presets import get_preset
    from pipeline.planner.estimates import GIB, GPUS, activation_bytes, largest_layer_params, model_states
    from pipeline.planner.report import DS_CONFIGS, PlannerInput, least_sharding

    gpu = s.gpu or planner_gpu()
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


def compiled(cfg: RunConfig) -> bool:
    """Whether the row compiles the decoder layer (the bench's own default is eager)."""
    return any(o in ("model.compile=true", "model.compile=auto") for o in cfg.overrides)


def expected_seconds(row: Row, s: Settings, attribute: bool = False) -> dict[str, float]:
    """The row's planned seconds on the GPU by part (:data:`START_S` and the rest)."""
    c = row.config
    tokens = (s.warmup + s.steps + (1 if attribute else 0)) * c.micro_batch * c.grad_accum * c.seq_len
    parts = {"start": START_S, "engine": ENGINE_S.get(c.preset, 30.0),
             "compile": COMPILE_S if compiled(c) else 0.0,
             "steps": tokens * SECONDS_PER_TOKEN.get(c.preset, 1e-4),
             "attribution": ATTRIBUTION_S if attribute else 0.0}
    return {k: round(v, 1) for k, v in parts.items()}


def plan_lines(rows: list[tuple[Row, bool]], s: Settings) -> list[str]:
    """Each planned row with its expected seconds, the running total, and whether it fits ``s.budget_s``."""
    lines, total = [f"plan (expected seconds on one H100/H200; budget {s.budget_s:.0f} s):"], 0.0
    for row, attribute in rows:
        parts = expected_seconds(row, s, attribute)
        total += sum(parts.values())
        fits = "" if total <= s.budget_s else "  (past the budget: skipped unless --budget-s grows)"
        lines.append(f"  {row.group} {row.setting}: {sum(parts.values()):.0f} s ("
                     + ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if v) + f"); total {total:.0f} s{fits}")
    return lines


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


def run_row(row: Row, s: Settings, data: Data, out: str, deadline: float, attribute: bool) -> None:
    """``row`` in a child process (this script with --row), killed at ``deadline``; fills the row in place."""
    from bench_gpu import CUT_AT_BUDGET, run_until

    started = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--row", json.dumps(asdict(row.config)), "--data-json",
           json.dumps(asdict(data)), "--out", out, "--warmup", str(s.warmup), "--steps", str(s.steps)]
    output, killed = run_until(cmd + (["--attribute"] if attribute else []), deadline)
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
                                           "peak_mem_gib")}
            if args.attribute:
                write_attribution(args.out, cfg, perf, profile_step(e, args.out))
    except Exception as e:  # (a row's failure, e.g. out of memory, is its result)
        result["error"] = _failure(e, cuda)
    print(ROW_LINE + json.dumps(result), flush=True)


def write_results(out: str, meta: dict, rows: list[Row]) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    baseline = next((r for r in rows if r.group == "baseline" and r.tokens_per_s), None)
    lines = [f"# GPU ablation: {meta['device']}", "",
             f"seq {meta['seq_len']}, vocab {meta['vocab']}, {meta['dtype']}, CLM on packed documents with document "
             f"masking; {meta['warmup']} warm-up + {meta['steps']} timed steps a row, each in its own process; "
             "tokens/s, FLOPs and MFU as the training log computes them (perf/*).", "",
             "| lever | setting | preset | engine | micro x accum | tokens/step | step (s) | tokens/s | MFU | peak GiB "
             "| planner GiB | vs baseline | row s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.config
        cells = [r.group, r.setting, c.preset, c.ds_config.removeprefix("ds_configs/"),
                 f"{c.micro_batch} x {c.grad_accum}"]
        planner = f"{r.estimate_gib:.1f}" if r.estimate_gib is not None else ""
        if r.error or not r.tokens_per_s:
            lines.append("| " + " | ".join(cells + [r.error or "not run", "", "", "", "", planner, "",
                                                    f"{r.seconds:.0f}" if r.seconds else ""]) + " |")
            continue
        cells += [f"{r.tokens_per_step:,}", f"{r.step_s:.3f}", f"{r.tokens_per_s:,.0f}",
                  f"{r.mfu:.1%}" if r.mfu is not None else "-",
                  f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-",
                  planner, f"{r.tokens_per_s / baseline.tokens_per_s:.2f}x" if baseline else "-", f"{r.seconds:.0f}"]
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
    parser.add_argument("--budget-s", type=float, help="the whole run's limit in seconds (default 390)")
    parser.add_argument("--rows", nargs="+", help="only the rows of these groups (baseline, engine, attention, "
                        "compile, checkpointing, batch, best, and the planner's preset)")
    parser.add_argument("--data", help="where the synthetic shards are (built there when missing; default OUT/data)")
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
    s = DRY if args.dry_run else FULL
    s = replace(s, budget_s=args.budget_s if args.budget_s is not None else s.budget_s)
    run(s, args, started)
    return 0


def run(s: Settings, args: argparse.Namespace, started: float) -> None:
    """The data, then the lever rows, the best one (attributed) and the planner's, each while the budget allows."""
    from attribute import prepare_data
    from bench_gpu import OVER_BUDGET

    deadline = started + s.budget_s
    out = os.path.abspath(args.out)
    first, rest = lever_rows(s)
    rows = first + rest
    full_first, full_rest = lever_rows(replace(FULL, budget_s=s.budget_s))  # the GPU's plan, printed on a dry run too
    planned = ([(r, False) for r in full_first] + [(best_row([], FULL.base), True)]
               + [(r, False) for r in full_rest] + [(planner_row(FULL), False)])
    print("\n".join(plan_lines(planned, replace(FULL, budget_s=s.budget_s))), flush=True)
    # compiled kernels shared by the rows (and kept with the results) instead of /tmp's per-user cache
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out, "inductor-cache"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(out, "triton-cache"))
    most = max([r.config for r in rows], key=lambda c: c.micro_batch * c.grad_accum)
    data = prepare_data(args.data or os.path.join(out, "data"), s.base,
                        (s.warmup + s.steps + ATTRIBUTION_STEPS) * most.micro_batch * most.grad_accum)
    print(f"data ready ({time.time() - started:.0f} s)", flush=True)
    meta = {"device": device_name(args.dry_run), "seq_len": s.base.seq_len, "vocab": s.base.vocab,
            "dtype": "bf16" if s.base.bf16 else "fp32", "warmup": s.warmup, "steps": s.steps, "data": asdict(data)}
    wanted = set(args.rows or [])
    done: list[Row] = []

    def measure(row: Row, attribute: bool = False) -> None:
        if wanted and row.group not in wanted:
            return
        done.append(row)
        row.error = config_error(row.config, data)
        if not row.error and deadline - time.time() < max(s.min_row_s, 0.0):
            row.error = OVER_BUDGET
        if not row.error:
            run_row(row, s, data, out, deadline, attribute)
        print(f"{row.group} {row.setting}: " + (row.error or f"{row.step_s:.3f} s/step, {row.tokens_per_s:,.0f} "
              "tokens/s" + (f", MFU {row.mfu:.1%}" if row.mfu is not None else "")), flush=True)
        write_results(out, meta, done)

    for row in first:
        measure(row)
    measure(best_row(done, s.base), attribute=True)
    for row in rest:
        measure(row)
    measure(planner_row(s))
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
