"""The cluster planner's report and command line:
``python launch/plan.py --model 7b [--nodes 1] --gpus-per-node 8 --gpu h100 [--zero 1|2|3] [--offload] [--seq-len N]
[--micro-batch N] [--lm-head-chunk N] [--checkpointing [full|selective]] [--tokens-per-step N] [--steps N]
[--corpus-tokens N] [--grid GRID]
[--mixture SOURCE=RATIO,... [--shards DIR] [--max-repetition R]]`` (or ``pipeline-plan ...``).

Prints the ZeRO stage and shipped DeepSpeed JSON to train with (the least sharding that fits, unless --zero says),
the memory per GPU (model states as DeepSpeed's estimators count them, activations, a runtime reserve) with the
verdict whether it fits ("try it" under 10 % headroom; when it does not, the cheapest combination of the changes it
knows that fits, with its CPU memory and step time: :func:`fixes`), the CPU memory per
node and what it holds, the step time and tokens per day at a stated MFU, the days for the whole run or a grid
of runs, the tokens of each source of a mixture (against a shard directory's), the data prep's core-hours,
shard count and disk for a corpus, and the ``--set`` flags and command that train the run priced; the settings left
at the MLM-vs-CLM study's defaults are marked. How each number is made:
pipeline/planner/estimates.py and docs/planning.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from pipeline.data.format.index import load_index
from pipeline.data.loading.mixture import MixturePlan
from pipeline.experiment import ModelConfig
from pipeline.grid import load_grid
from pipeline.model.flops import param_counts
from pipeline.model.lora import LLM2VEC_TARGETS, lora_params
from pipeline.model.presets import PRESETS, get_preset
from pipeline.planner.estimates import (
    CHECKPOINTING,
    GIB,
    GPUS,
    PREP_TOKENS_PER_CORE_S,
    RECOMPUTE,
    Cluster,
    ModelStates,
    activation_bytes,
    data_prep,
    gpu_hours,
    gpu_key,
    largest_layer_params,
    model_states,
    offload_seconds,
    phase_steps,
    run_flops,
    throughput,
)


@dataclass(frozen=True)
class PlannerInput:
    """What the planner is asked about: a model preset on a cluster, with its batch, run length and corpus."""

    model: str  # a preset (pipeline.model.presets.PRESETS)
    nodes: int
    gpus_per_node: int
    gpu: str  # a key of GPUS
    zero: int | None = None  # None: the least sharding that fits (least_sharding)
    offload: bool = False
    seq_len: int = 2048
    micro_batch: int = 12
    tokens_per_step: int = 1152 * 2048  # the MLM-vs-CLM study's global batch
    steps: int = 42000
    targets: float = 1.0  # share of tokens through the LM head: 1 for CLM, the masking ratio for MLM
    lm_head_chunk: int = ModelConfig.lm_head_chunk
    checkpointing: str = "none"  # CHECKPOINTING: none, full (model.activation_checkpointing true) or selective
    lora_r: int = 0  # LoRA adapters of this rank on every projection (model.lora); 0: full-parameter training
    vocab: int = 128256  # Llama-3's
    mfu: float = 0.4
    reserve_gib: float = 4.0  # CUDA context, NCCL, DeepSpeed's buckets
    grid: str | None = None  # a grid file: GPU-hours and days of each run
    corpus_tokens: int | None = None  # data prep for a corpus of this many tokens
    prep_rate: float = PREP_TOKENS_PER_CORE_S
    samples_per_shard: int = 4096
    mixture: dict[str, float] | None = None  # source -> target ratio: the run's tokens per source
    max_repetition: float = 1.0  # with shards: the most times over a source's samples may be read
    shards: str | None = None  # a shard directory: its samples per source against the mixture's needs

    def validate(self) -> None:
        """Raise ValueError naming the option (as the command line spells it) that is out of range."""
        for name in ("nodes", "gpus_per_node", "seq_len", "micro_batch", "tokens_per_step", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.lora_r < 0:
            raise ValueError("--lora-r must be >= 0")
        if not 0 < self.mfu <= 1 or not 0 < self.targets <= 1:
            raise ValueError("--mfu and --targets must be in (0, 1]")
        if self.gpu not in GPUS:
            raise ValueError(f"--gpu {self.gpu!r}: choose one of {sorted(GPUS)}")
        if self.mixture is not None and not math.isclose(sum(self.mixture.values()), 1.0, abs_tol=1e-6):
            raise ValueError(f"--mixture: ratios must sum to 1, got {sum(self.mixture.values()):.6g}")
        if self.shards and not self.mixture:
            raise ValueError("--shards: the planner reads a shard directory to check a --mixture against it")


# The shipped DeepSpeed JSON of each (ZeRO stage, offload)
DS_CONFIGS = {(1, False): "ds_configs/zero1.json", (2, False): "ds_configs/zero2.json",
              (3, False): "ds_configs/zero3.json", (3, True): "ds_configs/zero3_offload.json"}


def least_sharding(fits, offload: bool) -> int:
    """The ZeRO stage to train with when none is asked: the lowest whose memory ``fits(stage)``, else 3 (also with
    offload, whose shipped JSON is ZeRO-3's). Below ZeRO-3 a step gathers no weights (no per-module hooks, no
    all-gather in the forward and backward), and one GPU has nothing to shard: ZeRO-1 (DeepSpeed's BF16 optimizer)
    keeps the whole fp32 gradient, ZeRO-2 a 1/N partition of it."""
    return next((zero for zero in (1, 2) if not offload and fits(zero)), 3)


THIN_HEADROOM = 0.10  # docs/planning.md: treat "fits" with less headroom as "try it"


@dataclass(frozen=True)
class Memory:
    """Memory per GPU of a plan at its ZeRO stage (``zero``: the one asked, else :func:`least_sharding`'s)."""

    zero: int
    states: ModelStates
    acts: dict[str, float]
    total: float  # bytes per GPU
    capacity: float  # the GPU's bytes

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def headroom(self) -> float:
        return 1 - self.total / self.capacity

    def verdict(self) -> str:
        """fits, "try it" under :data:`THIN_HEADROOM` of headroom, or DOES NOT FIT."""
        if not self.fits:
            return "DOES NOT FIT"
        if self.headroom < THIN_HEADROOM:
            return f"try it: fits with only {self.headroom:.0%} headroom (under ~10 % the unknowns can eat it)"
        return f"fits ({self.headroom:.0%} headroom)"


@functools.lru_cache(maxsize=8)
def model_counts(model: str, vocab: int, lora_r: int) -> tuple[PretrainedConfig, int, int, int]:
    """(config, parameters, largest layer's parameters, trainable parameters) of a preset: asked once per report,
    however many plans :func:`fixes` tries."""
    config = get_preset(model).to_config(vocab)
    params = param_counts(config).total
    return (config, params, largest_layer_params(config),
            lora_params(config, lora_r, LLM2VEC_TARGETS) if lora_r else params)


def memory(plan: PlannerInput) -> Memory:
    """The plan's memory per GPU: model states as DeepSpeed's estimators count them, activations, the reserve."""
    config, params, largest, trainable = model_counts(plan.model, plan.vocab, plan.lora_r)
    cluster = Cluster(plan.nodes, plan.gpus_per_node, GPUS[plan.gpu])
    acts = activation_bytes(config, plan.micro_batch * plan.seq_len, plan.targets, plan.checkpointing,
                            plan.lm_head_chunk)
    capacity = cluster.gpu.memory_gib * GIB

    def of(zero: int) -> Memory:
        states = model_states(params, largest, zero, plan.offload, plan.nodes, plan.gpus_per_node,
                              trainable=trainable)
        return Memory(zero, states, acts, states.gpu + sum(acts.values()) + plan.reserve_gib * GIB, capacity)

    return of(plan.zero or least_sharding(lambda z: of(z).fits, plan.offload))


@dataclass(frozen=True)
class Option:
    """A change of the plan that fits: its flags (as the command line takes them), the plan, its memory and its
    expected step time (:func:`step_seconds`)."""

    flags: str
    plan: PlannerInput
    memory: Memory
    step_s: float


SAVING = ("none", "selective", "full")  # activation checkpointing, from the most activation memory to the least
LORA_R = 16  # the adapter rank the search tries (LLM2Vec's)


def step_seconds(plan: PlannerInput) -> float:
    """The plan's expected step time: its FLOPs at its MFU, with the recompute of its checkpointing and, offloaded,
    the transfers and CPU Adam of :func:`~pipeline.planner.estimates.offload_seconds`."""
    config, params, _, trainable = model_counts(plan.model, plan.vocab, plan.lora_r)
    cluster = Cluster(plan.nodes, plan.gpus_per_node, GPUS[plan.gpu])
    tokens = accumulation(plan) * plan.micro_batch * plan.seq_len * cluster.gpus
    compute = throughput(config, plan.seq_len, plan.targets, tokens, cluster, plan.mfu).step_s
    moved = offload_seconds(params, trainable, accumulation(plan), plan.nodes, plan.gpus_per_node) if plan.offload \
        else 0.0
    return compute * RECOMPUTE[plan.checkpointing] + moved


def flags_of(plan: PlannerInput, changed: PlannerInput) -> str:
    """The command-line flags that turn ``plan`` into ``changed``."""
    flags = []
    if changed.gpu != plan.gpu:
        flags.append(f"--gpu {changed.gpu}")
    if changed.nodes != plan.nodes:
        flags.append(f"--nodes {changed.nodes}")
    if changed.checkpointing != plan.checkpointing:
        flags.append("--checkpointing" + ("" if changed.checkpointing == "full" else f" {changed.checkpointing}"))
    if changed.zero != plan.zero and changed.zero:
        flags.append(f"--zero {changed.zero}")
    if changed.offload != plan.offload:
        flags.append("--offload")
    if changed.micro_batch != plan.micro_batch:
        flags.append(f"--micro-batch {changed.micro_batch}")
    if changed.lora_r != plan.lora_r:
        flags.append(f"--lora-r {changed.lora_r}")
    return " ".join(flags)


def search(plan: PlannerInput) -> list[Option]:
    """Every combination of the changes the planner knows that makes ``plan`` fit on its GPUs, cheapest step first:
    more activation checkpointing, ZeRO-3 (where a lower stage was asked), offload of parameters and optimizer
    (ZeRO-3's shipped JSON), a LoRA adapter of rank :data:`LORA_R` (full-parameter training), each with the
    largest micro-batch up to the plan's that fits."""
    found = []
    for checkpointing, offload, zero, lora_r in itertools.product(
            SAVING[SAVING.index(plan.checkpointing):], {plan.offload, True}, {plan.zero, plan.zero and 3},
            {plan.lora_r, plan.lora_r or LORA_R}):
        base = replace(plan, checkpointing=checkpointing, offload=offload, lora_r=lora_r,
                       zero=(plan.zero and 3) if offload else zero)
        fitting = [m for m in range(plan.micro_batch, 0, -1) if memory(replace(base, micro_batch=m)).fits]
        # the largest micro-batch with the headroom "fits" asks for, else the largest that fits at all ("try it")
        micro = next((m for m in fitting if memory(replace(base, micro_batch=m)).headroom >= THIN_HEADROOM),
                     fitting[0] if fitting else None)
        if micro:
            changed = replace(base, micro_batch=micro)
            found.append(Option(flags_of(plan, changed), changed, memory(changed), step_seconds(changed)))
    return sorted({o.flags: o for o in found}.values(), key=lambda o: (o.step_s, len(o.flags)))  # ZeRO-3 twice


def more_nodes(plan: PlannerInput) -> Option | None:
    """The fewest nodes (up to 64 times the plan's) on which the plan fits as it is: more GPUs shard the states."""
    nodes = next((n for n in range(plan.nodes + 1, 64 * plan.nodes + 1) if memory(replace(plan, nodes=n)).fits), None)
    if nodes is None:
        return None
    changed = replace(plan, nodes=nodes)
    return Option(flags_of(plan, changed), changed, memory(changed), step_seconds(changed))


def fixes(plan: PlannerInput) -> list[Option]:
    """What the verdict of a plan that does not fit offers: the cheapest change that fits on its GPUs among
    full-parameter training (else with a LoRA adapter), and the fewest nodes that fit it as it is; where nothing
    does, the cheapest change on the first GPU with more memory that fits (none: nothing fits any listed GPU)."""
    found = search(plan)
    full = [o for o in found if o.plan.lora_r == plan.lora_r]
    options = [(full or found)[0]] if found else []
    nodes = more_nodes(plan)
    if options or nodes:
        return options + [nodes] * bool(nodes)
    for gpu in sorted((g for g in GPUS if GPUS[g].memory_gib > GPUS[plan.gpu].memory_gib),
                      key=lambda g: GPUS[g].memory_gib):
        bigger = search(replace(plan, gpu=gpu))
        if bigger:
            return [replace(bigger[0], flags=flags_of(plan, bigger[0].plan))]
    return []


def cpu_memory_counted(zero: int, offload: bool, gpus_per_node: int) -> str:
    """What DeepSpeed's estimator counts in a node's CPU memory (``estimates.model_states``), in words."""
    if offload and zero == 3:
        return "the offloaded states: 2 B per parameter weights + 16 B per trainable one, over the nodes, x 1.5"
    if offload:
        return "the offloaded optimizer: max(4 x GPUs, 16) B per trainable parameter, x 1.5"
    if zero == 3:
        return (f"building under zero.Init: the largest layer in fp32 for each of the node's {gpus_per_node} GPUs, "
                f"x 1.5")
    return f"building under zero.Init: every parameter in fp32 for each of the node's {gpus_per_node} GPUs, x 1.5"


DEFAULT = PlannerInput(model="", nodes=1, gpus_per_node=1, gpu="h100")


def _defaults_of(plan: PlannerInput, names: tuple[str, ...]) -> str:
    """" (the default, the MLM-vs-CLM study's; --flag for yours)" naming those of ``names`` at their defaults."""
    flags = [f"--{name.replace('_', '-')}" for name in names if getattr(plan, name) == getattr(DEFAULT, name)]
    if not flags:
        return ""
    return f" ({'the default' if len(flags) == 1 else 'the defaults'}, the MLM-vs-CLM study's; {', '.join(flags)} " \
           f"for yours)"


def accumulation(plan: PlannerInput) -> int:
    """Micro-steps per optimizer step that reach ``plan.tokens_per_step`` (rounded up)."""
    return math.ceil(plan.tokens_per_step / (plan.micro_batch * plan.seq_len * plan.nodes * plan.gpus_per_node))


def run_command(plan: PlannerInput, zero: int, why: str = "") -> list[str]:
    """The ``--set`` flags and the launch that train what the plan prices (``why``: the change it makes)."""
    accum = accumulation(plan)
    ds_config = DS_CONFIGS.get((zero, plan.offload))
    if ds_config is None:
        return [f"to train it: no shipped DeepSpeed JSON for ZeRO-{zero} with offload; write one from "
                f"ds_configs/zero{zero}.json with offload_optimizer"]
    sets = [f"model.init={plan.model}", f"data.seq_len={plan.seq_len}", f"train.micro_batch={plan.micro_batch}",
            f"train.grad_accum={accum}", f"train.steps={plan.steps}"]
    if plan.checkpointing != "none":
        sets.append(f"model.activation_checkpointing={'true' if plan.checkpointing == 'full' else 'selective'}")
    if plan.lm_head_chunk != DEFAULT.lm_head_chunk:
        sets.append(f"model.lm_head_chunk={plan.lm_head_chunk}")
    if plan.lora_r:
        sets.append(f"model.lora.r={plan.lora_r}")
    flags = " ".join(f"--set {s}" for s in sets)
    launch = (f"deepspeed --num_gpus {plan.gpus_per_node} launch/train.py" if plan.nodes == 1 else
              f"sbatch --nodes={plan.nodes} --gpus-per-node={plan.gpus_per_node} launch/slurm/train.sbatch")
    return [f"to train it{why} (add your data, --set data.shards=DIR, and objectives, phases; docs/training.md):",
            f"  --set flags: {flags}",
            f"  {launch} --config {ds_config} {flags}"]


def option_line(plan: PlannerInput, option: Option) -> str:
    """One change that fits: its flags, memory per GPU, CPU memory per node and expected step time against the
    plan as asked."""
    m, p = option.memory, option.plan
    return (f"  {option.flags:<44}{m.total / GIB:7.2f} GiB at ZeRO-{m.zero}{', offload' if p.offload else ''}"
            f"{f' (LoRA r {p.lora_r}: trains an adapter, not every weight)' if p.lora_r != plan.lora_r else ''}; "
            f"CPU memory per node {m.states.cpu_per_node / GIB:.1f} GiB; step {option.step_s / step_seconds(plan):.2f}x "
            f"as long{f' on {p.nodes / plan.nodes:g}x the GPUs' if p.nodes != plan.nodes else ''}: {m.verdict()}")


def verdict_lines(plan: PlannerInput, mem: Memory, found: list[Option]) -> list[str]:
    """The verdict in words: fits, try it, or what to change (``found``, :func:`fixes`) when it does not fit."""
    gib = mem.capacity / GIB
    if mem.fits:
        return [f"verdict: ZeRO-{mem.zero}{', offload' if plan.offload else ''}, {mem.total / GIB:.2f} of {gib:g} "
                f"GiB per GPU: {mem.verdict()}"]
    if not found:
        return [f"verdict: DOES NOT FIT, and does not fit on any listed GPU ({', '.join(sorted(GPUS))}) with any "
                f"combination the planner tries (checkpointing, offload, ZeRO-3, micro-batch down to 1, LoRA r "
                f"{LORA_R}, up to {64 * plan.nodes} nodes); try a shorter --seq-len"]
    where = (f"not on a {plan.gpu} with any change the planner tries; on a bigger GPU" if found[0].plan.gpu != plan.gpu
             else "the cheapest change that fits")
    return [f"verdict: DOES NOT FIT in {gib:g} GiB per GPU at ZeRO-{mem.zero}; {where} (step time against the plan "
            f"as asked: recompute and offload transfers counted, docs/planning.md):",
            *(option_line(plan, o) for o in found)]


def report(plan: PlannerInput) -> str:
    """The planner's report: memory per GPU with its verdict (and what to change when it does not fit),
    throughput, the command that trains it, and the grid and data prep when asked."""
    config, params, largest, trainable = model_counts(plan.model, plan.vocab, plan.lora_r)
    cluster = Cluster(plan.nodes, plan.gpus_per_node, GPUS[plan.gpu])
    n, tokens = cluster.gpus, plan.micro_batch * plan.seq_len
    mem = memory(plan)
    zero, states, acts, total = mem.zero, mem.states, mem.acts, mem.total
    found = [] if mem.fits else fixes(plan)
    accum = accumulation(plan)
    step_tokens = accum * tokens * n
    ds_config = DS_CONFIGS.get((zero, plan.offload))
    chosen = "" if plan.zero else (" (the least sharding that fits; --zero to choose)" if mem.fits else
                                   " (the most sharding; nothing fits: see the verdict)")
    gib = cluster.gpu.memory_gib
    shard = f"a 1/{n} shard" if zero == 3 else "all"
    head = "all tokens" if plan.targets == 1 else f"{plan.targets:g} of the tokens"
    lines = [
        f"model {plan.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, FFN "
        f"{config.intermediate_size}, {config.num_attention_heads}/{config.num_key_value_heads} heads, vocab "
        f"{config.vocab_size}: {params / 1e9:.2f} B parameters (largest layer {largest / 1e6:.1f} M)"
        + (f"; LoRA r {plan.lora_r} on every projection: {trainable / 1e6:.1f} M trainable" if plan.lora_r else ""),
        f"cluster: {plan.nodes} nodes x {plan.gpus_per_node} {plan.gpu} ({gib:g} GiB, {cluster.gpu.peak_tflops:g} "
        f"TFLOP/s bf16 dense) = {n} GPUs; ZeRO-{zero}" + (", offload" if plan.offload else "")
        + (f" ({ds_config})" if ds_config else "") + chosen,
        "",
        f"memory per GPU, micro-batch {plan.micro_batch} x {plan.seq_len} tokens" +
        ("" if plan.checkpointing == "none" else f", {plan.checkpointing} activation checkpointing")
        + _defaults_of(plan, ("micro_batch", "seq_len")) + ":",
        *(f"  {label:<58}{value / GIB:9.2f} GiB" for label, value in (
            (f"16-bit weights ({shard})", states.params16),
            (f"16-bit gradients ({'all' if zero == 1 else f'a 1/{n} partition'})", states.grads16),
            (f"fp32 gradients ({'all' if zero == 1 else f'a 1/{n} partition'})", states.grads32),
            (f"fp32 master weights (a 1/{n} partition)", states.master32),
            (f"Adam moments (a 1/{n} partition)", states.adam),
            ("largest layer gathered (ZeRO-3, 4 B/param)", states.gathered)) if value),
        f"  {'= model states (DeepSpeed estimator)':<58}{states.gpu / GIB:9.2f} GiB",
        f"  {f'activations: {config.num_hidden_layers} layers':<58}{acts['layers'] / GIB:9.2f} GiB",
        f"  {f'activations: LM head ({head})':<58}{acts['lm_head'] / GIB:9.2f} GiB",
        f"  {'runtime reserve (CUDA context, NCCL, DeepSpeed buckets)':<58}{plan.reserve_gib:9.2f} GiB",
        f"  {'= total':<58}{total / GIB:9.2f} GiB of {gib:g}: {mem.verdict()}",
        f"  CPU memory per node: {states.cpu_per_node / GIB:.1f} GiB (DeepSpeed's estimator: "
        f"{cpu_memory_counted(zero, plan.offload, plan.gpus_per_node)})",
        "",
        *verdict_lines(plan, mem, found),
        "",
    ]
    speed = throughput(config, plan.seq_len, plan.targets, step_tokens, cluster, plan.mfu)
    days = plan.steps * speed.step_s / 86400
    lines += [
        f"throughput at {plan.mfu:.0%} MFU" + (" (the default, an assumption; --mfu)" if plan.mfu == DEFAULT.mfu
                                               else "") + ":",
        f"  {speed.flops_per_token / 1e9:.2f} GFLOP per token (6 N + attention, LM head on {head})",
        f"  {step_tokens:,} tokens per step = {n} GPUs x {plan.micro_batch} x {plan.seq_len} x {accum} accumulation"
        + ("" if step_tokens == plan.tokens_per_step else f" (asked {plan.tokens_per_step:,}, rounded up)")
        + _defaults_of(plan, ("tokens_per_step",)),
        f"  step {speed.step_s:.2f} s, {speed.tokens_per_day / 1e9:.2f} B tokens/day",
        f"  {plan.steps:,} steps{_defaults_of(plan, ('steps',))} ({plan.steps * step_tokens / 1e9:.1f} B tokens): "
        f"{days:.2f} days, {days * 24 * n:,.0f} GPU-hours",
        "",
        *(run_command(plan, zero) if mem.fits else
          next((run_command(o.plan, o.memory.zero, f" with {o.flags}, the cheapest change that fits")
                for o in found), [])),
    ]
    if plan.mixture:
        lines += ["", *mixture_report(plan, plan.steps * step_tokens // plan.seq_len)]
    if plan.grid:
        lines += ["", *grid_report(plan, cluster)]
    if plan.corpus_tokens:
        prep = data_prep(plan.corpus_tokens, plan.seq_len, plan.samples_per_shard, plan.prep_rate)
        lines += [
            "",
            f"data prep of {plan.corpus_tokens / 1e9:g} B tokens at seq-len {plan.seq_len}:",
            f"  {prep.samples:,} samples in {prep.shards:,} shards of {plan.samples_per_shard} samples, "
            f"{prep.disk_bytes / 1e12:.2f} TB",
            f"  {prep.core_hours:,.0f} core-hours at {plan.prep_rate / 1e6:.2f} M tokens per core-second "
            f"({prep.core_hours * 60 / (64 * 16):.0f} min as a 64-task x 16-core array)",
        ]
    return "\n".join(lines)


def mixture_report(plan: PlannerInput, samples: int) -> list[str]:
    """Tokens (and samples) of each source of ``plan.mixture`` over the run's ``samples``; with ``plan.shards``,
    what each source holds and how many times over the run reads it (SHORT beyond ``plan.max_repetition``)."""
    counts = MixturePlan.of_ratios(plan.mixture).counts(samples)
    held = load_index(plan.shards).source_counts() if plan.shards else {}
    lines = [f"mixture of {len(counts)} sources over {samples:,} samples of {plan.seq_len} tokens "
             f"({samples * plan.seq_len / 1e9:.2f} B tokens):",
             f"  {'source':<24}{'ratio':>8}{'tokens':>12}{'samples':>14}" + (
                 f"{'it holds':>14}{'reads':>9}" if held else "")]
    for name, n in counts.items():
        line = f"  {name:<24}{plan.mixture[name]:>8.4g}{n * plan.seq_len / 1e9:>11.3f}B{n:>14,}"
        if held:
            have = held.get(name, {}).get("samples", 0)
            times = n / have if have else math.inf
            line += f"{have:>14,}{times:>8.2f}x" + (f"  SHORT: beyond max repetition {plan.max_repetition:g}"
                                                     if times > plan.max_repetition else "")
        lines.append(line)
    return lines


def parse_mixture(text: str) -> dict[str, float]:
    """``A=0.7,B=0.3`` -> {"A": 0.7, "B": 0.3}."""
    try:
        pairs = [item.split("=") for item in text.split(",") if item.strip()]
        return {name.strip(): float(ratio) for name, ratio in pairs}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mixture (e.g. RedPajamaBook=0.7,RedPajamaArXiv=0.3)"
                                         ) from e


def grid_report(plan: PlannerInput, cluster: Cluster) -> list[str]:
    """GPU-hours and days of every run of the grid ``plan.grid`` on ``cluster``, and their total."""
    lines = [f"grid {plan.grid} at {plan.mfu:.0%} MFU on {cluster.gpus} {plan.gpu}:",
             f"  {'run':<26}{'tokens':>10}{'GPU-hours':>12}{'days':>8}"]
    total = 0.0
    for v in load_grid(plan.grid).variants():
        exp, world = v.experiment, v.resources.world_size
        phases = phase_steps(exp, world)
        hours = gpu_hours(run_flops(exp, world, plan.vocab), cluster.gpu, plan.mfu)
        total += hours
        lines.append(f"  {v.name:<26}{sum(s * n for _, s, n in phases) / 1e9:>9.1f}B{hours:>12,.0f}"
                     f"{hours / cluster.gpus / 24:>8.2f}")
        if not all(data.reads_data_shards for data, _, _ in phases):  # context extension: each phase's share
            lines.append("    " + ", ".join(f"{p.name} {s * n / 1e9:.2f}B at seq_len {data.seq_len}"
                                            for p, (data, s, n) in zip(exp.phases, phases)))
        mixture = exp.data.source_mixture
        if mixture:  # data.mixture mixes data.shards, which the phases without shards of their own read
            seq_len = exp.data.seq_len
            counts = MixturePlan.of_ratios(mixture.ratios).counts(
                sum(s * n // seq_len for data, s, n in phases if data.reads_data_shards))
            lines.append("    " + ", ".join(f"{n} {c * seq_len / 1e9:.2f}B" for n, c in counts.items()))
    lines.append(f"  {'total':<26}{'':>10}{total:>12,.0f}{total / cluster.gpus / 24:>8.1f}")
    return lines


def parse_count(text: str) -> int:
    """1e11, 100B, 2.36M or 2359296."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    try:
        return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(float(text))
    except (ValueError, IndexError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 1e11, 100B, 2.36M)") from e


def visible_gpu(parser: argparse.ArgumentParser) -> str:
    """``--gpu``'s default: the GPU this machine shows; with none (or one the planner does not know) the parser's
    error names the choices."""
    import torch

    if not torch.cuda.is_available():
        parser.error(f"--gpu: no GPU is visible here to plan for; name the cluster's: {', '.join(sorted(GPUS))}")
    name = torch.cuda.get_device_name()
    key = gpu_key(name, torch.cuda.get_device_properties(0).total_memory / 2**30)
    if key is None:
        parser.error(f"--gpu: the visible GPU ({name}) is not one the planner knows; name the nearest: "
                     f"{', '.join(sorted(GPUS))}")
    return key


def main(argv: list[str] | None = None) -> int:
    d = DEFAULT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a preset: {', '.join(PRESETS)} (docs/models.md)")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"default {d.nodes}, as --check's")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu", choices=sorted(GPUS), help="the cluster's GPU (default: the GPU visible here)")
    p.add_argument("--zero", type=int, default=d.zero, choices=[1, 2, 3],
                   help="ZeRO stage (default: the least sharding that fits, ZeRO-1 before 2 before 3)")
    p.add_argument("--offload", action="store_true", help="ZeRO-3: parameters and optimizer in CPU memory "
                   "(ds_configs/zero3_offload.json); ZeRO-1/2: the optimizer")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help=f"samples per GPU per micro-step (default {d.micro_batch})")
    p.add_argument("--tokens-per-step", type=parse_count, default=d.tokens_per_step,
                   help="global batch in tokens (default 1152 x 2048, the MLM-vs-CLM study's)")
    p.add_argument("--steps", type=parse_count, default=d.steps, help=f"optimizer steps of the run (default {d.steps})")
    p.add_argument("--targets", type=float, default=d.targets,
                   help="share of tokens through the LM head: 1 for CLM (default), the masking ratio for MLM")
    p.add_argument("--lm-head-chunk", type=int, default=d.lm_head_chunk,
                   help=f"target rows per chunk of the LM head loss (model.lm_head_chunk, default "
                        f"{d.lm_head_chunk}); 0: the unchunked head")
    p.add_argument("--checkpointing", nargs="?", const="full", default=d.checkpointing, choices=CHECKPOINTING,
                   help="activation checkpointing (model.activation_checkpointing): full (the default of the bare "
                        "flag: true) or selective")
    p.add_argument("--lora-r", type=int, default=d.lora_r,
                   help="LoRA rank on every projection (model.lora.r): gradients and optimizer states of the adapter "
                        "only (default 0: full-parameter training)")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default: Llama-3's {d.vocab})")
    p.add_argument("--mfu", type=float, default=d.mfu, help=f"model FLOPs utilisation to assume (default {d.mfu})")
    p.add_argument("--reserve-gib", type=float, default=d.reserve_gib,
                   help=f"GPU memory for the CUDA context, NCCL and DeepSpeed's buckets (default {d.reserve_gib:g})")
    p.add_argument("--grid", help="a grid file: GPU-hours and days of each run on this cluster")
    p.add_argument("--corpus-tokens", type=parse_count, help="data prep for a corpus of this many tokens")
    p.add_argument("--prep-rate", type=float, default=d.prep_rate,
                   help=f"build_shards tokens per core-second (default {d.prep_rate:.3g}, BENCHMARKS.md)")
    p.add_argument("--samples-per-shard", type=int, default=d.samples_per_shard)
    p.add_argument("--mixture", type=parse_mixture, metavar="SOURCE=RATIO,...",
                   help="the run's source mixture (data.mixture): tokens of each source over the run")
    p.add_argument("--shards", help="with --mixture: a shard directory, whose samples per source the run's needs "
                                    "are checked against")
    p.add_argument("--max-repetition", type=float, default=d.max_repetition,
                   help="with --shards: times over a source's samples may be read (data.mixture_max_repetition)")
    args = p.parse_args(argv)
    args.gpu = args.gpu or visible_gpu(p)
    plan = PlannerInput(**vars(args))
    try:
        plan.validate()
    except ValueError as e:
        p.error(str(e))
    try:
        print(report(plan))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
