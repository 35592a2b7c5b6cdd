"""Sentences/s of the project's ``encode()`` against sentence-transformers' own ``SentenceTransformer.encode`` (one
process, and its multi-process pool) on the same exported model and the same sentences.

A preset with seeded weights is exported once as an HF directory with the sentence-transformers files
(``pipeline/export/sentence_transformers.py``: bidirectional attention, mean pooling over the text tokens, layout
``text``, no instruction), which both load. First both embed the first sentences and must agree (fp32: every value
within 1e-4; bf16: every cosine >= 0.99), so both compute the same thing; then each encodes all sentences ``--reps``
times, in turns, after one warm-up pass. The sentences are the sample pairs' texts (``data/sample/pairs``), joined
1-4 at a time so lengths vary as a corpus' do. Prints each one's median sentences/s and its ratio to
sentence-transformers' one-process ``encode`` (the baseline); goal on one GPU: ``encode()`` >= 1.0x. Run from the
repository root:

    python bench/bench_encode.py [--preset 20m] [--sentences 4096] [--device cpu|cuda] [--out results.json]
    python bench/bench_encode.py --dry-run   # the suite's: tiny preset, 96 sentences, one rep
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer

from pipeline.eval import encode, load_model
from pipeline.experiment import load_experiment
from pipeline.export.hf import save_hf
from pipeline.export.record import EncoderRecord
from pipeline.model.build import DTYPES, build_model, model_spec
from pipeline.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "data", "sample", "tokenizer")
PAIRS = os.path.join(REPO, "data", "sample", "pairs")
RECORD = EncoderRecord(attention="bidirectional", pooling="mean", layout="text", instruction="")
CHECKED = 64  # sentences both embed before timing


def sentences(n: int) -> list[str]:
    """``n`` texts of 1-4 consecutive distinct sample sentences."""
    seen: dict[str, None] = {}
    for name in sorted(os.listdir(PAIRS)):
        if name.endswith(".jsonl"):
            with open(os.path.join(PAIRS, name)) as f:
                for line in f:
                    seen.update({str(v).strip(): None for v in json.loads(line).values() if str(v).strip()})
    pool = list(seen)
    return [" ".join(pool[(i + j) % len(pool)] for j in range(1 + i % 4)) for i in range(n)]


def export(preset: str, out: str) -> str:
    """A seeded ``preset`` as an HF directory that sentence-transformers loads too."""
    tok = load_tokenizer(TOKENIZER)
    torch.manual_seed(0)
    lm = build_model(model_spec(preset, tok.info.vocab_size, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                     eos_token_id=tok.eos_id))
    return save_hf(lm, lm.state_dict(), tok, out, RECORD, load_experiment(None, [f"model.init={preset}"]), 0,
                   sentence_transformers=True)


def agreement(ours: np.ndarray, theirs: np.ndarray, dtype: str) -> str:
    """Raise unless both embed alike (module docstring); a line saying how closely."""
    cosine = (ours * theirs).sum(1) / np.maximum(np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1), 1e-12)
    line = f"max |diff| {np.abs(ours - theirs).max():.2e}, min cosine {cosine.min():.6f}"
    same = np.allclose(ours, theirs, atol=1e-4, rtol=0) if dtype == "fp32" else cosine.min() >= 0.99
    if not same:
        raise SystemExit(f"encode() and sentence-transformers embed differently ({line}); the comparison is void")
    return line


def write_results(out: str | None, results: dict) -> None:
    """``results`` with the versions and core count that produced them, as JSON at ``out`` (when given)."""
    results |= {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "sentence-transformers": sentence_transformers.__version__,
                             "python": platform.python_version()}, "cpus": os.cpu_count()}
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)


def timed(fn, texts: list[str], device: str) -> float:
    """Seconds of one pass (the device's queue drained)."""
    start = time.perf_counter()
    fn(texts)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="20m", help="model preset exported for both (pipeline/model/presets.py)")
    p.add_argument("--sentences", type=int, default=4096)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the pool: every visible GPU, or 2 CPU processes)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--max-tokens", type=int, default=16384, help="encode()'s padded tokens per batch")
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' rows per batch (its default)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pool-processes", type=int, help="processes of sentence-transformers' pool (default: every "
                   "visible GPU on cuda, 2 on CPU; 0: no pool)")
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="tiny preset, 96 sentences, one rep, a pool of one "
                   "process (the test suite's)")
    args = p.parse_args()
    if args.dry_run:
        args.preset, args.sentences, args.reps, args.pool_processes = "tiny", 96, 1, 1
    cuda = args.device.startswith("cuda")
    processes = args.pool_processes if args.pool_processes is not None else torch.cuda.device_count() if cuda else 2
    dtype = args.dtype if args.dtype != "auto" else "bf16" if cuda else "fp32"
    texts = sentences(args.sentences)
    with tempfile.TemporaryDirectory() as tmp:
        hf = export(args.preset, os.path.join(tmp, "model"))
        model = load_model(hf, device=args.device, dtype=dtype)
        st = SentenceTransformer(hf, device=args.device, model_kwargs={"dtype": DTYPES[dtype]})
        print(f"agreement on {CHECKED} sentences: "
              f"{agreement(encode(model, texts[:CHECKED]), st.encode(texts[:CHECKED]), dtype)}", flush=True)
        runs = {"encode()": lambda t: encode(model, t, max_tokens=args.max_tokens),
                "sentence-transformers encode": lambda t: st.encode(t, batch_size=args.batch_size)}
        pool = None
        if processes:
            pool = st.start_multi_process_pool([f"cuda:{i}" if cuda else "cpu" for i in range(processes)])
            runs[f"sentence-transformers pool ({processes} processes)"] = (
                lambda t: st.encode(t, batch_size=args.batch_size, pool=pool))
        try:
            for fn in runs.values():
                timed(fn, texts[:256], args.device)  # warm-up: kernels, the pool's model copies
            seconds: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.reps):
                for name, fn in runs.items():
                    seconds[name].append(timed(fn, texts, args.device))
        finally:
            if pool is not None:
                st.stop_multi_process_pool(pool)
    rates = {name: len(texts) / statistics.median(s) for name, s in seconds.items()}
    base = rates["sentence-transformers encode"]
    print(f"{args.preset} {dtype} on {args.device}, {len(texts)} sentences, median of {args.reps}:")
    for name, rate in rates.items():
        print(f"  {name:42} {rate:10.1f} sentences/s  {rate / base:6.2f}x")
    results = {"preset": args.preset, "dtype": dtype, "device": args.device, "sentences": len(texts),
               "reps": args.reps, "max_tokens": args.max_tokens, "batch_size": args.batch_size,
               "sentences_per_s": rates, "ratio_to_sentence_transformers": {n: r / base for n, r in rates.items()}}
    write_results(args.out, results)
    print(f"encode() / sentence-transformers encode: {rates['encode()'] / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
