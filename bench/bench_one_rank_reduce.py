"""One rank at ZeRO-0 (the CPU reproduction's layout): the step with DeepSpeed's gradient reduction, which at a
world of one flattens every gradient, all-reduces it over itself and copies it back, against the step without it
(``pipeline.train.module.build_engine`` turns it off there).

Two engines are built from the same weights in this one process, the trainer's way (``build_engine``), one with
DeepSpeed's ``enable_backward_allreduce`` put back on; each step runs ``train_step`` on both, in turns, on the same
fixed MNTP batch. Prints the median step time of each, their ratio, and whether the losses are equal bit for bit.
Run from the repository root (one process, the threads torch picks):

    python bench/bench_one_rank_reduce.py [--init runs/models/smollm2-135m] [--steps 6]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", default="runs/models/smollm2-135m", help="a preset or an HF model directory")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")

    import deepspeed
    import torch
    import torch.distributed as dist

    from pipeline.data.loading.batch import Batch
    from pipeline.experiment import load_experiment
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.engine_spec import engine_spec
    from pipeline.train.module import build_engine
    from pipeline.train.phases import build_objectives
    from pipeline.train.preflight import check_model
    from pipeline.train.step import train_step

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    sets = [f"model.init={args.init}", "model.attn_implementation=sdpa", f"train.micro_batch={args.rows}",
            f"data.seq_len={args.seq_len}", "phases=[{objectives: [{name: mntp, ratio: 0.2}]}]"]
    if os.path.isdir(args.init):  # an HF model with its own tokenizer, which has no mask token: the reproduction's
        sets += [f"data.tokenizer={args.init}", "phases.0.objectives.0.mask_token=_"]
    exp = load_experiment(None, sets)
    tok = load_tokenizer(exp.data.tokenizer)
    ds = resolve_ds_config(load_ds_config(os.path.join(REPO, "ds_configs", "zero0.json")), exp, 1, False)
    engines, objectives = [], build_objectives(exp.phases[0], tok)
    for reduce in (True, False):
        torch.manual_seed(0)
        _, engine = build_engine(copy.deepcopy(ds), check_model(exp, tok, ds, False), engine_spec(exp, False),
                                 [o.objective for o in objectives])
        assert engine.enable_backward_allreduce is False  # what build_engine chose at a world of one
        engine.enable_backward_allreduce = reduce
        engines.append(engine)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, tok.info.vocab_size, (args.rows, args.seq_len), generator=g)
    rank = torch.randint(0, 1 << 20, ids.shape, generator=g, dtype=torch.int32)
    none = torch.zeros_like(rank)
    batch = Batch(input_ids=ids, doc_ids=none, mask_rank=rank, mask_draw=rank.long(), span_ids=none - 1,
                  keys=[str(i) for i in range(args.rows)])
    times: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]
    for _ in range(args.steps):
        for i, engine in enumerate(engines):
            start = time.perf_counter()
            result = train_step(engine, objectives, {"packed": [batch]}, 1, 1)
            times[i].append(time.perf_counter() - start)
            losses[i].append(result.losses["mntp"])
    reduced, skipped = (statistics.median(t[1:]) for t in times)
    print(json.dumps({"init": args.init, "threads": torch.get_num_threads(), "steps": args.steps,
                      "with_reduce_s": round(reduced, 3), "without_s": round(skipped, 3),
                      "ratio": round(skipped / reduced, 3), "losses_equal": losses[0] == losses[1]}))


if __name__ == "__main__":
    main()
