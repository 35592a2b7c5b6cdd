"""The trainer's step time against a bare DeepSpeed engine loop: same model, same batches, same processes.

In 2 ranks of ZeRO-3 on CPU (gloo), two identically configured engines start from the same weights:

  (a) bare: ``engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()`` on a fixed batch (this
      rank's first micro-batches), HF's own full-head loss;
  (b) ours: what the training loop does per step -- this rank's micro-batches from the real ``ShardLoader``,
      ``pipeline.train.step.train_step`` with the CLM objective (target-only head, document masking, global
      target-count normalisation), then the loop's per-step bookkeeping (grad norm, stop agreement, metrics).

With ``--eval-every N`` (b) also runs the trainer's validation (``pipeline.train.validation.Validator``: the
phase's CLM and the three probes on ``--eval-samples`` held-out samples) after every N-th step, timed apart from
the step, and it prints what validation adds to training: one evaluation against the N steps it follows.

Steps alternate between (a) and (b) so machine noise hits both alike; it prints medians, where the time goes,
and the ratio (goal <= 1.05): the median over steps of ours / the bare step just before it, which follows a
shared machine's changing load better than the ratio of medians (also printed). Shards come from the embedded
sample corpus (one input file), the model is a Llama of the chosen shape with the sample tokenizer's 8k
vocabulary. Run from the repository root:

    python bench/bench_trainer.py --shape tiny      # tiny preset, seq 128
    python bench/bench_trainer.py --shape h256      # hidden 256, 4 layers, seq 256: compute dominates
    python bench/bench_trainer.py --shape tiny --eval-every 50 --eval-samples 256   # the cost of validation

It relaunches itself under ``torch.distributed.run`` with ``--nproc`` ranks (DS_ACCELERATOR=cpu, 1 thread each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_INPUT = os.path.join(REPO, "data", "sample", "train", "chunk1", "example_train_0.jsonl.zst")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int


SHAPES = {"tiny": Shape(layers=2, hidden=64, heads=4, seq_len=128, micro_batch=4),
          "h256": Shape(layers=4, hidden=256, heads=4, seq_len=256, micro_batch=4)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(nproc: int) -> int:
    """Run this script under torch.distributed.run on the CPU accelerator, one thread per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           os.path.abspath(__file__), *sys.argv[1:]]
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **os.environ}
    return subprocess.call(cmd, env=env, cwd=REPO)


class TimedEngine:
    """A DeepSpeed engine whose forward (call), backward and step add their seconds to ``times``; everything
    else is passed through, so ``train_step`` runs on it unchanged."""

    def __init__(self, engine):
        self._engine = engine
        self.times: dict[str, float] = defaultdict(float)

    def _timed(self, part: str, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.times[part] += time.perf_counter() - start
        return out

    def __call__(self, *args, **kwargs):
        return self._timed("forward", self._engine, *args, **kwargs)

    def backward(self, loss):
        return self._timed("backward", self._engine.backward, loss)

    def step(self):
        return self._timed("step", self._engine.step)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pipeline.data.build import run_job
    from pipeline.data.build_config import BuildConfig
    from pipeline.data.holdout import ValidationSamples
    from pipeline.data.loader import ShardLoader
    from pipeline.data.manifest import load_index
    from pipeline.experiment import ValidationConfig, load_experiment
    from pipeline.model.presets import ModelPreset
    from pipeline.run_dir import RunDir
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.ds_config import load_ds_config, resolve_ds_config
    from pipeline.train.metrics import MetricsLogger
    from pipeline.train.module import build_train_model
    from pipeline.train.phases import build_objectives
    from pipeline.train.schedule import lr_scheduler
    from pipeline.train.signals import StopRequest
    from pipeline.train.step import train_step
    from pipeline.train.validation import Validator, probes

    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = SHAPES[args.shape]
    work = os.path.join(args.work_dir, args.shape)
    shards, init_dir = os.path.join(work, f"shards-{shape.seq_len}"), os.path.join(work, "init")
    tokenizer_dir = os.path.join(REPO, "data", "sample", "tokenizer")
    tokenizer = load_tokenizer(tokenizer_dir)
    if rank == 0:  # data and initial weights shared by both engines, made afresh (a few seconds)
        shutil.rmtree(work, ignore_errors=True)
        run_job(BuildConfig(inputs=(SAMPLE_INPUT,), tokenizer=tokenizer_dir, output=shards, seq_len=shape.seq_len,
                            progress=False))
        preset = ModelPreset(num_layers=shape.layers, hidden_size=shape.hidden, ffn_size=4 * shape.hidden,
                             num_heads=shape.heads, num_kv_heads=shape.heads, max_seq_len=shape.seq_len)
        info = tokenizer.info
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(preset.to_config(info.vocab_size, pad_token_id=info.pad_id,
                                                          bos_token_id=info.bos_id, eos_token_id=info.eos_id)
                                         ).save_pretrained(init_dir)
    dist.barrier()

    exp = load_experiment(None, [f"run_dir={os.path.join(work, 'run', str(rank))}", f"data.shards={shards}",
                                 f"data.seq_len={shape.seq_len}", f"model.init={init_dir}",
                                 f"train.micro_batch={shape.micro_batch}", f"train.grad_accum={args.grad_accum}",
                                 "train.steps=100000", "train.log_every=100000"])
    ds_raw = load_ds_config(os.path.join(REPO, "ds_configs", "zero3.json"))
    (clm,) = build_objectives(exp.phases[0], tokenizer)

    def engine_for(use_train_module: bool):
        ds = resolve_ds_config(ds_raw, exp, world, bf16=False)
        lm, module, optimizer = build_train_model(exp, ds, tokenizer, False, [clm.objective],
                                                  attn_implementation="sdpa", fused="none")
        engine, *_ = deepspeed.initialize(model=module if use_train_module else lm, **optimizer,
                                          lr_scheduler=lr_scheduler(exp.train.steps, exp.optim), config=ds)
        return TimedEngine(engine), module

    bare, _bare_module = engine_for(use_train_module=False)  # the module holds HfDeepSpeedConfig alive
    ours, _ours_module = engine_for(use_train_module=True)
    index = load_index(shards)
    validation = ValidationConfig(every=args.eval_every, holdout=0.01, samples=args.eval_samples)
    held = ValidationSamples(index, index.num_samples - args.eval_samples, args.eval_samples)
    validator = Validator(validation, held, probes(validation, tokenizer),
                          args.eval_micro_batch or shape.micro_batch, verify=False)
    loader = ShardLoader(index, shape.micro_batch, args.grad_accum, rank, world, exp.train.seed,
                         num_samples=held.first)
    fixed = [b.input_ids for b in ShardLoader(index, shape.micro_batch, args.grad_accum, rank, world,
                                              exp.train.seed).next_global_step()]  # ours' first step's batch
    metrics = MetricsLogger(RunDir(exp.run_dir), rank == 0, exp.train.log_every)
    stop = StopRequest(rank)
    stop.training_started()
    cpu = torch.device("cpu")

    def bare_step() -> dict[str, float]:
        for x in fixed:
            loss = bare(input_ids=x, labels=x).loss
            bare.backward(loss)
            bare.step()
        return {"loss": loss.item()}

    def our_step() -> dict[str, float]:
        start = time.perf_counter()
        batches = {"packed": [b.to(cpu) for b in loader.next_global_step()]}
        ours.times["data"] += time.perf_counter() - start
        result = train_step(ours, [clm], batches, world, args.grad_accum)
        losses = result.losses
        start = time.perf_counter()
        tokens = world * sum(int((b.doc_ids >= 0).sum()) for b in batches["packed"])
        scalars = {"loss/clm": losses["clm"], "optim/lr": result.lr, "optim/grad_norm": result.grad_norm,
                   "perf/tokens_per_s": float(tokens), "perf/data_wait": 0.0, "perf/mem_gib": 0.0}
        metrics.log(ours.global_steps, scalars, "clm")
        stop.agreed()
        ours.times["loop bookkeeping"] += time.perf_counter() - start
        return {"loss": losses["clm"]}

    samples: dict[str, dict[str, list[float]]] = {"bare": defaultdict(list), "ours": defaultdict(list)}
    for i in range(args.warmup + args.steps):
        for name, fn, engine in (("bare", bare_step, bare), ("ours", our_step, ours)):
            dist.barrier()
            engine.times.clear()
            start = time.perf_counter()
            out = fn()
            dist.barrier()  # a step ends when every rank is done: both loops pay for the slower rank alike
            total = time.perf_counter() - start
            if i == 0 and rank == 0:
                print(f"first step loss: {name} {out['loss']:.4f}", flush=True)
            if i >= args.warmup:
                parts = samples[name]
                parts["total"].append(total)
                for part, seconds in engine.times.items():
                    parts[part].append(seconds)
                parts["other"].append(total - sum(engine.times.values()))
        if args.eval_every and (i + 1) % args.eval_every == 0:
            dist.barrier()
            start = time.perf_counter()
            validator.run(ours, [clm], cpu)
            dist.barrier()
            samples["ours"]["eval"].append(time.perf_counter() - start)
    metrics.close({})
    if rank == 0:
        report(args, shape, world, samples)


def report(args: argparse.Namespace, shape: Shape, world: int, samples: dict[str, dict[str, list[float]]]) -> None:
    """Medians per part (ms) side by side, and the ratio of the medians of the totals."""
    med = {name: {part: statistics.median(ts) * 1e3 for part, ts in parts.items()} for name, parts in samples.items()}
    print(f"\nshape {args.shape}: {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq_len}, micro batch "
          f"{shape.micro_batch} x grad_accum {args.grad_accum} x {world} ranks, ZeRO-3, fp32, "
          f"{args.steps} timed steps after {args.warmup} warm-up (medians, rank 0)")
    parts = ["data", "forward", "backward", "step", "loop bookkeeping", "other", "total"]
    print(f"{'part (ms)':>18} {'bare':>9} {'ours':>9}")
    for part in parts:
        cells = [f"{med[name][part]:9.1f}" if part in med[name] else f"{'-':>9}" for name in ("bare", "ours")]
        print(f"{part:>18} {' '.join(cells)}")
    ours, bare = samples["ours"]["total"], samples["bare"]["total"]
    paired = statistics.median(o / b for o, b in zip(ours, bare))  # each step against the bare step just before it
    print(f"trainer / bare DeepSpeed step time: {paired:.3f}x (median of paired steps), "
          f"{med['ours']['total'] / med['bare']['total']:.3f}x (ratio of medians), "
          f"{min(ours) / min(bare):.3f}x (best steps); goal <= 1.05x")
    if args.eval_every:
        evals = samples["ours"]["eval"]
        step, evaluation = statistics.median(ours), statistics.median(evals)
        print(f"validation: {len(evals)} evaluations of {args.eval_samples} held-out samples, "
              f"{args.eval_micro_batch or shape.micro_batch} a forward (the phase's CLM, which is the CLM "
              f"probe, and the MLM and MNTP probes: 3 forwards), median {evaluation * 1e3:.0f} ms = {evaluation / step:.2f} training steps; every "
              f"{args.eval_every} steps: training with validation / without = "
              f"{1 + evaluation / (args.eval_every * step):.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps of each loop")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps of each loop first")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--eval-every", type=int, default=0, help="validation after every N-th step (0: none)")
    parser.add_argument("--eval-samples", type=int, default=256, help="held-out samples each validation scores")
    parser.add_argument("--eval-micro-batch", type=int, default=0, help="validation rows per rank per forward "
                                                                         "(0: the shape's micro-batch)")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "bench_trainer"),
                        help="shards, initial weights and metrics go here (replaced on every run)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        return relaunch(args.nproc)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
