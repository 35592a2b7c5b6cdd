"""Tokens/s, MFU and peak memory of the 210m and 1b presets per objective and attention path on one GPU, in one run.

For each preset it builds one DeepSpeed engine the way the trainer does (``build_train_model``, the repository's
ZeRO-3 JSON, bf16, the trainer's default AdamW and chunked LM head) and times ``pipeline.train.step.train_step``
for CLM, MLM at 30 %, MNTP at 20 % and MAGNET (MNTP at 20 % + MSG under the context/span mask, one forward), each
with dense-mask SDPA and with FlexAttention block masks (the attention implementation is switched on the same
model), and CLM also with the unchunked LM head. Batches come from the real ``ShardLoader`` over shards that data
prep builds from a synthetic corpus (random words of a word-level tokenizer with a Llama-3-sized vocabulary,
documents of 64..4096 tokens packed at seq 2048 with document masking, so every objective needs a mask). A few
warm-up steps (FlexAttention compiles its kernels there), then timed steps; the MFU is the training log's (the
``Throughput`` of pipeline/train/metrics.py over ``train_step``'s ``Work``: the LM head on its targets only,
attention over each document) against the device's dense bf16 peak. Flex rows
also give the share of attention tiles the block mask skips and the time to build it per micro-batch. Last (its
FusedAdam builds a CUDA extension, which may take minutes), one AdamW step over the 1b preset's parameters in
ZeRO-3's flat fp32 layout with each kernel (torch foreach, torch fused, DeepSpeed FusedAdam), which decides
``optim.fused: auto``; in a child process, killed with its compilers at the deadline.

    python bench/gpu/bench_gpu.py --out OUT_DIR   # the lent GPU, after install.sh: results.json, results.md (<= 8 min)
    python bench/gpu/bench_gpu.py --dry-run --out DIR   # CPU check: tiny preset, seq 64, 1 step, fp32

Results are rewritten after every measurement, so a run cut short still leaves what it measured. ``--budget-s``
holds for the whole command (plus seconds to write the results): at the deadline an alarm ends whatever runs (a
step, a compile, an engine build; the optimizers' process is killed), that row is marked cut and the rest skipped.
On CPU the flex rows are marked as not measurable (torch 2.13 has no FlexAttention backward there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SPECIALS = ("<pad>", "<s>", "</s>", "<mask>", "<unk>")
# (objective, masking ratio); MAGNET's MNTP masks 20 % of the context, as docs/magnet.md recommends
OBJECTIVES = (("clm", None), ("mlm", 0.3), ("mntp", 0.2), ("magnet", 0.2))
# (objective, attention, LM head) per row: every objective with both attention paths, CLM also with the full head
VARIANTS = tuple((o, a, "chunked") for o, _ in OBJECTIVES for a in ("sdpa", "flex")) + (("clm", "sdpa", "full"),)
NO_FLEX_ON_CPU = "not measurable on CPU (torch 2.13 has no FlexAttention backward)"
OVER_BUDGET = "skipped (over --budget-s)"
CUT_AT_BUDGET = "cut at --budget-s"
OPTIMIZERS = ("none", "torch", "deepspeed")  # optim.fused values
OPTIMIZER_ROW = "optimizer row: "  # the child's result lines (DeepSpeed logs to stdout too)
# Micro batches at seq 2048 with a 128k vocabulary that leave room on an 80 GB H100 (no activation checkpointing)
MICRO_BATCH = {"tiny": 2, "210m": 8, "610m": 4, "1b": 4, "7b": 1}


@dataclass(frozen=True)
class Settings:
    presets: tuple[str, ...]
    micro_batches: tuple[int, ...]
    seq_len: int
    vocab: int
    warmup: int
    steps: int
    bf16: bool
    workers: int
    budget_s: float


FULL = Settings(presets=("210m", "1b"), micro_batches=(MICRO_BATCH["210m"], MICRO_BATCH["1b"]), seq_len=2048,
                vocab=128256, warmup=3, steps=6, bf16=True, workers=2, budget_s=420)
DRY_RUN = Settings(presets=("tiny",), micro_batches=(MICRO_BATCH["tiny"],), seq_len=64, vocab=512, warmup=1, steps=1,
                   bf16=False, workers=0, budget_s=600)


@dataclass
class Row:
    preset: str
    objective: str
    attention: str  # "sdpa" (dense bool mask) or "flex" (block mask)
    head: str  # "chunked" (the trainer's default) or "full" (fp32 logits of every target)
    micro_batch: int
    step_s: float = 0.0  # median over the timed steps
    tokens_per_s: float = 0.0
    targets_per_token: float = 0.0
    mfu: float | None = None  # None without a known peak (CPU)
    peak_mem_gib: float | None = None
    skipped_blocks: float | None = None  # flex: share of attention tiles the block mask skips
    mask_ms: float | None = None  # flex: building the block mask of one micro-batch
    error: str = ""


@dataclass
class OptimizerRow:
    kind: str  # optim.fused value
    step_ms: float = 0.0
    error: str = ""


class OverBudget(BaseException):
    """The --budget-s deadline, raised in whatever runs then; a BaseException, so that no ``except Exception``
    (ours, DeepSpeed's, torch.compile's fallbacks) takes it for the row's own failure."""


@contextmanager
def deadline_alarm(deadline: float):
    """Raise :class:`OverBudget` in the main thread at ``deadline`` (``time.time()``): a check between rows or
    steps cannot end a flex compile or an engine build that runs long. (A blocking C call, e.g. a hung collective,
    delays it until the call returns.)"""
    def ring(signum, frame):
        raise OverBudget(CUT_AT_BUDGET)

    left = deadline - time.time()
    if left <= 0:
        raise OverBudget(OVER_BUDGET)
    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_until(cmd: list[str], deadline: float) -> tuple[str, bool]:
    """Run ``cmd`` in its own process group until it ends or ``deadline``, when the group is killed (the compilers a
    JIT build started too); returns its stdout so far and whether it was killed. Stderr passes through."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        return proc.communicate(timeout=max(deadline - time.time(), 0))[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], True


def _single_process_env() -> None:
    """DeepSpeed's collectives need a process group even on one device: a world of one on this host. And, as the
    trainer's ``start_distributed``, TORCH_CUDA_ARCH_LIST in the form DeepSpeed's op builds (DeepCompile's,
    FusedAdam's) read: the image's ``9.0a`` becomes ``9.0``."""
    from pipeline.train.deepspeed_ops import arch_list_for_deepspeed

    arch_list_for_deepspeed()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def make_tokenizer(directory: str, vocab: int) -> str:
    """A word-level tokenizer: the specials, then the words ``w5 .. w{vocab-1}`` (ids equal to the number)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                 mask_token="<mask>", unk_token="<unk>")
    hf.save_pretrained(directory)
    return directory


def make_corpus(path: str, vocab: int, tokens: int, seed: int = 0, lengths: tuple[int, int] = (64, 4096)) -> str:
    """Documents of ``lengths`` (inclusive) random words (uniform ids), ``tokens`` words in all, as one jsonl file."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        written = 0
        while written < tokens:
            n = rng.randint(*lengths)
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(len(SPECIALS), vocab)}" for _ in range(n))}) + "\n")
            written += n
    return path


def write_results(out: str, meta: dict, rows: list[Row], optimizers: list[OptimizerRow]) -> None:
    ratios = summary_ratios(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows], "optimizers": [asdict(o) for o in optimizers],
                   **ratios}, f, indent=1)
    lines = [f"# GPU benchmark: {meta['device']}", "",
             f"seq {meta['seq_len']}, vocab {meta['vocab']}, {meta['dtype']}, {meta['ds_config']}, "
             f"{meta['warmup']} warm-up + {meta['steps']} timed steps (median step time); "
             + (f"MFU against {meta['peak_tflops']:g} TFLOPs (dense bf16), LM-head FLOPs on targets only."
                if meta["peak_tflops"] else "no MFU (no known peak)."), "",
             "| preset | objective | attention | LM head | micro batch | step (s) | tokens/s | targets/token | MFU "
             "| peak mem (GiB) | skipped tiles | block mask (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.preset, r.objective, r.attention, r.head, str(r.micro_batch)]
        if r.error:
            lines.append("| " + " | ".join(cells + [r.error] + [""] * 6) + " |")
            continue
        cells += [f"{r.step_s:.3f}", f"{r.tokens_per_s:,.0f}", f"{r.targets_per_token:.2f}",
                  f"{r.mfu:.1%}" if r.mfu is not None else "-",
                  f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-",
                  f"{r.skipped_blocks:.0%}" if r.skipped_blocks is not None else "-",
                  f"{r.mask_ms:.1f}" if r.mask_ms is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"MAGNET / causal step time, {key}: {v:.2f}x" for key, v in ratios["magnet_vs_causal"].items()]
    lines += [f"flex / SDPA tokens/s, {key}: {v:.2f}x" for key, v in ratios["flex_vs_sdpa"].items()]
    lines += [f"chunked / full LM head, {key}: step time {v['step_time']:.2f}x, peak memory {v['peak_memory']:.2f}x"
              for key, v in ratios["chunked_vs_full_head"].items()]
    if optimizers:
        lines += ["", f"AdamW step over {meta['optimizer_params']:,} parameters (ZeRO-3 flat fp32 groups):", "",
                  "| optim.fused | step (ms) |", "|---|---|"]
        lines += [f"| {o.kind} | {o.error or f'{o.step_ms:.1f}'} |" for o in optimizers]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def summary_ratios(rows: list[Row]) -> dict[str, dict]:
    """The goals' ratios from the measured rows: MAGNET over CLM step time (per preset and attention), flex over
    SDPA tokens/s (per preset and objective), chunked over full LM head (per preset)."""
    ok = {(r.preset, r.objective, r.attention, r.head): r for r in rows if r.step_s > 0}
    magnet, flex, head = {}, {}, {}
    for (preset, objective, attention, kind), r in ok.items():
        if kind != "chunked":
            continue
        causal = ok.get((preset, "clm", attention, "chunked"))
        if objective == "magnet" and causal:
            magnet[f"{preset} {attention}"] = r.step_s / causal.step_s
        sdpa = ok.get((preset, objective, "sdpa", "chunked"))
        if attention == "flex" and sdpa:
            flex[f"{preset} {objective}"] = r.tokens_per_s / sdpa.tokens_per_s
        full = ok.get((preset, objective, attention, "full"))
        if full:
            head[f"{preset} {objective} {attention}"] = {
                "step_time": r.step_s / full.step_s,
                "peak_memory": r.peak_mem_gib / full.peak_mem_gib if r.peak_mem_gib and full.peak_mem_gib else 0.0}
    return {"magnet_vs_causal": magnet, "flex_vs_sdpa": flex, "chunked_vs_full_head": head}


def main() -> int:
    from pipeline.train.deepspeed_ops import use_install_ops_dir

    use_install_ops_dir()  # DeepSpeed's ops, this process's and its children's, in this install's folder
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU check: tiny preset, seq 64, 1 step, fp32")
    parser.add_argument("--presets", nargs="+", choices=sorted(MICRO_BATCH), help="model presets (default 210m 1b)")
    parser.add_argument("--micro-batches", type=int, nargs="+", help=f"one per preset (default {MICRO_BATCH})")
    parser.add_argument("--steps", type=int, help="timed steps per row (default 6)")
    parser.add_argument("--budget-s", type=float, help="the whole run's limit in seconds (default 420)")
    parser.add_argument("--optimizer-rows", action="store_true", help=argparse.SUPPRESS)  # measure_optimizers' child
    parser.add_argument("--ds-config", default=os.path.join(REPO, "ds_configs", "zero3.json"))
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (0: look it up)")
    args = parser.parse_args()
    settings = DRY_RUN if args.dry_run else FULL
    presets = tuple(args.presets or settings.presets)
    chosen = {"presets": presets, "micro_batches": tuple(args.micro_batches or (MICRO_BATCH[p] for p in presets)),
              "steps": args.steps or settings.steps,
              "budget_s": args.budget_s if args.budget_s is not None else settings.budget_s}
    settings = Settings(**{**asdict(settings), **chosen})
    if len(settings.micro_batches) != len(settings.presets):
        parser.error(f"--micro-batches needs one value per preset {settings.presets}")
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.optimizer_rows:
        optimizer_rows(settings, args)
        return 0
    _single_process_env()
    run(settings, args, started + settings.budget_s)
    return 0


def run(settings: Settings, args: argparse.Namespace, deadline: float) -> None:
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    import deepspeed
    import torch

    from pipeline.train.distributed import DIST_BACKENDS

    deepspeed.utils.logger.setLevel("WARNING")
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend=DIST_BACKENDS[device.type])

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work:
        measure_all(settings, args, device, out, work, deadline)


def measure_all(settings: Settings, args: argparse.Namespace, device, out: str, work: str, deadline: float) -> None:
    """Data, per preset one engine and a row per variant, then the optimizers, all before ``deadline``; results
    rewritten after every row."""
    import torch

    from pipeline.model.flops import device_peak_tflops
    from pipeline.train.ds_config import load_ds_config

    cuda = device.type == "cuda"
    started = time.time()
    peak = device_peak_tflops(args.peak_tflops)
    ds_raw = load_ds_config(args.ds_config)
    meta = {"device": torch.cuda.get_device_name() if cuda else "CPU (dry run)", "seq_len": settings.seq_len,
            "vocab": settings.vocab, "dtype": "bf16" if settings.bf16 else "fp32",
            "ds_config": os.path.relpath(args.ds_config, REPO), "warmup": settings.warmup, "steps": settings.steps,
            "peak_tflops": peak or None}
    rows = [Row(p, o, a, h, micro) for p, micro in zip(settings.presets, settings.micro_batches) for o, a, h in VARIANTS]
    try:
        with deadline_alarm(deadline):
            measure_presets(settings, device, work, ds_raw, peak, rows, lambda: write_results(out, meta, rows, []))
    except OverBudget as e:
        print(f"--budget-s {settings.budget_s:g} reached: {e}", flush=True)
    for row in rows:
        if not row.error and not row.step_s:
            row.error = OVER_BUDGET
    optimizers, meta["optimizer_params"] = measure_optimizers(settings, ds_raw, deadline)
    write_results(out, meta, rows, optimizers)
    print(f"done in {time.time() - started:.0f} s; wrote {out}/results.md and results.json", flush=True)


def measure_presets(settings: Settings, device, work: str, ds_raw: dict, peak: float, rows: list[Row], save) -> None:
    """The data, then per preset one engine and its ``rows`` in place, calling ``save`` after each."""
    import deepspeed
    import torch

    from pipeline.data.format.index import load_index
    from pipeline.data.loading.loader import ShardLoader
    from pipeline.data.prep.build import run_job
    from pipeline.data.prep.build_config import BuildConfig
    from pipeline.experiment import load_experiment
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.ds_config import resolve_ds_config
    from pipeline.train.engine_spec import engine_spec
    from pipeline.train.module import build_train_model
    from pipeline.train.phases import build_objectives
    from pipeline.train.preflight import check_model

    cuda = device.type == "cuda"
    started = time.time()
    tokenizer_dir = make_tokenizer(os.path.join(work, "tokenizer"), settings.vocab)
    tokenizer = load_tokenizer(tokenizer_dir)
    samples = 4 * max(settings.micro_batches)
    shards = os.path.join(work, f"shards-{settings.seq_len}")
    corpus = make_corpus(os.path.join(work, "corpus.jsonl"), settings.vocab, samples * settings.seq_len * 11 // 10)
    run_job(BuildConfig(inputs=(corpus,), tokenizer=tokenizer_dir, output=shards, seq_len=settings.seq_len,
                        progress=False))
    index = load_index(shards)
    print(f"data: {index.num_samples} samples of {settings.seq_len} tokens ({time.time() - started:.0f} s)", flush=True)

    # one phase per objective (a phase may not hold two losses of one name: MNTP's and MAGNET's mntp); rows use one each
    objectives = [f"{{name: {n}" + (f", ratio: {r}" if r else "") + "}" for n, r in OBJECTIVES]
    phases = "[" + ", ".join(f"{{share: {1 / len(objectives)}, objectives: [{o}]}}" for o in objectives) + "]"
    for preset, micro in zip(settings.presets, settings.micro_batches):
        exp = load_experiment(None, [f"run_dir={os.path.join(work, 'run')}", f"data.shards={shards}",
                                     f"data.tokenizer={tokenizer_dir}", f"data.seq_len={settings.seq_len}",
                                     f"model.init={preset}", f"model.dtype={'bf16' if settings.bf16 else 'fp32'}",
                                     "model.attn_implementation=sdpa", f"train.micro_batch={micro}",
                                     "train.steps=1000", f"phases={phases}"])
        built = {o.name: o for p in exp.phases for o in build_objectives(p, tokenizer)}
        ds = resolve_ds_config(ds_raw, exp, 1, settings.bf16)
        preset_rows = [r for r in rows if r.preset == preset]
        engine = loader = None
        try:
            t0 = time.time()
            lm, module, optimizer = build_train_model(ds, check_model(exp, tokenizer, ds, cuda),
                                                      engine_spec(exp, cuda), [o.objective for o in built.values()])
            engine, *_ = deepspeed.initialize(model=module, **optimizer, config=ds)
            print(f"{preset}: engine built in {time.time() - t0:.0f} s", flush=True)
            loader = ShardLoader(index, micro, 1, 0, 1, exp.train.seed, settings.workers, pin_memory=cuda)
            for row in preset_rows:
                if row.attention == "flex" and not cuda:
                    row.error = NO_FLEX_ON_CPU
                else:
                    try:
                        with variant(lm, row):
                            measure(row, engine, built[row.objective], loader, device, settings, lm.config, peak)
                    except OverBudget:
                        row.error = CUT_AT_BUDGET
                        raise
                    except Exception as e:  # (a row's failure, e.g. out of memory, is its result)
                        row.error = _failure(e, cuda)
                print(f"{preset} {row.objective} {row.attention} {row.head}: " + (row.error or (
                      f"{row.step_s:.3f} s/step, {row.tokens_per_s:,.0f} tokens/s"
                      + (f", MFU {row.mfu:.1%}" if row.mfu is not None else ""))), flush=True)
                save()
        except Exception as e:  # (the engine did not build: every row of the preset failed)
            error = _failure(e, cuda)
            for row in preset_rows:
                row.error = row.error or error
            save()
        finally:
            if loader is not None:
                loader.close()
            if engine is not None:
                engine.destroy()
            engine = module = optimizer = lm = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()


@contextmanager
def variant(lm, row: Row):
    """Run ``row`` on the engine's model: its attention implementation and LM head, restored afterwards."""
    from torch import nn

    from pipeline.model.attention import FLEX
    from pipeline.model.lm_head import ChunkedLMHead

    impl, head_class = lm.config._attn_implementation, type(lm.lm_head)
    lm.config._attn_implementation = FLEX if row.attention == "flex" else "sdpa"
    lm.lm_head.__class__ = ChunkedLMHead if row.head == "chunked" else nn.Linear
    try:
        yield
    finally:
        lm.config._attn_implementation, lm.lm_head.__class__ = impl, head_class


def _failure(e: Exception, cuda: bool) -> str:
    """The one-line error the table shows; the traceback goes to stderr."""
    import torch

    traceback.print_exc()
    if cuda:
        torch.cuda.empty_cache()
    return "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else f"{type(e).__name__}: {e}"[:120]


def measure(row: Row, engine, wobj, loader, device, settings: Settings, config, peak: float) -> None:
    """Warm-up steps, then timed optimizer steps of ``wobj`` alone; fills the row's timings and MFU (against
    ``peak`` TFLOP/s of ``config``'s model FLOPs; None without a peak) in place."""
    import torch
    import torch.distributed as dist

    from pipeline.model.attention import FLEX, attention_inputs, skipped_blocks
    from pipeline.model.flops import work_flops
    from pipeline.train.metrics import Throughput
    from pipeline.train.step import train_step

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, tokens, targets, flops, skipped, mask_s = [], 0, 0, 0.0, [], []
    for i in range(settings.warmup + settings.steps):
        start = time.perf_counter()
        batches = [b.to(device, non_blocking=True) for b in loader.next_global_step()]
        result = train_step(engine, [wobj], {wobj.objective.shard_kind: batches}, dist.get_world_size(), 1)
        if cuda:
            torch.cuda.synchronize()
        if i >= settings.warmup:
            times.append(time.perf_counter() - start)
            tokens += sum(int((b.doc_ids >= 0).sum()) for b in batches)
            targets += sum(int(n) for b in batches for n in wobj.objective.num_targets(b).values())
            flops += work_flops(config, result.work)
            if row.attention == "flex":  # the block mask this step built, again, timed on its own
                b, mode = batches[0], wobj.objective.attention_mode
                t0 = time.perf_counter()
                mask = attention_inputs(mode, b.doc_ids, b.span_ids, document_masking=wobj.objective.document_masking,
                                        attn_implementation=FLEX).get("attention_mask")
                if cuda:
                    torch.cuda.synchronize()
                mask_s.append(time.perf_counter() - t0)
                skipped += [skipped_blocks(mask)] if mask is not None else []
    row.step_s = statistics.median(times)
    perf = Throughput(peak, 1).scalars(tokens, sum(times), 0.0, flops)  # as the training log computes them
    row.tokens_per_s, row.mfu = perf["perf/tokens_per_s"], perf["perf/mfu"] if peak else None
    row.targets_per_token = targets / max(tokens, 1)
    row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    row.skipped_blocks = statistics.mean(skipped) if skipped else None
    row.mask_ms = statistics.median(mask_s) * 1e3 if mask_s else None


def optimizer_layout(settings: Settings, ds_raw: dict) -> tuple[int, int]:
    """(parameters of the largest preset, ZeRO-3's ``sub_group_size``): one flat fp32 group per sub-group. Counted
    in closed form: building even a meta model after an engine would run under ZeRO-3's init."""
    from pipeline.model.flops import param_counts
    from pipeline.model.presets import get_preset

    numel = param_counts(get_preset(settings.presets[-1]).to_config(settings.vocab)).total
    return numel, int(float(ds_raw.get("zero_optimization", {}).get("sub_group_size", 1e9)))


def measure_optimizers(settings: Settings, ds_raw: dict, deadline: float) -> tuple[list[OptimizerRow], int]:
    """One AdamW step per kernel over the largest preset's parameters, laid out as ZeRO-3 keeps them, measured by a
    child process (this script with --optimizer-rows) that is killed at ``deadline``, with the compilers of
    FusedAdam's JIT build."""
    numel, _ = optimizer_layout(settings, ds_raw)
    if time.time() >= deadline:
        return [OptimizerRow(kind, error=OVER_BUDGET) for kind in OPTIMIZERS], numel
    output, killed = run_until([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--optimizer-rows"], deadline)
    measured = {}
    for line in output.splitlines():
        if line.startswith(OPTIMIZER_ROW):
            row = OptimizerRow(**json.loads(line.removeprefix(OPTIMIZER_ROW)))
            measured[row.kind] = row
            print(f"AdamW {row.kind}: {row.error or f'{row.step_ms:.1f} ms/step'}", flush=True)
        else:
            print(line, flush=True)
    missing = CUT_AT_BUDGET if killed else "no result: the optimizer process failed (its traceback is above)"
    return [measured.get(kind) or OptimizerRow(kind, error=missing) for kind in OPTIMIZERS], numel


def optimizer_rows(settings: Settings, args: argparse.Namespace) -> None:
    """measure_optimizers' child: an ``OPTIMIZER_ROW`` JSON line per kernel as soon as it is measured."""
    import torch

    from pipeline.experiment import OptimConfig
    from pipeline.train.ds_config import load_ds_config
    from pipeline.train.module import build_optimizer

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    numel, group = optimizer_layout(settings, load_ds_config(args.ds_config))
    for kind in OPTIMIZERS:
        row = OptimizerRow(kind)
        if kind != "none" and not cuda:
            row.error = "CUDA only"
        else:
            try:
                params = [torch.zeros(min(group, numel - s), device=device, requires_grad=True)
                          for s in range(0, numel, group)]
                for p in params:
                    p.grad = torch.randn_like(p)
                optimizer = build_optimizer([{"params": params, "weight_decay": 0.1}], OptimConfig(fused=kind), kind)
                times = []  # the first two steps allocate the states (and build the kernels)
                for _ in range(2 + settings.steps):
                    if cuda:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    optimizer.step()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                row.step_ms = statistics.median(times[2:]) * 1e3
            except Exception as e:  # (DeepSpeed's FusedAdam builds a CUDA extension on first use; it may not build)
                row.error = _failure(e, cuda)
            params = optimizer = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        print(OPTIMIZER_ROW + json.dumps(asdict(row)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
