"""Tokens/s and MFU of the 210m and 1b presets for each objective on one GPU, in one run of a few minutes.

For each preset it builds one DeepSpeed engine the way the trainer does (``build_train_model``, the repository's
ZeRO-3 JSON, bf16, torch AdamW) and times ``pipeline.train.loop.train_step`` for each objective in turn: CLM,
MLM at 30 %, MNTP at 20 % and, when the objectives registry has it, MAGNET (MNTP at 20 % + MSG under the
context/span mask, one forward). Batches come from the real ``ShardLoader`` over shards that data prep builds
from a synthetic corpus (random words of a word-level tokenizer with a Llama-3-sized vocabulary, documents of
64..4096 tokens packed at seq 2048 with document masking). A few warm-up steps, then timed steps; the MFU counts
the FLOPs the objective needs (``flops_per_token`` with the LM head on its targets only) against the device's
dense bf16 peak. It also reports MAGNET's step time over the causal (CLM) step time.

    bench/gpu/run.sh OUT_DIR                      # the lent GPU: results.json and results.md in OUT_DIR
    python bench/gpu/bench_gpu.py --dry-run --out DIR   # CPU check: tiny preset, seq 64, 2 steps, fp32

Results are rewritten after every measurement, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SPECIALS = ("<pad>", "<s>", "</s>", "<mask>", "<unk>")
# (objective, masking ratio); MAGNET's MNTP masks 20 % of the context, as docs/magnet.md recommends
OBJECTIVES = (("clm", None), ("mlm", 0.3), ("mntp", 0.2), ("magnet", 0.2))
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


FULL = Settings(presets=("210m", "1b"), micro_batches=(MICRO_BATCH["210m"], MICRO_BATCH["1b"]), seq_len=2048, vocab=128256, warmup=3, steps=8,
                bf16=True, workers=2)
DRY_RUN = Settings(presets=("tiny",), micro_batches=(MICRO_BATCH["tiny"],), seq_len=64, vocab=512, warmup=1, steps=1, bf16=False,
                   workers=0)


@dataclass
class Row:
    preset: str
    objective: str
    micro_batch: int
    step_s: float = 0.0  # median over the timed steps
    tokens_per_s: float = 0.0
    targets_per_token: float = 0.0
    mfu: float | None = None  # None without a known peak (CPU)
    peak_mem_gib: float | None = None
    error: str = ""


def _single_process_env() -> None:
    """DeepSpeed's collectives need a process group even on one device: a world of one on this host."""
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


def make_corpus(path: str, vocab: int, tokens: int, seed: int = 0) -> str:
    """Documents of 64..4096 random words (uniform ids), ``tokens`` words in all, as one jsonl file."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        written = 0
        while written < tokens:
            n = rng.randint(64, 4096)
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(len(SPECIALS), vocab)}" for _ in range(n))}) + "\n")
            written += n
    return path


def write_results(out: str, meta: dict, rows: list[Row]) -> None:
    ratios = magnet_vs_causal(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows], "magnet_vs_causal_step_time": ratios}, f, indent=1)
    lines = [f"# GPU benchmark: {meta['device']}", "",
             f"seq {meta['seq_len']}, vocab {meta['vocab']}, {meta['dtype']}, {meta['ds_config']}, "
             f"{meta['warmup']} warm-up + {meta['steps']} timed steps (median step time); "
             + (f"MFU against {meta['peak_tflops']:g} TFLOPs (dense bf16), LM-head FLOPs on targets only."
                if meta["peak_tflops"] else "no MFU (no known peak)."), "",
             "| preset | objective | micro batch | step (s) | tokens/s | targets/token | MFU | peak mem (GiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.preset} | {r.objective} | {r.micro_batch} | {r.error} | | | | |")
            continue
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        mem = f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-"
        lines.append(f"| {r.preset} | {r.objective} | {r.micro_batch} | {r.step_s:.3f} | {r.tokens_per_s:,.0f} | "
                     f"{r.targets_per_token:.2f} | {mfu} | {mem} |")
    lines += [""] + [f"MAGNET / causal step time, {preset}: {ratio:.2f}x" for preset, ratio in ratios.items()]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def magnet_vs_causal(rows: list[Row]) -> dict[str, float]:
    steps = {(r.preset, r.objective): r.step_s for r in rows if not r.error}
    return {p: steps[p, "magnet"] / steps[p, "clm"] for p, o in steps if o == "magnet" and (p, "clm") in steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU check: tiny preset, seq 64, 2 steps, fp32")
    parser.add_argument("--presets", nargs="+", choices=sorted(MICRO_BATCH), help="model presets (default 210m 1b)")
    parser.add_argument("--micro-batches", type=int, nargs="+", help=f"one per preset (default {MICRO_BATCH})")
    parser.add_argument("--steps", type=int, help="timed steps per objective (default 8)")
    parser.add_argument("--ds-config", default=os.path.join(REPO, "ds_configs", "zero3.json"))
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (0: look it up)")
    args = parser.parse_args()
    settings = DRY_RUN if args.dry_run else FULL
    presets = tuple(args.presets or settings.presets)
    chosen = {"presets": presets, "micro_batches": tuple(args.micro_batches or (MICRO_BATCH[p] for p in presets)),
              "steps": args.steps or settings.steps}
    settings = Settings(**{**asdict(settings), **chosen})
    if len(settings.micro_batches) != len(settings.presets):
        parser.error(f"--micro-batches needs one value per preset {settings.presets}")
    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _single_process_env()
    run(settings, args)
    return 0


def run(settings: Settings, args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    import deepspeed
    import torch

    from pipeline.train.loop import DIST_BACKENDS

    deepspeed.utils.logger.setLevel("WARNING")
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend=DIST_BACKENDS[device.type])

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work:
        measure_all(settings, args, device, out, work)


def measure_all(settings: Settings, args: argparse.Namespace, device, out: str, work: str) -> None:
    """Data, then per preset one engine and a row per objective; results rewritten after every row."""
    import deepspeed
    import torch

    from pipeline.data.build import BuildConfig, run_job
    from pipeline.data.loader import ShardLoader
    from pipeline.data.manifest import load_index
    from pipeline.model.flops import flops_per_token
    from pipeline.objectives import OBJECTIVES as REGISTRY
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.experiment import load_experiment
    from pipeline.train.metrics import device_peak_tflops
    from pipeline.train.model import build_train_model
    from pipeline.train.phases import build_objectives

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

    objectives = [(n, r) for n, r in OBJECTIVES if n in REGISTRY]
    skipped = [n for n, _ in OBJECTIVES if n not in REGISTRY]
    if skipped:
        print(f"skipped (not in the objectives registry): {', '.join(skipped)}", flush=True)
    phase = "[{objectives: [" + ", ".join(f"{{name: {n}" + (f", ratio: {r}}}" if r else "}") for n, r in objectives) + "]}]"
    peak = device_peak_tflops(args.peak_tflops)
    meta = {"device": torch.cuda.get_device_name() if cuda else "CPU (dry run)", "seq_len": settings.seq_len,
            "vocab": settings.vocab, "dtype": "bf16" if settings.bf16 else "fp32",
            "ds_config": os.path.relpath(args.ds_config, REPO), "warmup": settings.warmup, "steps": settings.steps,
            "peak_tflops": peak or None}
    rows: list[Row] = []
    for preset, micro in zip(settings.presets, settings.micro_batches):
        exp = load_experiment(None, [f"run_dir={os.path.join(work, 'run')}", f"data.shards={shards}",
                                     f"data.tokenizer={tokenizer_dir}", f"data.seq_len={settings.seq_len}",
                                     f"model.init={preset}", f"model.dtype={'bf16' if settings.bf16 else 'fp32'}",
                                     f"train.micro_batch={micro}", "train.steps=1000", f"phases={phase}"])
        built = build_objectives(exp.phases[0], tokenizer)
        ds = resolve_ds_config(load_ds_config(args.ds_config), exp, 1, settings.bf16)
        t0 = time.time()
        engine = loader = None
        try:
            lm, module, optimizer = build_train_model(exp, ds, tokenizer, settings.bf16, [o.objective for o in built])
            engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds)
            print(f"{preset}: engine built in {time.time() - t0:.0f} s", flush=True)
            loader = ShardLoader(index, micro, 1, 0, 1, exp.train.seed, settings.workers, pin_memory=cuda)
            for wobj in built:
                row = Row(preset, wobj.name, micro)
                rows.append(row)
                try:
                    measure(row, engine, wobj, loader, device, settings)
                    row.mfu = (row.tokens_per_s * flops_per_token(lm.config, settings.seq_len, row.targets_per_token)
                               / (peak * 1e12)) if peak else None
                except Exception as e:  # (a row's failure, e.g. out of memory, is its result)
                    row.error = _failure(e, cuda)
                print(f"{preset} {wobj.name}: " + (row.error or f"{row.step_s:.3f} s/step, {row.tokens_per_s:,.0f} "
                      f"tokens/s" + (f", MFU {row.mfu:.1%}" if row.mfu is not None else "")), flush=True)
                write_results(out, meta, rows)
        except Exception as e:  # (the engine did not build: every objective of the preset failed)
            error = _failure(e, cuda)
            done = {r.objective for r in rows if r.preset == preset}
            rows += [Row(preset, o.name, micro, error=error) for o in built if o.name not in done]
            write_results(out, meta, rows)
        finally:
            if loader is not None:
                loader.close()
            if engine is not None:
                engine.destroy()
            engine = module = optimizer = lm = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    print(f"done in {time.time() - started:.0f} s; wrote {out}/results.md and results.json", flush=True)


def _failure(e: Exception, cuda: bool) -> str:
    """The one-line error the table shows; the traceback goes to stderr."""
    import torch

    traceback.print_exc()
    if cuda:
        torch.cuda.empty_cache()
    return "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else f"{type(e).__name__}: {e}"[:120]


def measure(row: Row, engine, wobj, loader, device, settings: Settings) -> None:
    """Warm-up steps, then timed optimizer steps of ``wobj`` alone; fills the row's timings in place."""
    import torch
    import torch.distributed as dist

    from pipeline.train.loop import train_step

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, tokens, targets = [], 0, 0
    for i in range(settings.warmup + settings.steps):
        start = time.perf_counter()
        batches = [b.to(device, non_blocking=True) for b in loader.next_global_step()]
        train_step(engine, [wobj], {wobj.objective.source: batches}, dist.get_world_size(), 1)
        if cuda:
            torch.cuda.synchronize()
        if i >= settings.warmup:
            times.append(time.perf_counter() - start)
            tokens += sum(int((b.doc_ids >= 0).sum()) for b in batches)
            counts = [wobj.objective.num_targets(b) for b in batches]
            targets += sum(sum(c.values()) if isinstance(c, dict) else c for c in counts)
    row.step_s = statistics.median(times)
    row.tokens_per_s = tokens / sum(times)
    row.targets_per_token = targets / max(tokens, 1)
    row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None


if __name__ == "__main__":
    sys.exit(main())
