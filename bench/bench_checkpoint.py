"""The step time a checkpoint costs: written synchronously against ``checkpoint.async_save``, in one process.

One DeepSpeed engine (one rank, the preset's shape, the sample tokenizer, CLM on random tokens) trains; every
``--every`` steps it checkpoints through a :class:`~pipeline.train.checkpoint.Checkpointer`, alternately the
synchronous one and the asynchronous one, into separate run directories. The cost of a checkpoint is what the
training thread loses to it: the time from the end of the step before the save to the end of the step after it,
less the median plain step; for the asynchronous writer that includes the host copy, the wait for the previous
save's files and what the background writes take from the next steps. It prints both medians and their ratio.

    python bench/bench_checkpoint.py --preset 20m --saves 4
    python bench/bench_checkpoint.py --preset 20m --ds-config ds_configs/zero3.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    from pipeline.train.deepspeed_ops import use_install_ops_dir

    use_install_ops_dir()  # DeepSpeed's ops, this process's and its children's, in this install's folder
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="20m")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    ap.add_argument("--saves", type=int, default=4, help="checkpoints of each kind")
    ap.add_argument("--ds-config", default=os.path.join(REPO, "ds_configs", "zero0.json"))
    args = ap.parse_args()

    import deepspeed
    import torch

    from pipeline.data.format.sample import UNMASKABLE
    from pipeline.data.loading.batch import Batch
    from pipeline.experiment import load_experiment
    from pipeline.run_dir import RunDir
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.checkpoint import Checkpointer
    from pipeline.train.distributed import single_process_env
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.engine_spec import engine_spec
    from pipeline.train.module import build_engine
    from pipeline.train.phases import build_objectives
    from pipeline.train.plan import checkpoint_spec
    from pipeline.train.preflight import check_model
    from pipeline.train.state import TrainState
    from pipeline.train.step import train_step

    single_process_env()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    exp = load_experiment(None, [f"model.init={args.preset}", f"data.seq_len={args.seq_len}",
                                 f"train.micro_batch={args.micro_batch}", "checkpoint.keep_last=1"])
    tokenizer = load_tokenizer(exp.data.tokenizer)
    ds = resolve_ds_config(load_ds_config(args.ds_config), exp, 1, bf16=False)
    _, engine = build_engine(ds, check_model(exp, tokenizer, ds, cuda=False), engine_spec(exp, cuda=False))
    objectives = build_objectives(exp.phases[0], tokenizer)
    shape = (args.micro_batch, args.seq_len)
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        ids = torch.randint(tokenizer.info.vocab_size, shape, generator=generator)
        batch = Batch(input_ids=ids, doc_ids=torch.zeros(shape, dtype=torch.int32),
                      mask_rank=torch.full(shape, UNMASKABLE, dtype=torch.int32),
                      mask_draw=torch.zeros(shape, dtype=torch.int64),
                      span_ids=torch.full(shape, -1, dtype=torch.int32), keys=[""] * args.micro_batch)
        t0 = time.perf_counter()
        train_step(engine, objectives, {"packed": [batch]}, 1, 1)
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        plain_engine = engine.checkpoint_engine
        checkpointers = {}
        for kind, on in (("sync", False), ("async", True)):
            spec = dataclasses.replace(checkpoint_spec(exp.checkpoint), async_save=on)
            engine.checkpoint_engine = plain_engine
            checkpointers[kind] = Checkpointer(engine, RunDir(os.path.join(tmp, kind)), spec, {})
        engines = {kind: engine.checkpoint_engine if kind == "async" else plain_engine for kind in checkpointers}
        plain, lost = [], {kind: [] for kind in checkpointers}
        step()  # warm-up
        n = 0
        for _ in range(args.saves):
            for kind, checkpointer in checkpointers.items():
                plain += [step() for _ in range(args.every - 1)]
                n += args.every
                engine.checkpoint_engine = engines[kind]
                t0 = time.perf_counter()
                checkpointer.save(TrainState({}, step=n))
                lost[kind].append(time.perf_counter() - t0 + step())
        for checkpointer in checkpointers.values():
            checkpointer.wait()
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, "sync")) for f in fs)
    base = statistics.median(plain)
    cost = {kind: statistics.median(ts) - base for kind, ts in lost.items()}
    print(f"{args.preset}, {os.path.basename(args.ds_config)}, one rank, checkpoint {size / 2**20:.0f} MiB; "
          f"plain step {base * 1e3:.0f} ms (median of {len(plain)})")
    for kind, c in cost.items():
        print(f"  {kind:5s}  step time lost per checkpoint: {c * 1e3:7.0f} ms (median of {args.saves})")
    print(f"async / sync: {cost['async'] / cost['sync']:.2f}")


if __name__ == "__main__":
    main()
