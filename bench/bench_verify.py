"""What shard verification costs the loader: one epoch of ``ShardLoader`` with ``verify=True`` (each shard's sha256
when the process first opens it, every sample's token ids against the vocabulary) against ``verify=False``.

A fresh loader per epoch, so every timed epoch hashes every shard: the worst case, a first epoch (later epochs of a
long run hash nothing, as each process keeps what it verified). The shards are real data prep output of the sample
corpus; the page cache is warm for both variants, so the hash's cost is its CPU time, not disk reads.
Run: ``python bench/bench_verify.py [--seq-len 512 --samples-per-shard 64 --micro-batch 8 --reps 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from pipeline.data.format.index import load_index
from pipeline.data.format.tar_shard import sha256_file
from pipeline.data.loading.loader import ShardLoader
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample")


def epoch_seconds(index, micro_batch: int, verify: bool) -> float:
    loader = ShardLoader(index, micro_batch, verify=verify)
    start = time.perf_counter()
    for _ in range(loader.batches_per_epoch):
        loader.next_global_step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "shards")
        run_job(BuildConfig(inputs=(os.path.join(SAMPLE, "train", "**", "*.jsonl.zst"),),
                            tokenizer=os.path.join(SAMPLE, "tokenizer"), output=out, seq_len=args.seq_len,
                            samples_per_shard=args.samples_per_shard, progress=False))
        index = load_index(out)
        total_bytes = sum(s.bytes for s in index.shards)
        epoch_seconds(index, args.micro_batch, verify=True)  # warm the page cache and the code paths
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.reps):  # interleaved, so machine noise hits both alike
            for verify in (False, True):
                times[verify].append(epoch_seconds(index, args.micro_batch, verify))
        start = time.perf_counter()
        for s in index.shards:
            sha256_file(s.path)
        hash_s = time.perf_counter() - start
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    n = index.num_samples // args.micro_batch * args.micro_batch
    print(f"{len(index.shards)} shards, {index.num_samples} samples of {args.seq_len} tokens, "
          f"{total_bytes / 2**20:.1f} MiB; median of {args.reps} epochs")
    print(f"loader, verify=False: {n / plain:,.0f} samples/s ({plain:.3f} s/epoch)")
    print(f"loader, verify=True:  {n / checked:,.0f} samples/s ({checked:.3f} s/epoch)")
    ratio = statistics.median(t / f for f, t in zip(times[False], times[True]))
    print(f"verify=True / verify=False epoch time (median of back-to-back ratios): {ratio:.3f}")
    print(f"sha256 alone: {total_bytes / 2**20 / hash_s:,.0f} MiB/s ({hash_s / plain:.1%} of an unverified epoch)")


if __name__ == "__main__":
    main()
