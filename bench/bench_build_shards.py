"""Data-prep throughput: the whole build_shards job against the bare tokenizer and a ``datasets.map`` baseline.

On the same text (the sample corpus's training files concatenated into files of ~5 MB of text, as many as make
about ``--mb`` MB) and the same number of processes, it times
  (a) the bare tokenizer: read the documents and batch-encode them, nothing else (same backend as build_shards);
  (b) build_shards (``run_job``): read, encode, pack, masking plans, MAGNET spans, tar shards, manifests;
  (c) ``datasets``: ``load_dataset("json")`` + ``map(batched=True, num_proc=P)`` + ``save_to_disk``, once with the
      same encode function as (a) and (b) and once with the HF fast tokenizer (the usual recipe);
and prints token throughputs and the ratios (b)/(a) (goal >= 0.85) and (b)/(c) (goal >= 1.2), by wall time and
by CPU time (all processes): on a shared machine the CPU-time ratio is the one that other jobs disturb least.
Each variant runs ``--repeats`` times, interleaved, and the best run counts. Run from the repository root:

    python bench/bench_build_shards.py --mb 30 --procs 2 --repeats 3
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import datasets  # noqa: E402  (imported here so that its import time is not measured)

from pipeline.data.prep.build import run_job  # noqa: E402  (after TOKENIZERS_PARALLELISM)
from pipeline.data.prep.build_config import BuildConfig  # noqa: E402
from pipeline.data.prep.sources import RecordStats, read_texts  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402

BATCH = 512
_tok = None


def make_corpus(directory: str, megabytes: float, procs: int) -> tuple[list[str], float]:
    """Files of SlimPajama-like size, each the sample corpus's training files concatenated (zstd frames chain),
    as many as give about ``megabytes`` of text, rounded to a multiple of ``procs`` so no process idles."""
    inputs = sorted(glob.glob("data/sample/train/*/*.jsonl.zst"))
    text_mb = sum(len(t.encode()) for p in inputs for t in read_texts(p, "text", RecordStats())) / 1e6
    blob = b"".join(open(p, "rb").read() for p in inputs)
    paths = []
    for i in range(procs * max(1, round(megabytes / text_mb / procs))):
        paths.append(os.path.join(directory, f"part{i:03d}.jsonl.zst"))
        with open(paths[-1], "wb") as f:
            f.write(blob)
    return paths, len(paths) * text_mb


def _encode_file(path: str) -> int:
    tokens, texts = 0, []
    for text in read_texts(path, "text", RecordStats()):
        texts.append(text)
        if len(texts) == BATCH:
            tokens += sum(map(len, _tok.encode_batch(texts)))
            texts = []
    return tokens + sum(map(len, _tok.encode_batch(texts)))


def _init(tokenizer: str) -> None:
    global _tok
    _tok = load_tokenizer(tokenizer)


def bare(paths: list[str], tokenizer: str, procs: int) -> int:
    with mp.get_context("fork").Pool(procs, _init, (tokenizer,)) as pool:
        return sum(pool.imap(_encode_file, paths))


def build(paths: list[str], tokenizer: str, procs: int, out: str, seq_len: int) -> int:
    summary = run_job(BuildConfig(inputs=tuple(paths), tokenizer=tokenizer, output=out, seq_len=seq_len,
                                  workers=procs, progress=False))
    return summary.tokens


def hf_datasets(paths: list[str], tokenizer: str, procs: int, out: str, backend: str) -> int:
    tok = load_tokenizer(tokenizer)
    encode = tok.encode_batch if backend == "same" else (
        lambda texts: tok.hf(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    ds = datasets.load_dataset("json", data_files=paths, split="train", cache_dir=os.path.join(out, "cache"))
    ds = ds.map(lambda b: {"input_ids": encode(b["text"])}, batched=True, batch_size=BATCH, num_proc=procs,
                remove_columns=ds.column_names)
    ds.save_to_disk(os.path.join(out, "saved"), num_proc=procs)
    return sum(len(x) for x in ds["input_ids"])


def cpu_seconds() -> float:
    """User + system time of this process and its finished children (the workers, once joined)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=30, help="about this many MB of text to process")
    p.add_argument("--procs", type=int, default=2, help="processes for every variant")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokenizer", default="data/sample/tokenizer")
    a = p.parse_args()
    datasets.disable_progress_bars()
    work = tempfile.mkdtemp(prefix="bench_build_shards_")
    try:
        paths, text_mb = make_corpus(work, a.mb, a.procs)
        backend = load_tokenizer(a.tokenizer).backend
        variants = {
            "a_bare": lambda: bare(paths, a.tokenizer, a.procs),
            "b_build_shards": lambda: build(paths, a.tokenizer, a.procs, os.path.join(work, "shards"), a.seq_len),
            "c_datasets_same": lambda: hf_datasets(paths, a.tokenizer, a.procs, os.path.join(work, "ds"), "same"),
            "c_datasets_hf": lambda: hf_datasets(paths, a.tokenizer, a.procs, os.path.join(work, "ds"), "hf"),
        }
        wall: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        tokens: dict[str, int] = {}
        for r in range(a.repeats):
            for name, run in variants.items():
                for output in ("shards", "ds"):  # the previous repeat's output; deleting it is not part of a run
                    shutil.rmtree(os.path.join(work, output), ignore_errors=True)
                t0, c0 = time.perf_counter(), cpu_seconds()
                tokens[name] = run()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(cpu_seconds() - c0)
                print(f"repeat {r + 1}: {name} {wall[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s cpu",
                      file=sys.stderr, flush=True)
        print(f"{len(paths)} files, {text_mb:.1f} MB of text, {tokens['a_bare'] / 1e6:.2f} M tokens, {a.procs} "
              f"processes, seq_len {a.seq_len}, tokenizer backend {backend}; best of {a.repeats} runs")
        best_wall = {k: min(v) for k, v in wall.items()}
        best_cpu = {k: min(v) for k, v in cpu.items()}
        for name in variants:  # the same documents for all: (b) also counts BOS/EOS, so rates use (a)'s count
            print(f"{name:16s} wall {best_wall[name]:6.2f} s = {tokens['a_bare'] / best_wall[name] / 1e6:5.2f} M tok/s"
                  f"   cpu {best_cpu[name]:6.2f} s = {tokens['a_bare'] / best_cpu[name] / 1e6:5.2f} M tok/cpu-s"
                  f"   wall runs [{', '.join(f'{t:.2f}' for t in wall[name])}]")
        for label, best in (("wall", best_wall), ("cpu", best_cpu)):
            b = best["b_build_shards"]
            print(f"{label}: (b)/(a) = {best['a_bare'] / b:.3f} (goal >= 0.85);  (b)/(c) = "
                  f"{best['c_datasets_same'] / b:.2f} with the same encoder, {best['c_datasets_hf'] / b:.2f} with "
                  f"the HF fast tokenizer (goal >= 1.2)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
