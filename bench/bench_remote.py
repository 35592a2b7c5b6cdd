"""What reading a shard directory at a URL costs the loader against reading it locally: one epoch of ``ShardLoader``
(``verify=True``) over the local directory, over the same directory served by a loopback HTTP server with an empty
cache (every shard downloaded, its size and sha256 checked, renamed into the cache) and with the warm cache of a
previous epoch (nothing downloaded), in one process.

The server runs in a thread of this process, on the loopback interface: the numbers are the store's own cost
(transfer through the socket, the extra write and rename, the hash on the way in), not a real network's latency or
bandwidth. Run: ``python bench/bench_remote.py [--seq-len 512 --samples-per-shard 64 --micro-batch 8 --reps 3]``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import statistics
import tempfile
import threading
import time

from pipeline.data.format.index import load_index
from pipeline.data.format.remote import ShardStore
from pipeline.data.loading.loader import ShardLoader
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "sample")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def epoch_seconds(index, micro_batch: int) -> float:
    loader = ShardLoader(index, micro_batch)
    start = time.perf_counter()
    for _ in range(loader.batches_per_epoch):
        loader.next_global_step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "shards")
        run_job(BuildConfig(inputs=(os.path.join(SAMPLE, "train", "**", "*.jsonl.zst"),),
                            tokenizer=os.path.join(SAMPLE, "tokenizer"), output=out, seq_len=args.seq_len,
                            samples_per_shard=args.samples_per_shard, progress=False))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=tmp))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        cache = os.path.join(tmp, "cache")
        local = load_index(out)
        remote = load_index(f"http://127.0.0.1:{server.server_address[1]}/shards", ShardStore(cache_dir=cache))
        epoch_seconds(local, args.micro_batch)  # warm the page cache and the code paths
        times: dict[str, list[float]] = {"local": [], "cold": [], "warm": []}
        for _ in range(args.reps):  # interleaved, so machine noise hits all alike
            times["local"].append(epoch_seconds(local, args.micro_batch))
            shutil.rmtree(cache, ignore_errors=True)
            times["cold"].append(epoch_seconds(remote, args.micro_batch))
            times["warm"].append(epoch_seconds(remote, args.micro_batch))
        server.shutdown()
        server.server_close()
    median = {k: statistics.median(v) for k, v in times.items()}
    n = local.num_samples // args.micro_batch * args.micro_batch
    mb = sum(s.bytes for s in local.shards) / 1e6
    print(f"{len(local.shards)} shards, {mb:.1f} MB, {n} samples of seq_len {args.seq_len}, micro_batch "
          f"{args.micro_batch}, median of {args.reps}")
    for kind, label in (("local", "local directory"), ("cold", "http, empty cache"), ("warm", "http, warm cache")):
        print(f"{label:18s} {median[kind]:7.3f} s/epoch  {n / median[kind]:8.0f} samples/s  "
              f"{median[kind] / median['local']:5.2f}x local")


if __name__ == "__main__":
    main()
