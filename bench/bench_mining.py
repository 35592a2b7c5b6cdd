"""Queries/s of the project's hard-negative mining (``pipeline.mining``: ``encode()``, then the exact chunked top-k and
the filters) against sentence-transformers' ``mine_hard_negatives`` on the same model, corpus and settings, in one
process.

A preset with seeded weights is exported once as an HF directory with the sentence-transformers files (as
``bench_encode.py`` exports it), which both load before any timing. The rows are ``--rows`` (query, positive,
negative) triples of sample sentences (``bench_encode.sentences``: 1-4 joined, so lengths vary): query i, positive
i + 1, negative i + 2, so every query's text is also a document and the corpus is about ``--rows`` texts. Both mine
``--num-negatives`` with ``--range-min`` and ``--relative-margin`` (NV-Retriever's TopK-PercPos), n-tuple output:
ours embeds the corpus and the queries and mines (``mine_file``, ``mined_rows``), theirs builds its Dataset and calls
``mine_hard_negatives`` (its own encode, batch 32, its top-k). The rows kept and their negatives must agree (the
count of rows whose negatives differ is printed: a near tie within the encoders' ~1e-6 may differ), then each runs
``--reps`` times in turns after one warm-up. Prints each one's median queries/s (rows / s) and the ratio; goal on
one process: ours >= 1.0x. Run from the repository root:

    python bench/bench_mining.py [--preset 20m] [--rows 1024] [--reps 3] [--out results.json]
    python bench/bench_mining.py --dry-run   # tiny preset, 96 rows, one rep
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench_encode import export, sentences, write_results
from datasets import Dataset
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import mine_hard_negatives

from pipeline.mining.cli import Embedder, MineConfig, Task, mine_file, mined_rows
from pipeline.mining.negatives import MiningSettings


def rows_of(n: int) -> list[tuple[str, dict]]:
    texts = sentences(n + 2)
    return [(f"row {i}", {"query": texts[i], "positive": texts[i + 1], "negative": texts[i + 2]}) for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="20m", help="model preset exported for both (pipeline/model/presets.py)")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--num-negatives", type=int, default=3)
    p.add_argument("--range-min", type=int, default=2)
    p.add_argument("--relative-margin", type=float, default=0.05)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="tiny preset, 96 rows, one rep")
    args = p.parse_args()
    if args.dry_run:
        args.preset, args.rows, args.reps = "tiny", 96, 1
    rows = rows_of(args.rows)
    task = Task.of(rows)
    settings = MiningSettings(num_negatives=args.num_negatives, range_min=args.range_min,
                              relative_margin=args.relative_margin)
    kw = dict(num_negatives=args.num_negatives, range_min=args.range_min, relative_margin=args.relative_margin)
    with tempfile.TemporaryDirectory() as tmp:
        hf = export(args.preset, os.path.join(tmp, "model"))
        embed = Embedder(MineConfig((), hf, "", settings, encoder="pipeline", progress=False))
        st = SentenceTransformer(hf, device="cpu")

        def ours() -> list[tuple]:
            mined = mine_file(task, embed, settings, progress=False)
            return sorted((r["query"], r["positive"], *r["negative"]) for r in mined_rows(rows, task, mined))

        def theirs() -> list[tuple]:
            data = Dataset.from_dict({"query": [r["query"] for _, r in rows],
                                      "positive": [r["positive"] for _, r in rows]})
            out = mine_hard_negatives(data, st, corpus=task.corpus, output_format="n-tuple", verbose=False, **kw)
            return sorted((r["query"], r["positive"], *(r[f"negative_{i + 1}"] for i in range(args.num_negatives)))
                          for r in out)

        a, b = ours(), theirs()  # also the warm-up
        differ = len(set(a) ^ set(b)) // 2
        print(f"rows kept: ours {len(a)}, mine_hard_negatives {len(b)}; rows whose negatives differ: {differ}",
              flush=True)
        if abs(len(a) - len(b)) > max(1, len(b) // 50):
            raise SystemExit("the two keep different rows; the comparison is void")
        runs = {"pipeline.mining": ours, "mine_hard_negatives": theirs}
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - start)
    rates = {name: len(rows) / statistics.median(s) for name, s in seconds.items()}
    base = rates["mine_hard_negatives"]
    print(f"{args.preset} fp32 on cpu, {len(rows)} queries, corpus {len(task.corpus)}, median of {args.reps}:")
    for name, rate in rates.items():
        print(f"  {name:22} {rate:10.1f} queries/s  {rate / base:6.2f}x")
    results = {"preset": args.preset, "rows": len(rows), "corpus": len(task.corpus), "settings": kw,
               "reps": args.reps, "rows_kept": len(b), "rows_differ": differ, "queries_per_s": rates,
               "ratio": rates["pipeline.mining"] / base}
    write_results(args.out, results)
    print(f"pipeline.mining / mine_hard_negatives: {results['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
