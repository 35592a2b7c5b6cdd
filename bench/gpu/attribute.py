"""Where one config's training step spends its time, measured with torch.profiler on the trainer's own engine.

For one config (preset, ``--set`` overrides, DeepSpeed JSON, micro-batch, gradient accumulation) it builds the engine
the way the trainer does (``build_train_model``, ``deepspeed.initialize``), times ``train_step`` on real shards
(bench_gpu.py's synthetic corpus, packed with document masking) and profiles one step. The report (``attribution``):

- the step's wall time, and how much of it the device was busy (the union of its kernels and copies) or idle,
  with the idle gaps over 0.5 ms;
- kernel time by category (matmul, attention, norm/elementwise, optimizer, copies, communication) and the top
  kernels by time;
- host syncs (``cuda*Synchronize`` calls: count, ms the host blocked in them) and the aten ops that force one
  (``item``, ``nonzero``, ``_local_scalar_dense``, ``is_nonzero``), device-to-host copies, kernel launches;
- host time of the engine's forward / backward / step and the device time of the kernels each launched.

Tokens/s, FLOPs/token and MFU come from ``pipeline.train.metrics.Throughput`` over ``train_step``'s ``Work``, as the
training log computes them. The CPU dry run (tiny preset, seq 64, fp32, CPU activities only) gives the same report
shape: there the "kernels" are the aten ops' self times, and launches, device syncs and copies are 0.

    python bench/gpu/attribute.py --out DIR [--preset 1b] [--set model.compile=true ...] [--ds-config FILE]
        [--micro-batch 4] [--grad-accum 1]                 # on the GPU (bench/gpu/ablate.py runs it for its best row)
    python bench/gpu/attribute.py --dry-run --out DIR      # CPU check

DIR gets attribution.json, attribution.md and the chrome trace (trace.json.gz, trimmed to 8 MiB: ``write_trace``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RANGES = ("forward", "backward", "step")  # the engine's methods, each a profiler range ENGINE_<name>
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::is_nonzero")
# kernel (or, on CPU, leaf aten op) name -> category, the first whose words match (lower case)
CATEGORIES = (
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                       "broadcast", "c10d")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::fill_",
                "aten::zero_", "aten::index_put", "aten::empty", "aten::contiguous")),
    ("attention", ("fmha", "flash", "attention", "sdpa", "flex", "triton_tem", "varlen")),
    ("matmul", ("gemm", "xmma", "nvjet", "cublas", "cutlass", "wgmma", "splitk", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::baddbmm", "aten::addbmm", "mmbackward")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_adamw")),
)
OTHER = "norm/elementwise"
IDLE_GAP_US = 500
TRACE_LIMIT = 8 * 2**20  # every file in OUT comes back from the lent GPU (the device tool's limit: 16 MiB)


@dataclass(frozen=True)
class RunConfig:
    """One benchmarked config: what the trainer would be given."""
    preset: str = "1b"
    overrides: tuple[str, ...] = ()  # --set items after the bench's own (a lever's switch)
    ds_config: str = "ds_configs/zero2.json"
    micro_batch: int = 4
    grad_accum: int = 1
    seq_len: int = 2048
    vocab: int = 128256
    bf16: bool = True
    workers: int = 2


DRY_RUN = RunConfig(preset="tiny", micro_batch=2, seq_len=64, vocab=512, bf16=False, workers=0)


@dataclass(frozen=True)
class Data:
    shards: str
    tokenizer: str


def prepare_data(directory: str, cfg: RunConfig, samples: int) -> Data:
    """bench_gpu.py's tokenizer and synthetic corpus as shards at ``cfg.seq_len`` in ``directory`` (reused when
    there: the ablation's rows share one build); documents of 1/32 to 2 sequence lengths, so that rows pack
    several of them at any ``seq_len``."""
    from bench_gpu import make_corpus, make_tokenizer

    from pipeline.data.prep.build import run_job
    from pipeline.data.prep.build_config import BuildConfig

    data = Data(os.path.join(directory, f"shards-{cfg.seq_len}-{cfg.vocab}"), os.path.join(directory, f"tokenizer-{cfg.vocab}"))
    if not os.path.exists(os.path.join(data.shards, "index.json")):
        os.makedirs(directory, exist_ok=True)
        make_tokenizer(data.tokenizer, cfg.vocab)
        corpus = make_corpus(os.path.join(directory, "corpus.jsonl"), cfg.vocab, samples * cfg.seq_len * 11 // 10,
                             lengths=(cfg.seq_len // 32, 2 * cfg.seq_len))  # bench_gpu.py's 64..4096 at seq 2048
        run_job(BuildConfig(inputs=(corpus,), tokenizer=data.tokenizer, output=data.shards, seq_len=cfg.seq_len,
                            progress=False))
    return data


def experiment_overrides(cfg: RunConfig, data: Data, run_dir: str) -> list[str]:
    """The experiment of ``cfg`` as ``--set`` items: the bench's CLM on ``data`` (SDPA and eager, as the GPU
    baseline ran: ``model.compile`` would be auto, which compiles on CUDA), then the config's own overrides, which
    win. launch/train.py given these trains the same steps."""
    return [f"run_dir={run_dir}", f"data.shards={data.shards}", f"data.tokenizer={data.tokenizer}",
            f"data.seq_len={cfg.seq_len}", f"model.init={cfg.preset}", f"model.dtype={'bf16' if cfg.bf16 else 'fp32'}",
            "model.attn_implementation=sdpa", "model.compile=false", f"train.micro_batch={cfg.micro_batch}",
            f"train.grad_accum={cfg.grad_accum}", "train.steps=1000", "phases=[{objectives: [{name: clm}]}]",
            *cfg.overrides]


@dataclass
class Engine:
    """The trainer's engine for one config and a step over its loader."""
    lm: object
    engine: object
    objectives: list
    loader: object
    device: object
    grad_accum: int
    shard_kind: str = field(init=False)

    def __post_init__(self):
        self.shard_kind = self.objectives[0].objective.shard_kind

    def step(self):
        """One optimizer step: (``train_step``'s result, the step's non-padding tokens as the trainer counts them)."""
        host = self.loader.next_global_step()
        result = host_step(self.engine, self.objectives, host, self.grad_accum, self.device)
        return result, sum(int((b.doc_ids >= 0).sum()) for b in host)


def host_step(engine, objectives: list, host: list, grad_accum: int, device, counts: list | None = None):
    """``train_step`` on the loader's host batches of one objective kind, as the trainer runs it: the target counts
    taken from the host copies (``target_counts``, unless given: without them ``train_step`` reads each
    micro-batch's count back from the device), the batches sent non-blocking."""
    from pipeline.train.step import target_counts, train_step

    kind = objectives[0].objective.shard_kind
    return train_step(engine, objectives, {kind: [b.to(device, non_blocking=True) for b in host]}, 1, grad_accum,
                      counts=target_counts(objectives, {kind: host}) if counts is None else counts)


def single_process() -> object:
    """DeepSpeed's process group of one (nccl on CUDA, gloo on CPU); returns the device."""
    import deepspeed
    import torch
    from bench_gpu import _single_process_env

    from pipeline.train.distributed import DIST_BACKENDS

    _single_process_env()
    deepspeed.utils.logger.setLevel("WARNING")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend=DIST_BACKENDS[device.type])
    return device


@contextmanager
def opened_engine(cfg: RunConfig, data: Data, work: str, device):
    """:class:`Engine` of ``cfg``, destroyed afterwards. A config the experiment refuses raises ConfigError here."""
    from pipeline.data.format.index import load_index
    from pipeline.data.loading.loader import ShardLoader
    from pipeline.experiment import load_experiment
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.engine_spec import engine_spec
    from pipeline.train.module import build_engine
    from pipeline.train.phases import build_objectives
    from pipeline.train.preflight import check_model

    cuda = device.type == "cuda"
    exp = load_experiment(None, experiment_overrides(cfg, data, os.path.join(work, "run")))
    tokenizer = load_tokenizer(data.tokenizer)
    objectives = build_objectives(exp.phases[0], tokenizer)
    ds = resolve_ds_config(load_ds_config(os.path.join(REPO, cfg.ds_config)), exp, 1, cfg.bf16)
    # the trainer's own engine: built on the GPU below ZeRO-3, DeepCompile'd where the JSON asks for it
    lm, engine = build_engine(ds, check_model(exp, tokenizer, ds, cuda), engine_spec(exp, cuda),
                              [o.objective for o in objectives])
    loader = ShardLoader(load_index(data.shards), cfg.micro_batch, cfg.grad_accum, 0, 1, exp.train.seed, cfg.workers,
                         pin_memory=cuda)
    try:
        yield Engine(lm, engine, objectives, loader, device, cfg.grad_accum)
    finally:
        loader.close()
        engine.destroy()


def timed(e: Engine, warmup: int, steps: int, peak_tflops: float) -> dict:
    """Warm-up steps, then ``steps`` timed ones: the median step, and tokens/s, FLOPs/token and MFU as the training
    log computes them (:class:`Throughput` over ``train_step``'s ``Work``); the last step's loss, which configs that
    differ only in their kernels (compiled or eager, varlen or SDPA) share, up to rounding."""
    import torch

    from pipeline.model.flops import work_flops
    from pipeline.train.metrics import Throughput

    cuda = e.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, tokens, flops = [], 0, 0.0
    for i in range(warmup + steps):
        start = time.perf_counter()
        result, n = e.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            tokens += n
            flops += work_flops(e.lm.config, result.work)
    perf = Throughput(peak_tflops, 1).scalars(tokens, sum(times), 0.0, flops)
    return {"step_s": statistics.median(times), "tokens_per_step": tokens // steps,
            "tokens_per_s": perf["perf/tokens_per_s"], "flops_per_token": perf["perf/flops_per_token"],
            "mfu": perf["perf/mfu"] if peak_tflops else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "loss": next(iter(result.losses.values()))}


@contextmanager
def engine_ranges(engine):
    """The engine's forward / backward / step each inside a profiler range ``ENGINE_<name>``, for the report's
    host and device time per range; the engine's own methods again afterwards."""
    from torch.profiler import record_function

    def ranged(name, method):
        def call(*args, **kwargs):
            with record_function(f"ENGINE_{name}"):
                return method(*args, **kwargs)
        return call

    for name in RANGES:
        setattr(engine, name, ranged(name, getattr(engine, name)))
    try:
        yield
    finally:
        for name in RANGES:
            delattr(engine, name)


def profile_step(e: Engine, out: str) -> dict:
    """One step under torch.profiler (CPU, and CUDA where the engine runs on it): :func:`attribution` of its trace,
    which is kept gzipped in ``out``, trimmed to :data:`TRACE_LIMIT` (:func:`write_trace`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = e.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with engine_ranges(e.engine), profile(activities=activities) as prof:
        with record_function("STEP"):
            e.step()
            if cuda:
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="trace_") as work:  # the raw trace (tens of MB) stays out of OUT
        path = os.path.join(work, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    report = attribution(trace.get("traceEvents", []), cuda)
    report["trace"] = write_trace(trace, os.path.join(out, "trace.json.gz"))
    return report


def write_trace(trace: dict, path: str, limit: int = TRACE_LIMIT) -> str:
    """``trace`` gzipped into ``path``, trimmed to at most ``limit`` bytes: without the host's aten ops where the
    whole is larger (the device's kernels and copies, the runtime calls and the ranges stay), then the start of the
    step alone, its window cut in proportion to the excess until it fits. Returns what it kept, in words."""
    events = trace.get("traceEvents", [])
    lean = [e for e in events if e.get("cat") != "cpu_op"]
    spans = [e["ts"] for e in lean if e.get("ph") == "X"]
    lo, span = min(spans, default=0), max(spans, default=0) - min(spans, default=0)
    kept, what, share = events, "the whole step", 1.0

    def gzipped() -> bytes:
        return gzip.compress(json.dumps({**trace, "traceEvents": kept}).encode(), compresslevel=6)

    data = gzipped()
    while len(data) > limit and share > 1e-4:
        if kept is events:
            kept, what = lean, "the step without the host's aten ops"
        else:
            share *= 0.9 * limit / len(data)
            kept = [e for e in lean if e.get("ph") != "X" or e["ts"] <= lo + share * span]
            what = (f"the step's first {share * span / 1e3:.1f} of {span / 1e3:.1f} ms, without the host's aten "
                    "ops")
        data = gzipped()
    with open(path, "wb") as f:
        f.write(data)
    return f"{what} ({len(data) / 2**20:.2f} MiB)"


def category(name: str) -> str:
    n = name.lower()
    return next((cat for cat, words in CATEGORIES if any(w in n for w in words)), OTHER)


def _union(intervals) -> tuple[float, list[list[float]]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(b - a for a, b in merged), merged


def _cpu_kernels(ops: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the aten ops as kernels: each with its self time and the category of itself or its nearest categorised
    caller, e.g. the ``empty`` inside an ``mm`` counts as matmul and every op of ``Optimizer.step`` (a range
    among ``ops``) as optimizer; the outermost aten ops, whose union is the busy time). On CPU this is what runs
    the arithmetic."""
    kernels, outer, by_thread = [], [], {}
    for e in ops:
        by_thread.setdefault(e.get("tid"), []).append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, its category, its children's time]
        for e in events + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, cat, children = stack.pop()
                if done.get("cat") == "cpu_op":
                    kernels.append({**done, "dur": max(done["dur"] - children, 0), "category": cat})
                if stack and stack[-1][0].get("cat") == "cpu_op":
                    stack[-1][2] += done["dur"]
            if e is None:
                break
            own = category(e["name"])
            cat = own if own != OTHER or not stack else stack[-1][1]
            if e.get("cat") == "cpu_op" and not any(s[0].get("cat") == "cpu_op" for s in stack):
                outer.append(e)
            stack.append([e, cat, 0.0])
    return kernels, outer


def attribution(events: list[dict], cuda: bool) -> dict:
    """The report of one profiled step from its chrome-trace events: the window is the longest ``STEP`` range.
    On CUDA the device events are kernels, copies and memsets, each placed in the engine range that launched it;
    on CPU the aten ops' self times (:func:`_cpu_kernels`), placed where they ran."""
    events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    step = max((e for e in events if e.get("name") == "STEP" and e.get("cat") == "user_annotation"),
               key=lambda e: e["dur"])
    lo, hi = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in events if lo <= e["ts"] < hi]
    ops = [e for e in inside if e.get("cat") == "cpu_op"]
    runtime = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if cuda:
        device = [{**e, "category": category(e["name"])} for e in inside
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        launched = {e["args"]["correlation"]: e["ts"] for e in runtime if "correlation" in e.get("args", {})}
        start = [launched.get(e.get("args", {}).get("correlation")) for e in device]
        occupied = device
    else:
        device, occupied = _cpu_kernels(ops + [e for e in inside if e.get("cat") == "user_annotation"
                                                and e["name"].startswith("Optimizer.step")])
        start = [e["ts"] for e in device]
    busy, merged = _union((e["ts"], min(e["ts"] + e["dur"], hi)) for e in occupied)
    edges = [lo] + [t for m in merged for t in m] + [hi]
    gaps = sorted((b - a for a, b in zip(edges[::2], edges[1::2]) if b - a > IDLE_GAP_US), reverse=True)
    by_category, by_name, count = Counter(), Counter(), Counter()
    for e in device:
        by_category[e["category"]] += e["dur"]
        by_name[e["name"][:120]] += e["dur"]
        count[e["name"][:120]] += 1
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"].removeprefix("ENGINE_")) for e in inside
             if e.get("cat") == "user_annotation" and e["name"] in {f"ENGINE_{r}" for r in RANGES}]
    host, device_by_range = Counter(), Counter()
    for a, b, name in spans:
        host[name] += b - a
    for e, t in zip(device, start):
        device_by_range[next((n for a, b, n in spans if t is not None and a <= t < b), "other")] += e["dur"]
    syncs = [e for e in runtime if "Synchronize" in e["name"]]
    ms = lambda us: round(us / 1e3, 3)  # noqa: E731
    return {
        "device": "cuda" if cuda else "cpu (dry run: aten ops' self times stand for kernels)",
        "step_ms": ms(hi - lo), "busy_ms": ms(busy), "busy_share": round(busy / max(hi - lo, 1e-9), 3),
        "idle_ms": ms(hi - lo - busy),
        "idle_gaps": {"count": len(gaps), "total_ms": ms(sum(gaps)), "largest_ms": [ms(g) for g in gaps[:5]]},
        "kernel_ms_by_category": {cat: ms(by_category[cat]) for cat in [c for c, _ in CATEGORIES] + [OTHER]},
        "top_kernels": [{"name": n, "ms": ms(d), "count": count[n]} for n, d in by_name.most_common(12)],
        "host_syncs": {"count": len(syncs), "blocked_ms": ms(sum(e["dur"] for e in syncs)),
                       "sync_ops": {op: sum(1 for e in ops if e["name"] == op) for op in SYNC_OPS}},
        "dtoh_copies": sum(1 for e in device if e.get("cat") == "gpu_memcpy"
                           and ("DtoH" in e["name"] or "Device -> Pageable" in e["name"]
                                or "Device -> Pinned" in e["name"])),
        "kernel_launches": sum(1 for e in runtime if "LaunchKernel" in e["name"] or e["name"].startswith("cuLaunch")),
        "ranges_ms": {r: {"host": ms(host[r]), "device": ms(device_by_range[r])} for r in RANGES}
        | {"other": {"host": None, "device": ms(device_by_range["other"])}},
    }


def markdown(cfg: RunConfig, perf: dict, report: dict) -> str:
    """The attribution as the run prints it."""
    mfu = f"{perf['mfu']:.1%}" if perf.get("mfu") is not None else "-"
    lines = [f"## Step attribution: {cfg.preset}, {cfg.ds_config}, micro {cfg.micro_batch} x accumulation "
             f"{cfg.grad_accum}, seq {cfg.seq_len}" + (f", {' '.join(cfg.overrides)}" if cfg.overrides else ""), "",
             f"step {perf['step_s'] * 1e3:.1f} ms (median), {perf['tokens_per_s']:,.0f} tokens/s, "
             f"{perf['flops_per_token'] / 1e9:.3f} GFLOP/token, MFU {mfu}; profiled step {report['step_ms']:.1f} ms on "
             f"{report['device']}: busy {report['busy_ms']:.1f} ms ({report['busy_share']:.0%}), idle "
             f"{report['idle_ms']:.1f} ms ({report['idle_gaps']['count']} gaps > 0.5 ms, "
             f"{report['idle_gaps']['total_ms']:.1f} ms); trace.json.gz: {report['trace']}", "",
             "| kernels by category | ms |", "|---|---|"]
    lines += [f"| {cat} | {v:.2f} |" for cat, v in report["kernel_ms_by_category"].items()]
    syncs = report["host_syncs"]
    lines += ["", f"host syncs: {syncs['count']} ({syncs['blocked_ms']:.2f} ms blocked); sync-forcing ops: "
              + ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in syncs["sync_ops"].items())
              + f"; device->host copies: {report['dtoh_copies']}; kernel launches: {report['kernel_launches']}", "",
              "| engine range | host ms | device ms |", "|---|---|---|"]
    for r, v in report["ranges_ms"].items():
        host = "-" if v["host"] is None else f"{v['host']:.2f}"
        lines.append(f"| {r} | {host} | {v['device']:.2f} |")
    lines += ["", "| top kernels | ms | count |", "|---|---|---|"]
    lines += [f"| `{k['name'][:100]}` | {k['ms']:.2f} | {k['count']} |" for k in report["top_kernels"]]
    return "\n".join(lines) + "\n"


def attribute(cfg: RunConfig, data: Data, out: str, warmup: int, steps: int, peak_tflops: float) -> dict:
    """Build ``cfg``'s engine, time it, profile one step; writes attribution.json / .md into ``out``, prints the
    markdown and returns the report."""
    from pipeline.model.flops import device_peak_tflops

    device = single_process()
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attribute_") as work, opened_engine(cfg, data, work, device) as e:
        perf = timed(e, warmup, steps, device_peak_tflops(peak_tflops) if device.type == "cuda" else peak_tflops)
        report = profile_step(e, out)
    print(write_attribution(out, cfg, perf, report), flush=True)
    return report


def write_attribution(out: str, cfg: RunConfig, perf: dict, report: dict) -> str:
    """attribution.json and attribution.md in ``out``; returns the markdown."""
    with open(os.path.join(out, "attribution.json"), "w") as f:
        json.dump({"config": asdict(cfg), "perf": perf, "attribution": report}, f, indent=1)
    text = markdown(cfg, perf, report)
    with open(os.path.join(out, "attribution.md"), "w") as f:
        f.write(text)
    return text


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that name one config (shared with bench/gpu/ablate.py's rows)."""
    parser.add_argument("--preset", help=f"model preset (default {RunConfig.preset})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an experiment override after the bench's own (repeatable)")
    parser.add_argument("--ds-config", help=f"DeepSpeed JSON, relative to the repository (default {RunConfig.ds_config})")
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--grad-accum", type=int)


def chosen_config(args: argparse.Namespace) -> RunConfig:
    base = DRY_RUN if args.dry_run else RunConfig()
    given = {k: getattr(args, k) for k in ("preset", "ds_config", "micro_batch", "grad_accum")
             if getattr(args, k) is not None}
    return replace(base, overrides=tuple(args.overrides), **given)


def main() -> int:
    from pipeline.train.deepspeed_ops import use_install_ops_dir

    use_install_ops_dir()  # DeepSpeed's ops, this process's and its children's, in this install's folder
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for attribution.json, attribution.md, trace.json.gz")
    parser.add_argument("--dry-run", action="store_true", help="CPU check: tiny preset, seq 64, fp32, CPU activities")
    parser.add_argument("--data", help="where the synthetic shards are (built there when missing; default OUT/data)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (0: look the GPU up)")
    config_arguments(parser)
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cfg = chosen_config(args)
    data = prepare_data(args.data or os.path.join(args.out, "data"), cfg, 8 * cfg.micro_batch * cfg.grad_accum)
    attribute(cfg, data, args.out, args.warmup, args.steps, args.peak_tflops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
