"""Which kernels a run trains with: the HF attention implementation and the AdamW kernel. Preflight decides them
before any process group, so this module imports neither DeepSpeed nor the model (:mod:`pipeline.train.module`
builds the engine with them)."""

from __future__ import annotations

import torch

from pipeline.config import ConfigError
from pipeline.experiment import ModelConfig, OptimConfig
from pipeline.model.attention import FLEX, VARLEN, resolve_implementation


def model_dtype(config: ModelConfig, cuda: bool) -> torch.dtype:
    """``model.dtype``: auto is bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if config.dtype == "bf16" or (config.dtype == "auto" and cuda) else torch.float32


def attn_implementation(config: ModelConfig, cuda: bool) -> str:
    """The HF attention implementation to train with; FlexAttention and varlen need CUDA (no FlexAttention backward,
    no varlen kernel on CPU) and have no attention dropout, so ``auto`` then falls back to SDPA and an explicit
    ``flex`` / ``varlen`` is an error; varlen needs half precision (``resolve_implementation``)."""
    setting = config.attn_implementation
    try:
        impl = resolve_implementation(setting, cuda, model_dtype(config, cuda))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if impl not in (FLEX, VARLEN):
        return impl
    if not cuda:
        raise ConfigError(f"model.attn_implementation: {setting} trains on CUDA only (torch has no FlexAttention "
                          "backward and no varlen kernel on CPU); use auto or sdpa")
    if config.attention_dropout > 0:
        if setting != "auto":
            raise ConfigError(f"model.attn_implementation: {setting} has no attention dropout, but "
                              f"model.attention_dropout is {config.attention_dropout}; use auto or sdpa")
        return "sdpa"
    return impl


def adamw_kernel(o: OptimConfig, cuda: bool) -> str:
    """The AdamW kernel of ``optim.fused``: auto is torch's fused AdamW on CUDA, the default foreach AdamW on CPU."""
    kernel = o.fused if o.fused != "auto" else ("torch" if cuda else "none")
    if kernel != "none" and not cuda:
        raise ConfigError(f"optim.fused: {kernel} needs CUDA; use auto or none on CPU")
    return kernel
