"""The trainer's speed settings: which attention implementation and AdamW kernel a config gets, and their errors."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.experiment import ModelConfig, OptimConfig, load_experiment
from pipeline.model import varlen
from pipeline.model.attention import FLEX, VARLEN
from pipeline.train.compiling import body_compiles, check_compile, leaf_layers
from pipeline.train.ds_config import load_ds_config, resolve_ds_config
from pipeline.train.engine_spec import adamw
from pipeline.train.kernels import adamw_kernel, attn_implementation
from pipeline.train.module import build_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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
    cpu = build_optimizer(groups, adamw(OptimConfig()), adamw_kernel(OptimConfig(), cuda=False))
    assert type(cpu) is torch.optim.AdamW and not cpu.defaults["fused"]  # unchanged on CPU
    assert cpu.defaults["lr"] == OptimConfig().lr and cpu.defaults["betas"] == OptimConfig().betas
    assert adamw_kernel(OptimConfig(), cuda=True) == "torch"
    assert build_optimizer(groups, adamw(OptimConfig()), "torch").defaults["fused"] is True
    for kind in ("torch", "deepspeed"):
        with pytest.raises(ConfigError, match=f"optim.fused: {kind} needs CUDA"):
            adamw_kernel(OptimConfig(fused=kind), cuda=False)


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


def test_varlen_needs_half_precision():
    """The flash varlen kernel takes bf16 / fp16: auto on CUDA picks FlexAttention for an fp32 model, and an explicit
    varlen there is refused with the fix (issue 41, finding 2)."""
    assert attn_implementation(ModelConfig(dtype="fp32"), cuda=True) == FLEX
    assert attn_implementation(ModelConfig(dtype="bf16"), cuda=True) == VARLEN
    with pytest.raises(ConfigError, match="varlen runs flash attention, which takes bf16 or fp16, but the model is "
                                          "float32; set model.dtype: bf16"):
        attn_implementation(ModelConfig(attn_implementation="varlen", dtype="fp32"), cuda=True)


def test_fused_adam_build_failure_falls_back_to_torch_fused_adamw(monkeypatch, capsys):
    """optim.fused=deepspeed whose FusedAdam JIT build fails (as against CUDA 13's headers) trains with torch's fused
    AdamW and says so on one line (finding 4)."""
    import deepspeed.ops.adam

    def failed_build(*args, **kwargs):
        raise RuntimeError("Error building extension 'fused_adam'")

    monkeypatch.setattr(deepspeed.ops.adam, "FusedAdam", failed_build)
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))]}]
    optimizer = build_optimizer(groups, adamw(OptimConfig()), "deepspeed")
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert ("FusedAdam could not be built (Error building extension 'fused_adam'); training with torch's fused AdamW"
            in capsys.readouterr().err)


def _resolved(name: str, *overrides: str, bf16: bool = True) -> tuple:
    exp = load_experiment(None, list(overrides))
    return exp, resolve_ds_config(load_ds_config(os.path.join(REPO, "ds_configs", name)), exp, 1, bf16)


def test_deepcompile_refuses_the_bf16_optimizer():
    """DeepCompile at ZeRO-1 with bf16 and fp32 gradient accumulation (the trainer's default, which makes DeepSpeed
    pick its BF16_Optimizer) is refused before the engine with the fix; the shipped zero1_deepcompile.json
    accumulates in bf16 (DeepSpeed's ZeRO optimizer, which DeepCompile's pass drives) and gets past that check
    (finding 1)."""
    exp, ds = _resolved("zero1_deepcompile.json")
    assert ds["data_types"]["grad_accum_dtype"] == "bf16"
    fp32 = ds | {"data_types": {"grad_accum_dtype": "fp32"}}  # a user's JSON without it: the trainer's fp32
    with pytest.raises(ConfigError, match=r"compile.deepcompile at zero_optimization.stage 1 with bf16 and "
                                          r"data_types.grad_accum_dtype fp32 makes DeepSpeed use its BF16_Optimizer"):
        check_compile(exp, fp32)
    with pytest.raises(ConfigError) as shipped:  # on this CPU the next check stops it: DeepCompile needs CUDA
        check_compile(exp, ds)
    assert "BF16_Optimizer" not in str(shipped.value)


def test_compile_decisions():
    """model.compile: auto compiles each layer on CUDA except under DeepCompile, with selective checkpointing (the
    policy never sees a compiled matmul) and under ZeRO-3 where the layers cannot be leaf modules (DeepSpeed's hooks
    break every compiled layer); true with selective checkpointing is refused (findings 10, 11)."""
    exp, zero1 = _resolved("zero1.json")
    assert body_compiles(exp, zero1, cuda=True) and not body_compiles(exp, zero1, cuda=False)
    _, deepcompiled = _resolved("zero1_deepcompile.json")
    assert not body_compiles(exp, deepcompiled, cuda=True)
    selective, _ = _resolved("zero1.json", "model.activation_checkpointing=selective")
    assert not body_compiles(selective, zero1, cuda=True)
    exp3, zero3 = _resolved("zero3.json")
    lora, _ = _resolved("zero3.json", "model.lora.r=4")
    assert body_compiles(exp3, zero3, cuda=True) and not body_compiles(lora, zero3, cuda=True)
    forced, _ = _resolved("zero3.json", "model.lora.r=4", "model.compile=true")
    assert body_compiles(forced, zero3, cuda=True)  # compiled anyway, with a note of the graph breaks
    both, _ = _resolved("zero1.json", "model.activation_checkpointing=selective", "model.compile=true")
    with pytest.raises(ConfigError, match="model.compile: true with model.activation_checkpointing: selective"):
        check_compile(both, zero1)
