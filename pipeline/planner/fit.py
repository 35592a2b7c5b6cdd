"""The planner's memory estimate of one experiment as ``launch/train.py`` would run it (``--check``): the model its
``model.init`` builds, the ZeRO stage and offload of its DeepSpeed JSON, its largest micro-batch in tokens, its
activation checkpointing, LM-head chunk and LoRA rank, on a cluster's GPUs. The numbers are
:mod:`pipeline.planner.estimates`' (docs/planning.md); where the experiment leaves a choice open the estimate takes
the larger memory: every token through the LM head (CLM's), and every-k-th-layer checkpointing counted as none.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from pipeline.experiment import ExperimentConfig
from pipeline.model.flops import param_counts
from pipeline.model.lora import lora_params
from pipeline.planner.estimates import (
    GIB,
    SELECTIVE,
    Cluster,
    ModelStates,
    activation_bytes,
    largest_layer_params,
    model_states,
)
from pipeline.planner.report import PlannerInput


@dataclass(frozen=True)
class RunMemory:
    """Bytes per GPU of a run: model states, activations of its largest micro-batch, the runtime reserve."""

    zero: int  # the DeepSpeed JSON's stage
    offload: bool
    states: ModelStates
    activations: float
    reserve: float
    tokens: int  # of the largest micro-batch
    checkpointing: str
    gpu_memory: float  # of one GPU

    @property
    def total(self) -> float:
        return self.states.gpu + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB per GPU of {self.gpu_memory / GIB:g} (ZeRO-{self.zero}"
                f"{', offload' if self.offload else ''}: model states {self.states.gpu / GIB:.2f}, activations of "
                f"{self.tokens} tokens {self.activations / GIB:.2f} with activation checkpointing {self.checkpointing}, "
                f"reserve {self.reserve / GIB:g})")


def _checkpointing(setting: bool | str | int) -> str:
    """The planner's name of ``model.activation_checkpointing`` (every k-th layer, k > 1: counted as none)."""
    if setting == SELECTIVE:
        return SELECTIVE
    return "full" if setting is True or setting == 1 else "none"


def _offloads(zero: dict) -> bool:
    return any(isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"
               for k in ("offload_param", "offload_optimizer"))


def run_memory(exp: ExperimentConfig, ds: dict, config: PretrainedConfig, cluster: Cluster) -> RunMemory:
    """The memory per GPU of ``exp`` trained with the DeepSpeed JSON ``ds`` on ``cluster``; ``config`` is the HF
    config of the model it builds. ZeRO-0 shards nothing: it is counted as ZeRO-1 on one GPU."""
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    nodes, per_node = (cluster.nodes, cluster.gpus_per_node) if stage else (1, 1)
    params, lora = param_counts(config).total, exp.model.lora
    trainable = lora_params(config, lora.r, tuple(lora.targets)) if lora.r else params
    offload = _offloads(zero)
    states = model_states(params, largest_layer_params(config), max(stage, 1), offload, nodes, per_node,
                          trainable=trainable)
    tokens = max(pd.micro_batch * pd.seq_len for pd in exp.phases_data)
    checkpointing = _checkpointing(exp.model.activation_checkpointing)
    activations = sum(activation_bytes(config, tokens, 1.0, checkpointing, exp.model.lm_head_chunk).values())
    return RunMemory(stage, offload, states, activations, PlannerInput.reserve_gib * GIB, tokens, checkpointing,
                     cluster.gpu.memory_gib * GIB)
