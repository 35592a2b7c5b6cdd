"""The cluster planner's estimates before a run: memory per GPU, step time and tokens/day at a stated MFU, days
for a grid, and the data prep's core-hours, shard count and disk for a corpus.

Model states (weights, gradients, optimizer) follow DeepSpeed's own estimators byte for byte
(``estimate_zero3_model_states_mem_needs`` and ``estimate_zero2_model_states_mem_needs``; tests compare them),
split as DeepSpeed's own comment splits its 18 bytes/param: 2 B 16-bit weights, 2 B 16-bit gradients (ZeRO-2), 4 B
fp32 gradients, 4 B fp32 master weights, 8 B Adam moments; ZeRO-3 partitions the weights and counts 18 B/param in
all plus the largest layer gathered whole (4 B/param). ZeRO-1 has no DeepSpeed estimator; the trainer's bf16 ZeRO-1
is DeepSpeed's BF16 optimizer (fp32 gradient accumulation, ``pipeline/train/ds_config.py``), which keeps an fp32
gradient buffer of the whole model beside the bf16 weights and partitions the master weights and moments:
2 + 4 + 12 / N B/param (``BF16_Optimizer.__init__``). With offload it is ZeRO-2 with unpartitioned 16-bit gradients.

Activations are what autograd keeps for the backward pass of one micro-batch of an HF Llama in bf16 with SDPA
(flash / memory-efficient kernels keep no L x L matrix), per token and layer: 20 h + 4 kv + 8 f + 4 heads + 8
bytes (h hidden, kv = KV heads x head dim, f FFN), plus 6 h for the final norm; measured with saved-tensor hooks in
tests. With activation checkpointing a layer keeps only its input (2 h) and one layer is recomputed at a time;
selective checkpointing keeps its input and the kept ops' outputs (``pipeline.model.checkpointing``: 8 h + 2 kv + 2 f
+ 4 heads, measured on its policy in tests) and also recomputes one layer at a time. The
LM head runs on target tokens only: 10 B per target and vocabulary entry at its peak (bf16 logits, their fp32
copy and the fp32 log-softmax kept for the backward). The trainer's chunked head (``model.lm_head_chunk``,
``pipeline/model/lm_head.py``) holds that for one chunk of targets at a time, plus the weight gradient it makes in
the forward (an fp32 accumulator and its bf16 copy: 6 B per vocabulary entry and hidden unit) and the targets'
bf16 input gradient (2 h per target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from pipeline.model.checkpointing import SELECTIVE, selective_layer_bytes
from pipeline.model.flops import PEAK_TFLOPS, flops_per_token
from pipeline.model.moe import num_experts
from pipeline.model.presets import PRESETS, get_preset
from pipeline.objectives import OBJECTIVES

GIB = 2**30
# Shard bytes: 10 per token (int32 ids, uint16 mask ranks, uint32 mask draws) + 5 120 per sample (tar headers and
# padding of its five members, document segments, MAGNET spans); fit to the sample corpus built at seq-len 2048
# and 4096 (tests check it on fresh shards).
SHARD_BYTES_PER_TOKEN, SHARD_BYTES_PER_SAMPLE = 10, 5120
# build_shards throughput in tokens per CPU-second (BENCHMARKS.md "Data prep": the whole job with the shipped
# sentencepiece tokenizer; HF BPE tokenizers run at ~0.5 M, see there)
PREP_TOKENS_PER_CORE_S = 1.13e6


@dataclass(frozen=True)
class Gpu:
    peak_tflops: float  # dense bf16
    memory_gib: float


GPUS = {"h100": Gpu(PEAK_TFLOPS["H100"], 80), "h200": Gpu(PEAK_TFLOPS["H200"], 141),
        "a100": Gpu(PEAK_TFLOPS["A100"], 80), "a100-40": Gpu(PEAK_TFLOPS["A100"], 40),
        "mi250x": Gpu(PEAK_TFLOPS["MI250X"], 128), "mi300x": Gpu(PEAK_TFLOPS["MI300X"], 192),
        "l40s": Gpu(PEAK_TFLOPS["L40S"], 48)}


def gpu_key(device_name: str, memory_gib: float) -> str | None:
    """The key of :data:`GPUS` of a device as torch names it (``NVIDIA H200``, 139 GiB visible), or None."""
    name = device_name.upper().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):  # l40s before l4-like prefixes, a100-40 before a100
        model = key.split("-")[0].upper()
        if model in name and (not key.endswith("-40") or memory_gib < 60):
            return key
    return None


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: Gpu

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU (and per node in CPU memory) for weights, gradients and optimizer states."""

    params16: float  # 16-bit weights (a 1/N shard under ZeRO-3)
    grads16: float  # 16-bit gradients (a 1/N partition under ZeRO-2, all of them under ZeRO-1)
    grads32: float  # fp32 gradient partition
    master32: float  # fp32 master weight partition
    adam: float  # exp_avg + exp_avg_sq partitions
    gathered: float  # ZeRO-3: the largest layer gathered whole
    cpu_per_node: float  # CPU memory DeepSpeed's estimator asks for (offloaded states, zero.Init buffers)

    @property
    def gpu(self) -> float:
        return self.params16 + self.grads16 + self.grads32 + self.master32 + self.adam + self.gathered


def largest_layer_params(config: PretrainedConfig) -> int:
    """The most parameters one module holds directly: the embedding or LM head (vocab x hidden), or the largest
    projection, or a Mixtral layer's experts (one module holds their gate, up and down: experts x 3 FFN x
    hidden); DeepSpeed's ``model_to_params`` measures the same on a built model."""
    h, f = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    return max(config.vocab_size * h, h * f, h * config.num_attention_heads * head_dim, num_experts(config) * 3 * f * h)


def model_states(params: int, largest_layer: int, zero: int, offload: bool, nodes: int,
                 gpus_per_node: int, buffer_factor: float = 1.5, trainable: int | None = None) -> ModelStates:
    """DeepSpeed's accounting (``zero_init`` on, as the trainer builds under zero.Init). ``offload``: ZeRO-3 puts
    parameters and optimizer states in CPU memory, ZeRO-1/2 the optimizer states. ``trainable`` (default: all
    ``params``; a LoRA run's adapter) is what has gradients, master weights and moments."""
    if zero not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {zero}")
    n = nodes * gpus_per_node
    t = params if trainable is None else trainable
    if zero == 3:
        gathered = 4 * largest_layer
        if offload:  # everything in CPU memory
            return ModelStates(0, 0, 0, 0, 0, gathered, (2 * params + 16 * t) / nodes * buffer_factor)
        cpu = largest_layer * 4 * gpus_per_node * buffer_factor
        return ModelStates(2 * params / n, 0, 4 * t / n, 4 * t / n, 8 * t / n, gathered, cpu)
    if offload:  # the optimizer (fp32 gradients, master weights, moments) in CPU memory
        return ModelStates(2 * params, 2 * t if zero == 1 else 0, 0, 0, 0, 0, t * max(4 * n, 16) * buffer_factor)
    if zero == 1:
        return ModelStates(2 * params, 0, 4 * t, 4 * t / n, 8 * t / n, 0, params * 4 * gpus_per_node * buffer_factor)
    return ModelStates(2 * params, 2 * t / n, 4 * t / n, 4 * t / n, 8 * t / n, 0, params * 4 * gpus_per_node * buffer_factor)


def layer_activation_bytes(config: PretrainedConfig) -> int:
    """Bytes autograd keeps per token for one decoder layer (bf16, SDPA without an L x L matrix)."""
    h, f, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    return 20 * h + 4 * config.num_key_value_heads * head_dim + 8 * f + 4 * heads + 8


def lm_head_bytes(config: PretrainedConfig, targets: float, chunk: int) -> float:
    """Peak bytes of the LM head loss over ``targets`` rows; ``chunk`` is ``model.lm_head_chunk`` (0: unchunked).
    Up to one chunk of targets the trainer runs the plain head."""
    v, h = config.vocab_size, config.hidden_size
    if chunk == 0 or targets <= chunk:
        return targets * v * 10
    return chunk * v * 10 + 6 * v * h + 2 * targets * h


CHECKPOINTING = ("none", "full", SELECTIVE)  # the planner's names of model.activation_checkpointing false/true/selective


def activation_bytes(config: PretrainedConfig, tokens: int, head_fraction: float, checkpointing: str,
                     head_chunk: int = 0) -> dict:
    """Activation memory of one micro-batch of ``tokens`` tokens, by part; ``checkpointing`` one of
    :data:`CHECKPOINTING`."""
    layer = layer_activation_bytes(config)
    h, layers = config.hidden_size, config.num_hidden_layers
    kept = {"none": layer, "full": 2 * h, SELECTIVE: selective_layer_bytes(config)}[checkpointing]
    body = tokens * (layers * kept + (0 if checkpointing == "none" else layer))
    return {"layers": body + tokens * 6 * h, "lm_head": lm_head_bytes(config, head_fraction * tokens, head_chunk)}


# The planner's expected step time of a memory-saving change, against the same run without it (docs/planning.md;
# assumptions, not measured here): full checkpointing runs each layer's forward twice (3 passes become 4);
# selective recomputes the non-matmul ops its policy drops (~10 %, BENCHMARKS.md); offload moves states over each
# GPU's host link (PCIe 4.0 x16 in practice) and steps Adam on the node's CPUs (DeepSpeed's CPU Adam).
RECOMPUTE = {"none": 1.0, SELECTIVE: 1.1, "full": 4 / 3}
PCIE_BYTES_S = 25e9
CPU_ADAM_PARAMS_S = 1e9


def offload_seconds(params: int, trainable: int, micro_steps: int, nodes: int, gpus_per_node: int) -> float:
    """Seconds ZeRO-3 offload adds to an optimizer step, counted without overlap: every micro-step each GPU copies
    its 1/N of the 16-bit weights in for the forward and again for the backward and its 1/N of the 16-bit
    gradients out; every step the updated weights come back in, and each node's CPU Adam steps its share."""
    n = nodes * gpus_per_node
    moved = micro_steps * (2 * 2 * params + 2 * trainable) + 2 * params
    return moved / n / PCIE_BYTES_S + trainable / nodes / CPU_ADAM_PARAMS_S


@dataclass(frozen=True)
class Throughput:
    flops_per_token: float
    tokens_per_step: int
    step_s: float

    @property
    def tokens_per_day(self) -> float:
        return self.tokens_per_step / self.step_s * 86400


def throughput(config: PretrainedConfig, seq_len: int, head_fraction: float, tokens_per_step: int,
               cluster: Cluster, mfu: float) -> Throughput:
    fpt = flops_per_token(config, seq_len, head_fraction)
    return Throughput(fpt, tokens_per_step, fpt * tokens_per_step / (cluster.gpus * cluster.gpu.peak_tflops * 1e12 * mfu))


def gpu_hours(flops: float, gpu: Gpu, mfu: float) -> float:
    return flops / (gpu.peak_tflops * 1e12 * mfu) / 3600


@dataclass(frozen=True)
class DataPrep:
    core_hours: float
    samples: int
    shards: int
    disk_bytes: float


def data_prep(corpus_tokens: float, seq_len: int, samples_per_shard: int = 4096,
              tokens_per_core_s: float = PREP_TOKENS_PER_CORE_S) -> DataPrep:
    samples = int(corpus_tokens // seq_len)
    return DataPrep(core_hours=corpus_tokens / tokens_per_core_s / 3600, samples=samples,
                    shards=math.ceil(samples / samples_per_shard),
                    disk_bytes=corpus_tokens * SHARD_BYTES_PER_TOKEN + samples * SHARD_BYTES_PER_SAMPLE)


def phase_steps(exp, world: int) -> list[tuple]:
    """(``PhaseData``, optimizer steps, tokens per step) of each phase of the experiment ``exp`` on ``world``
    ranks: a context-extension phase has its own sequence length and micro-batch."""
    out = []
    for i, steps in enumerate(exp.phase_lengths()):
        data = exp.phase_data(i)
        out.append((data, steps, exp.train.global_batch(world, data.micro_batch) * data.seq_len))
    return out


def run_flops(exp, world: int, vocab_size: int) -> float:
    """Training FLOPs of a whole run of the experiment ``exp`` on ``world`` ranks, phase by phase at each phase's
    sequence length and tokens per step (the LM head on all tokens for CLM, on the masking ratio for MLM); the
    model is ``model.shape``, else the preset in ``model.init``."""
    preset = exp.model.shape or exp.model.init
    if preset not in PRESETS:
        raise ValueError(f"{exp.name}: model.init {exp.model.init!r} is no preset and model.shape is not set; "
                         "the planner needs the model's size")
    config = get_preset(preset).to_config(vocab_size)
    total = 0.0
    for phase, (data, steps, tokens) in zip(exp.phases, phase_steps(exp, world)):
        for o in phase.objectives:  # each objective runs its own forward and backward over the batch
            head = o.mean_ratio(steps) if OBJECTIVES[o.name].masks else 1.0
            total += steps * tokens * flops_per_token(config, data.seq_len, head)
    return total
