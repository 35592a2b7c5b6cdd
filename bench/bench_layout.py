"""CPU layouts of one training run: which split of this machine's cores into ranks, threads and ZeRO stage trains
fastest, with the same losses.

The same experiment (the embedded default's data, ``--init`` from a preset or an HF directory, global batch 8) is
launched under each layout, in turns, ``--reps`` times: (a) the baseline, 2 ranks x 1 thread with ZeRO-3 (the
tests' and smoke twins' layout); (b) 1 rank x 2 threads with ZeRO-3; (c) 1 rank x 2 threads with no ZeRO
(``ds_configs/zero0.json``). Prints each layout's median tokens/s over the steps after the first two, its launch's
wall time, both as ratios to the baseline, and the largest relative loss difference to the baseline. Run from the
repository root:

    python bench/bench_layout.py [--init 20m] [--steps 12] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "ds_configs")
LAYOUTS = {  # name -> (ranks, threads a rank, DeepSpeed JSON)
    "2 ranks x 1 thread, ZeRO-3": (2, 1, "zero3.json"),
    "1 rank x 2 threads, ZeRO-3": (1, 2, "zero3.json"),
    "1 rank x 2 threads, ZeRO-0": (1, 2, "zero0.json"),
}
GLOBAL_BATCH, MICRO_BATCH = 8, 4


def launch(run_dir: str, layout: tuple[int, int, str], init: str, steps: int) -> float:
    """Train under ``layout``; returns the launch's wall time."""
    ranks, threads, config = layout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.join(REPO, "launch", "train.py"), "--config", os.path.join(CONFIGS, config)]
    for item in (f"run_dir={run_dir}", f"model.init={init}", f"train.steps={steps}", f"train.micro_batch={MICRO_BATCH}",
                 f"train.grad_accum={GLOBAL_BATCH // (MICRO_BATCH * ranks)}", "train.log_every=1",
                 "optim.warmup_steps=1", "optim.decay_steps=1", f"checkpoint.every={steps}", "train.export_hf=false"):
        cmd += ["--set", item]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{layout}: training failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def read(run_dir: str) -> tuple[list[float], list[float]]:
    """(tokens/s, loss) of every logged step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    loss = next(k for k in records[0] if k.startswith("loss/"))
    return [r["perf/tokens_per_s"] for r in records], [r[loss] for r in records]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default="20m", help="a preset or an HF checkpoint directory")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    speed: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    wall: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for i, (name, layout) in enumerate(LAYOUTS.items()):
                run_dir = os.path.join(tmp, f"{rep}-{i}")
                wall[name].append(launch(run_dir, layout, args.init, args.steps))
                tokens_per_s, losses[name] = read(run_dir)
                speed[name].append(statistics.median(tokens_per_s[2:]))
                print(f"rep {rep} {name}: {speed[name][-1]:,.0f} tokens/s, {wall[name][-1]:.1f} s", flush=True)
    base = next(iter(LAYOUTS))
    print(f"\n{args.init}, global batch {GLOBAL_BATCH} x 128 tokens, {args.steps} steps, median of {args.reps} launches")
    print("| layout | tokens/s | vs baseline | launch wall s | vs baseline | max rel. loss diff |")
    print("|---|---|---|---|---|---|")
    for name in LAYOUTS:
        s, w = statistics.median(speed[name]), statistics.median(wall[name])
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses[base]))
        print(f"| {name} | {s:,.0f} | {s / statistics.median(speed[base]):.2f}x | {w:.1f} | "
              f"{w / statistics.median(wall[base]):.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
