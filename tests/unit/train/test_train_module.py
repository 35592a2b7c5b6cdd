"""The trainer's speed settings: which attention implementation and AdamW kernel a config gets, and their errors."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.experiment import ModelConfig, OptimConfig, load_experiment
from pipeline.model import varlen
from pipeline.model.attention import FLEX, VARLEN
from pipeline.train.module import attn_implementation, build_optimizer, fused_kind, leaf_layers


def test_attention_implementation_per_device_and_dropout():
    assert attn_implementation(ModelConfig(), cuda=False) == "sdpa"  # the CPU default path is unchanged
    assert attn_implementation(ModelConfig(), cuda=True) == VARLEN  # which runs MAGNET's masks as FLEX does
    assert attn_implementation(ModelConfig(attention_dropout=0.3), cuda=True) == "sdpa"  # SimCSE: neither has it
    assert attn_implementation(ModelConfig(attn_implementation="flex"), cuda=True) == FLEX
    assert attn_implementation(ModelConfig(attn_implementation="varlen"), cuda=True) == VARLEN
    assert attn_implementation(ModelConfig(attn_implementation="eager"), cuda=True) == "eager"
    with pytest.raises(ConfigError, match="model.attn_implementation: flex trains on CUDA only.*auto or sdpa"):
        attn_implementation(ModelConfig(attn_implementation="flex"), cuda=False)
    with pytest.raises(ConfigError, match="flex has no attention dropout.*model.attention_dropout is 0.3"):
        attn_implementation(ModelConfig(attn_implementation="flex", attention_dropout=0.3), cuda=True)
    with pytest.raises(ConfigError, match="model.attn_implementation: varlen trains on CUDA only.*auto or sdpa"):
        attn_implementation(ModelConfig(attn_implementation="varlen"), cuda=False)
    with pytest.raises(ConfigError, match="varlen has no attention dropout.*model.attention_dropout is 0.3"):
        attn_implementation(ModelConfig(attn_implementation="varlen", attention_dropout=0.3), cuda=True)


def test_attention_implementation_without_torch_varlen(monkeypatch):
    """torch < 2.10 has no torch.nn.attention.varlen: auto takes FlexAttention, an explicit varlen says why not."""
    monkeypatch.setattr(varlen, "varlen_attn", None)
    assert attn_implementation(ModelConfig(), cuda=True) == FLEX
    with pytest.raises(ConfigError, match=r"model.attn_implementation: varlen needs torch.nn.attention.varlen "
                                          r"\(torch >= 2.10\).*use auto, flex or sdpa"):
        attn_implementation(ModelConfig(attn_implementation="varlen"), cuda=True)


def test_adamw_kernel_choice():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.1}]
    cpu = build_optimizer(groups, OptimConfig(), fused_kind(OptimConfig(), cuda=False))
    assert type(cpu) is torch.optim.AdamW and not cpu.defaults["fused"]  # unchanged on CPU
    assert cpu.defaults["lr"] == OptimConfig().lr and cpu.defaults["betas"] == OptimConfig().betas
    assert fused_kind(OptimConfig(), cuda=True) == "torch"
    assert build_optimizer(groups, OptimConfig(), "torch").defaults["fused"] is True
    for kind in ("torch", "deepspeed"):
        with pytest.raises(ConfigError, match=f"optim.fused: {kind} needs CUDA"):
            fused_kind(OptimConfig(fused=kind), cuda=False)


def test_speed_fields_are_validated():
    exp = load_experiment(None, ["model.attn_implementation=flex", "model.compile=true", "model.lm_head_chunk=256",
                                 "optim.fused=deepspeed"])
    assert (exp.model.attn_implementation, exp.model.compile, exp.model.lm_head_chunk, exp.optim.fused) == (
        "flex", True, 256, "deepspeed")
    with pytest.raises(ConfigError, match=r"model.lm_head_chunk: -1 is out of range; it must be >= 0"):
        load_experiment(None, ["model.lm_head_chunk=-1"])
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        load_experiment(None, ["model.attn_implementation=flash"])


def test_layers_are_zero3_leaf_modules_only_where_a_micro_step_runs_each_once():
    """A phase of several objectives runs each layer once per objective before one backward; DeepSpeed reduces a
    leaf module's gradients once per call, so such a run keeps per-module hooks (tests/e2e/test_magnet_train.py's
    two-stage MAGNET + SSCL run trains under ZeRO-3 with them), as a LoRA run does."""
    assert leaf_layers(load_experiment(None))  # one CLM phase
    two_phases = "phases=[{share: 0.5, objectives: [{name: clm}]}, {share: 0.5, objectives: [{name: mlm}]}]"
    assert leaf_layers(load_experiment(None, [two_phases]))
    mixed = "phases=[{objectives: [{name: clm}, {name: mlm}]}]"
    assert not leaf_layers(load_experiment(None, [mixed]))
    assert not leaf_layers(load_experiment(None, ["model.lora.r=4"]))  # its frozen weights (tests/unit/model/test_lora.py)
