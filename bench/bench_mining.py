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
one process: ours >= 1.0x. Ours encodes the corpus and the queries not in it in one pass (the model has one prefix
for both), so here, where every query but the first is also a document, about half the texts of
``mine_hard_negatives``' two calls: the bench prints how many.

``--ranks N``: ours on N CPU ranks (gloo, one thread each, as torchrun's workers): this process is rank 0 and
starts the others, which load the model before any timing and join each of ours' passes (``encode``'s batches split
over the ranks, the search on rank 0); ``mine_hard_negatives`` runs on this process alone, with its threads, between
them (goal: ours >= 1.6x on 2 ranks). Run from the repository root:

    python bench/bench_mining.py [--preset 20m] [--rows 1024] [--reps 3] [--ranks 2] [--out results.json]
    python bench/bench_mining.py --dry-run   # tiny preset, 96 rows, one rep
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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
    p.add_argument("--ranks", type=int, default=1, help="ours on this many CPU ranks (module docstring)")
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
        threads = torch.get_num_threads()
        if args.ranks > 1:
            others = join(args.ranks, hf, settings, rows, 1 + args.reps)
            torch.set_num_threads(1)
        embed = Embedder(MineConfig((), hf, "", settings, encoder="pipeline", progress=False))
        torch.set_num_threads(threads)
        st = SentenceTransformer(hf, device="cpu")

        def ours() -> list[tuple]:
            if args.ranks > 1:
                torch.set_num_threads(1)
                dist.barrier()  # the other ranks are loaded and waiting: each pass starts them together
            mined = mine_file(task, embed, settings, progress=False)
            torch.set_num_threads(threads)
            return sorted((r["query"], r["positive"], *r["negative"]) for r in mined_rows(rows, task, mined))

        def theirs() -> list[tuple]:
            data = Dataset.from_dict({"query": [r["query"] for _, r in rows],
                                      "positive": [r["positive"] for _, r in rows]})
            out = mine_hard_negatives(data, st, corpus=task.corpus, output_format="n-tuple", verbose=False, **kw)
            return sorted((r["query"], r["positive"], *(r[f"negative_{i + 1}"] for i in range(args.num_negatives)))
                          for r in out)

        a, b = ours(), theirs()  # also the warm-up
        differ = len(set(a) ^ set(b)) // 2
        once = sum(i >= 0 for i in task.query_in_corpus)
        print(f"{args.ranks} rank(s); {once} of {len(task.queries)} queries are also documents (ours embeds them "
              f"once: {len(task.corpus) + len(task.queries) - once} texts, theirs "
              f"{len(task.corpus) + len(task.queries)})", flush=True)
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
        if args.ranks > 1:
            for proc in others:
                proc.join()
            dist.destroy_process_group()
    rates = {name: len(rows) / statistics.median(s) for name, s in seconds.items()}
    base = rates["mine_hard_negatives"]
    print(f"{args.preset} fp32 on cpu, ours on {args.ranks} rank(s), {len(rows)} queries, corpus {len(task.corpus)}, median of {args.reps}:")
    for name, rate in rates.items():
        print(f"  {name:22} {rate:10.1f} queries/s  {rate / base:6.2f}x  (passes: "
              f"{', '.join(f'{t:.1f}' for t in seconds[name])} s)")
    results = {"preset": args.preset, "ranks": args.ranks, "queries_embedded_once": once, "rows": len(rows), "corpus": len(task.corpus), "settings": kw,
               "reps": args.reps, "rows_kept": len(b), "rows_differ": differ, "queries_per_s": rates, "seconds": seconds,
               "ratio": rates["pipeline.mining"] / base}
    write_results(args.out, results)
    print(f"pipeline.mining / mine_hard_negatives: {results['ratio']:.2f}x")
    return 0



def join(ranks: int, hf: str, settings: MiningSettings, rows: list, passes: int) -> list:
    """Start ranks 1 .. ranks - 1 (spawned, one thread each) and make this process rank 0 of their gloo group."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(ranks),
                       "TORCHELASTIC_USE_AGENT_STORE": "True"})
    ctx = mp.get_context("spawn")
    others = [ctx.Process(target=rank_main, args=(r, ranks, hf, settings, rows, passes)) for r in range(1, ranks)]
    for proc in others:
        proc.start()
    dist.init_process_group("gloo", rank=0, world_size=ranks)
    join.store = store  # held until the run ends
    return others


def rank_main(rank: int, ranks: int, hf: str, settings: MiningSettings, rows: list, passes: int) -> None:
    """Another rank: load the model, then join each of rank 0's passes (its share of encode's batches)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    embed = Embedder(MineConfig((), hf, "", settings, encoder="pipeline", progress=False))
    task = Task.of(rows)
    for _ in range(passes):
        dist.barrier()
        mine_file(task, embed, settings, progress=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
