"""Learning-rate schedules as a multiplier of the peak lr, a pure function of the optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipeline.experiment import OptimConfig


def lr_multiplier(step: int, total: int, cfg: OptimConfig) -> float:
    """``step`` counts optimizer steps from 0. Warmup is linear from 1/warmup to 1."""
    warmup = cfg.warmup(total)
    if warmup and step < warmup:
        return (step + 1) / warmup
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay = cfg.decay(total)
        decay_start = total - decay
        if step < decay_start:
            return 1.0
        frac = (step - decay_start) / max(1, decay)
        return 1.0 - (1.0 - floor) * min(1.0, frac)
    frac = (step - warmup) / max(1, total - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def lr_scheduler(total: int, cfg: OptimConfig) -> Callable[[torch.optim.Optimizer], LambdaLR]:
    """The schedule as ``deepspeed.initialize(lr_scheduler=...)`` takes it: a callable that DeepSpeed calls with the
    optimizer it trains with, the client's or the one its config section builds."""
    return lambda optimizer: LambdaLR(optimizer, lambda s: lr_multiplier(s, total, cfg))
