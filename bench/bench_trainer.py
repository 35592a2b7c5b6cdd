"""The trainer's step time against a bare DeepSpeed engine loop: same model, same batches, same processes.

In 2 ranks of ZeRO-3 on CPU (gloo), two identically configured engines start from the same weights:

  (a) bare: ``engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()`` on a fixed batch (this
      rank's first micro-batches), HF's own full-head loss;
  (b) ours: ``Trainer.fit`` itself, the trainer built as ``launch/train.py`` builds it (``agreed_preflight``, then
      ``Trainer.build``) on a CLM experiment: each step reads this rank's micro-batches from the real
      ``ShardLoader``, runs ``pipeline.train.step.train_step`` (target-only head, document masking, global
      target-count normalisation) and the loop's per-step bookkeeping (metrics, the divergence guard, the stop
      agreement).

With ``--eval-every N`` the experiment validates (``eval.every``: the phase's CLM and the three probes on the last
``--eval-samples`` samples, held out of training) after every N-th step, timed apart from the step, and it prints
what validation adds to training: one evaluation against the N steps it follows.

Steps alternate between (a) and (b) so machine noise hits both alike: a bare step runs at each of ``fit``'s step
boundaries (inside the stop agreement, which every step calls once), outside the time of the steps around it. It
prints medians, where the time goes, and the ratio (goal <= 1.05): the median over steps of ours / the bare step
just before it, which follows a shared machine's changing load better than the ratio of medians (also printed).
Shards come from the embedded sample corpus (one input file), the model is a Llama of the chosen shape with the
sample tokenizer's 8k vocabulary. Run from the repository root:

    python bench/bench_trainer.py --shape tiny      # tiny preset, seq 128
    python bench/bench_trainer.py --shape h256      # hidden 256, 4 layers, seq 256: compute dominates
    python bench/bench_trainer.py --shape tiny --eval-every 50 --eval-samples 256   # the cost of validation

It relaunches itself under ``torch.distributed.run`` with ``--nproc`` ranks (DS_ACCELERATOR=cpu, 1 thread each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run this script under torch.distributed.run on the CPU accelerator, one thread per rank. ``argv`` leaves
    out ``--nproc``, which torch.distributed.run would take for an abbreviation of its own ``--nproc-per-node``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           os.path.abspath(__file__), *argv]
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **os.environ}
    return subprocess.call(cmd, env=env, cwd=REPO)


class TimedEngine:
    """A DeepSpeed engine whose forward (call), backward and step add their seconds to ``times``; everything
    else is passed through, so ``train_step`` runs on it unchanged."""

    def __init__(self, engine):
        self._engine = engine
        self.times: dict[str, float] = defaultdict(float)

    def __call__(self, *args, **kwargs):
        return timed(self._engine, self.times, "forward")(*args, **kwargs)

    def backward(self, loss):
        return timed(self._engine.backward, self.times, "backward")(loss)

    def step(self):
        return timed(self._engine.step, self.times, "step")()

    def __getattr__(self, name):
        return getattr(self._engine, name)


class StepClock:
    """Per-step seconds of (a) and (b), split into parts. ``fit`` calls ``boundary`` once per step; there the
    step of (b) that just ended is closed and the next bare step runs, each between barriers, so a step ends when
    every rank is done and both loops pay for the slower rank alike."""

    def __init__(self, bare_step, bare: TimedEngine, ours: TimedEngine, warmup: int, steps: int):
        self.bare_step, self.bare, self.ours, self.warmup, self.steps = bare_step, bare, ours, warmup, steps
        self.samples: dict[str, dict[str, list[float]]] = {"bare": defaultdict(list), "ours": defaultdict(list)}
        self.first_loss: dict[str, float] = {}
        self.step = 0  # steps of (b) done
        self.started = 0.0  # when the current step of (b) started
        self.apart = 0.0  # seconds of the current step of (b) spent on validation

    def run_bare(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        self.bare.times.clear()
        start = time.perf_counter()
        loss = self.bare_step()
        dist.barrier()
        self.first_loss.setdefault("bare", loss)
        self._record("bare", self.bare, time.perf_counter() - start)

    def start_ours(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        self.ours.times.clear()
        self.apart = 0.0
        self.started = time.perf_counter()

    def boundary(self) -> None:
        """The end of a step of (b) (its stop agreement done): close it, run the next bare step, start the next."""
        import torch.distributed as dist

        dist.barrier()
        self._record("ours", self.ours, time.perf_counter() - self.started - self.apart)
        self.step += 1
        if self.step < self.warmup + self.steps:
            self.run_bare()
            self.start_ours()

    def _record(self, name: str, engine: TimedEngine, total: float) -> None:
        index = self.step  # (a)'s step k runs just before (b)'s step k
        if index >= self.warmup:
            parts = self.samples[name]
            parts["total"].append(total)
            for part, seconds in engine.times.items():
                parts[part].append(seconds)
            parts["other"].append(total - sum(engine.times.values()))


def timed(fn, times: dict[str, float], part: str):
    """``fn`` adding its seconds to ``times[part]``."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        times[part] += time.perf_counter() - start
        return out
    return call


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pipeline.data.format.index import load_index
    from pipeline.data.loading.loader import ShardLoader
    from pipeline.data.prep.build import run_job
    from pipeline.data.prep.build_config import BuildConfig
    from pipeline.experiment import load_experiment
    from pipeline.model.presets import ModelPreset
    from pipeline.tokenizer import load_tokenizer
    from pipeline.train.distributed import start_distributed
    from pipeline.train.ds_config import load_ds_config
    from pipeline.train.module import build_train_model
    from pipeline.train.preflight import agreed_preflight, local_preflight
    from pipeline.train.schedule import lr_scheduler
    from pipeline.train.signals import StopRequest
    from pipeline.train.trainer import Trainer

    deepspeed.utils.logger.setLevel("WARNING")
    device, rank, world = start_distributed()
    shape = SHAPES[args.shape]
    work = os.path.join(args.work_dir, args.shape)
    shards, init_dir = os.path.join(work, f"shards-{shape.seq_len}"), os.path.join(work, "init")
    tokenizer_dir = os.path.join(REPO, "data", "sample", "tokenizer")
    if rank == 0:  # data and initial weights shared by both engines, made afresh (a few seconds)
        shutil.rmtree(work, ignore_errors=True)
        run_job(BuildConfig(inputs=(SAMPLE_INPUT,), tokenizer=tokenizer_dir, output=shards, seq_len=shape.seq_len,
                            progress=False))
        preset = ModelPreset(num_layers=shape.layers, hidden_size=shape.hidden, ffn_size=4 * shape.hidden,
                             num_heads=shape.heads, num_kv_heads=shape.heads, max_seq_len=shape.seq_len)
        info = load_tokenizer(tokenizer_dir).info
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(preset.to_config(info.vocab_size, pad_token_id=info.pad_id,
                                                          bos_token_id=info.bos_id, eos_token_id=info.eos_id)
                                         ).save_pretrained(init_dir)
    dist.barrier()

    index = load_index(shards)
    steps = args.warmup + args.steps
    # eval.holdout: exactly the last --eval-samples samples (holdout.held_out_count rounds up)
    validation = ([f"eval.every={args.eval_every}", f"eval.holdout={args.eval_samples / index.num_samples}",
                   f"eval.samples={args.eval_samples}", f"eval.micro_batch={args.eval_micro_batch or shape.micro_batch}"]
                  if args.eval_every else [])
    exp = load_experiment(None, [f"run_dir={os.path.join(work, 'run')}", f"data.shards={shards}",
                                 f"data.tokenizer={tokenizer_dir}", "data.build_if_missing=false",
                                 f"data.seq_len={shape.seq_len}", f"model.init={init_dir}",
                                 f"train.micro_batch={shape.micro_batch}", f"train.grad_accum={args.grad_accum}",
                                 f"train.steps={steps}", "train.log_every=100000", "train.export_hf=false",
                                 f"checkpoint.every={steps}", *validation])
    ds_raw = load_ds_config(os.path.join(REPO, "ds_configs", "zero3.json"))
    stop = StopRequest(rank)
    held = contextlib.ExitStack()  # rank 0 holds the run directory's lock until the run ends, as entry.py does
    local = local_preflight(exp, rank, world, device.type == "cuda", ds_raw)  # before the group in entry.py; here after
    prepared = agreed_preflight(exp, rank, world, device.type == "cuda", held, local, on_failure=stop.failing)
    if prepared is None:
        raise SystemExit(2)  # rank 0 said why
    (clm,) = prepared.objectives[0]

    # (a): the same model, optimizer and LR schedule as the trainer's engine, HF's model as the engine's module
    ds = prepared.ds_config()
    lm, _bare_module, optimizer = build_train_model(ds, prepared.model, prepared.engine,
                                                    [clm.objective])  # the module holds HfDeepSpeedConfig
    bare_engine, *_ = deepspeed.initialize(model=lm, **optimizer,
                                           lr_scheduler=lr_scheduler(prepared.engine.schedule), config=ds)
    bare = TimedEngine(bare_engine)
    fixed = [b.input_ids for b in ShardLoader(index, shape.micro_batch, args.grad_accum, rank, world,
                                              exp.train.seed).next_global_step()]  # ours' first step's batch

    def bare_step() -> float:
        for x in fixed:
            loss = bare(input_ids=x, labels=x).loss
            bare.backward(loss)
            bare.step()
        return loss.item()

    # (b): the trainer as launch/train.py builds it; its engine, data, bookkeeping and validation timed in place
    trainer = Trainer.build(prepared, stop, device)
    ours = TimedEngine(trainer.engine)
    trainer.engine = ours
    clock = StepClock(bare_step, bare, ours, args.warmup, args.steps)
    trainer._next_batches = timed(trainer._next_batches, ours.times, "data")
    trainer.metrics.log = timed(trainer.metrics.log, ours.times, "loop bookkeeping")
    agreed = timed(stop.agreed, ours.times, "loop bookkeeping")

    def agreed_then_bare() -> bool:
        out = agreed()
        clock.boundary()
        return out

    stop.agreed = agreed_then_bare
    if trainer.validator is not None:
        evaluate = trainer.validator.run

        def timed_evaluation(*a, **kw):
            """One evaluation, timed apart from the steps (its forwards are not the step's)."""
            kept = dict(ours.times)
            dist.barrier()
            start = time.perf_counter()
            out = evaluate(*a, **kw)
            dist.barrier()
            seconds = time.perf_counter() - start
            clock.apart += seconds
            clock.samples["ours"]["eval"].append(seconds)
            ours.times.clear()
            ours.times.update(kept)
            return out

        trainer.validator.run = timed_evaluation
    clock.run_bare()
    clock.start_ours()
    trainer.fit()
    held.close()
    if rank == 0:
        with open(trainer.metrics.history_path) as f:
            ours_first = json.loads(f.readline())["loss/clm"]
        print(f"first step loss: bare {clock.first_loss['bare']:.4f}", flush=True)
        print(f"first step loss: ours {ours_first:.4f}", flush=True)
        report(args, shape, world, clock.samples)


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
    from pipeline.train.deepspeed_ops import use_install_ops_dir

    use_install_ops_dir()  # DeepSpeed's ops, this process's and its children's, in this install's folder
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
    args, argv = parser.parse_args(), sys.argv[1:]
    if "LOCAL_RANK" not in os.environ:
        at = next((i for i, a in enumerate(argv) if a.split("=")[0] == "--nproc"), None)
        return relaunch(args.nproc, argv if at is None else argv[:at] + argv[at + 1 + ("=" not in argv[at]):])
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
