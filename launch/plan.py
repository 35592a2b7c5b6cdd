"""Plan a run before asking for a cluster:
``python launch/plan.py --model 7b --nodes 4 --gpus-per-node 8 --gpu h100 [--zero 3] [--offload] [--seq-len N]
[--micro-batch N] [--lm-head-chunk N] [--tokens-per-step N] [--steps N] [--corpus-tokens N] [--grid GRID]``.

Prints the memory per GPU (model states as DeepSpeed's estimators count them, activations, a runtime reserve), the
step time and tokens per day at a stated MFU, the days for the whole run or a grid of runs, and the data prep's
core-hours, shard count and disk for a corpus. How each number is made: pipeline/plan.py and docs/planning.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _count(text: str) -> int:
    """1e11, 100B, 2.36M or 2359296."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    try:
        return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(float(text))
    except (ValueError, IndexError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 1e11, 100B, 2.36M)") from e


def main(argv: list[str] | None = None) -> int:
    from pipeline.plan import GPUS, PREP_TOKENS_PER_CORE_S
    from pipeline.train.experiment import ModelConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset: tiny, 210m, 610m, 1b, 7b, 8b")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu", required=True, choices=sorted(GPUS))
    p.add_argument("--zero", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage (default 3)")
    p.add_argument("--offload", action="store_true", help="ZeRO-3: parameters and optimizer in CPU memory "
                   "(ds_configs/zero3_offload.json); ZeRO-1/2: the optimizer")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=12, help="samples per GPU per micro-step (default 12)")
    p.add_argument("--tokens-per-step", type=_count, default=1152 * 2048,
                   help="global batch in tokens (default 1152 x 2048, the MLM-vs-CLM study's)")
    p.add_argument("--steps", type=_count, default=42000, help="optimizer steps of the run (default 42000)")
    p.add_argument("--targets", type=float, default=1.0,
                   help="share of tokens through the LM head: 1 for CLM (default), the masking ratio for MLM")
    p.add_argument("--lm-head-chunk", type=int, default=ModelConfig.lm_head_chunk,
                   help=f"target rows per chunk of the LM head loss (model.lm_head_chunk, default "
                        f"{ModelConfig.lm_head_chunk}); 0: the unchunked head")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing (model.activation_checkpointing)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default: Llama-3's 128256)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation to assume (default 0.4)")
    p.add_argument("--reserve-gib", type=float, default=4.0,
                   help="GPU memory for the CUDA context, NCCL and DeepSpeed's buckets (default 4)")
    p.add_argument("--grid", help="a grid file: GPU-hours and days of each run on this cluster")
    p.add_argument("--corpus-tokens", type=_count, help="data prep for a corpus of this many tokens")
    p.add_argument("--prep-rate", type=float, default=PREP_TOKENS_PER_CORE_S,
                   help=f"build_shards tokens per core-second (default {PREP_TOKENS_PER_CORE_S:.3g}, BENCHMARKS.md)")
    p.add_argument("--samples-per-shard", type=int, default=4096)
    args = p.parse_args(argv)
    for name in ("nodes", "gpus_per_node", "seq_len", "micro_batch", "tokens_per_step", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.mfu <= 1 or not 0 < args.targets <= 1:
        p.error("--mfu and --targets must be in (0, 1]")
    try:
        print(report(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def report(args) -> str:
    from pipeline.model.flops import param_counts
    from pipeline.model.presets import get_preset
    from pipeline.plan import (
        GIB,
        GPUS,
        Cluster,
        activation_bytes,
        data_prep,
        largest_layer_params,
        model_states,
        throughput,
    )

    config = get_preset(args.model).to_config(args.vocab)
    cluster = Cluster(args.nodes, args.gpus_per_node, GPUS[args.gpu])
    n, params, largest = cluster.gpus, param_counts(config).total, largest_layer_params(config)
    states = model_states(params, largest, args.zero, args.offload, args.nodes, args.gpus_per_node)
    tokens = args.micro_batch * args.seq_len
    acts = activation_bytes(config, tokens, args.targets, args.checkpointing, args.lm_head_chunk)
    accum = math.ceil(args.tokens_per_step / (tokens * n))
    step_tokens = accum * tokens * n
    total = states.gpu + sum(acts.values()) + args.reserve_gib * GIB
    gib = cluster.gpu.memory_gib
    shard = f"a 1/{n} shard" if args.zero == 3 else "all"
    head = "all tokens" if args.targets == 1 else f"{args.targets:g} of the tokens"
    lines = [
        f"model {args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, FFN "
        f"{config.intermediate_size}, {config.num_attention_heads}/{config.num_key_value_heads} heads, vocab "
        f"{config.vocab_size}: {params / 1e9:.2f} B parameters (largest layer {largest / 1e6:.1f} M)",
        f"cluster: {args.nodes} nodes x {args.gpus_per_node} {args.gpu} ({gib:g} GiB, {cluster.gpu.peak_tflops:g} "
        f"TFLOP/s bf16 dense) = {n} GPUs; ZeRO-{args.zero}" + (", offload" if args.offload else ""),
        "",
        f"memory per GPU, micro-batch {args.micro_batch} x {args.seq_len} tokens" +
        (", activation checkpointing" if args.checkpointing else "") + ":",
        *(f"  {label:<58}{value / GIB:9.2f} GiB" for label, value in (
            (f"16-bit weights ({shard})", states.params16),
            (f"16-bit gradients ({'all' if args.zero == 1 else f'a 1/{n} partition'})", states.grads16),
            (f"fp32 gradients (a 1/{n} partition)", states.grads32),
            (f"fp32 master weights (a 1/{n} partition)", states.master32),
            (f"Adam moments (a 1/{n} partition)", states.adam),
            ("largest layer gathered (ZeRO-3, 4 B/param)", states.gathered)) if value),
        f"  {'= model states (DeepSpeed estimator)':<58}{states.gpu / GIB:9.2f} GiB",
        f"  {f'activations: {config.num_hidden_layers} layers':<58}{acts['layers'] / GIB:9.2f} GiB",
        f"  {f'activations: LM head ({head})':<58}{acts['lm_head'] / GIB:9.2f} GiB",
        f"  {'runtime reserve (CUDA context, NCCL, DeepSpeed buckets)':<58}{args.reserve_gib:9.2f} GiB",
        f"  {'= total':<58}{total / GIB:9.2f} GiB of {gib:g}: " + (
            "fits" if total <= gib * GIB else
            "DOES NOT FIT: try --checkpointing, a smaller --micro-batch, more GPUs or --offload"),
        f"  CPU memory per node (DeepSpeed estimator): {states.cpu_per_node / GIB:.1f} GiB",
        "",
    ]
    speed = throughput(config, args.seq_len, args.targets, step_tokens, cluster, args.mfu)
    days = args.steps * speed.step_s / 86400
    lines += [
        f"throughput at {args.mfu:.0%} MFU:",
        f"  {speed.flops_per_token / 1e9:.2f} GFLOP per token (6 N + attention, LM head on {head})",
        f"  {step_tokens:,} tokens per step = {n} GPUs x {args.micro_batch} x {args.seq_len} x {accum} accumulation"
        + ("" if step_tokens == args.tokens_per_step else f" (asked {args.tokens_per_step:,}, rounded up)"),
        f"  step {speed.step_s:.2f} s, {speed.tokens_per_day / 1e9:.2f} B tokens/day",
        f"  {args.steps:,} steps ({args.steps * step_tokens / 1e9:.1f} B tokens): {days:.2f} days, "
        f"{days * 24 * n:,.0f} GPU-hours",
    ]
    if args.grid:
        lines += ["", *grid_report(args, cluster)]
    if args.corpus_tokens:
        prep = data_prep(args.corpus_tokens, args.seq_len, args.samples_per_shard, args.prep_rate)
        lines += [
            "",
            f"data prep of {args.corpus_tokens / 1e9:g} B tokens at seq-len {args.seq_len}:",
            f"  {prep.samples:,} samples in {prep.shards:,} shards of {args.samples_per_shard} samples, "
            f"{prep.disk_bytes / 1e12:.2f} TB",
            f"  {prep.core_hours:,.0f} core-hours at {args.prep_rate / 1e6:.2f} M tokens per core-second "
            f"({prep.core_hours * 60 / (64 * 16):.0f} min as a 64-task x 16-core array)",
        ]
    return "\n".join(lines)


def grid_report(args, cluster) -> list[str]:
    from pipeline.grid import load_grid
    from pipeline.plan import gpu_hours, run_flops

    lines = [f"grid {args.grid} at {args.mfu:.0%} MFU on {cluster.gpus} {args.gpu}:",
             f"  {'run':<26}{'tokens':>10}{'GPU-hours':>12}{'days':>8}"]
    total = 0.0
    for v in load_grid(args.grid).variants():
        t = v.experiment.train
        step_tokens = t.micro_batch * t.grad_accum * v.resources.world_size * v.experiment.data.seq_len
        hours = gpu_hours(run_flops(v.experiment, step_tokens, args.vocab), cluster.gpu, args.mfu)
        total += hours
        lines.append(f"  {v.name:<26}{t.steps * step_tokens / 1e9:>9.1f}B{hours:>12,.0f}"
                     f"{hours / cluster.gpus / 24:>8.2f}")
    lines.append(f"  {'total':<26}{'':>10}{total:>12,.0f}{total / cluster.gpus / 24:>8.1f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
