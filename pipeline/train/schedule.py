"""Learning-rate schedules as a multiplier of the peak lr, a pure function of the optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipeline.train.engine_spec import Schedule


def lr_multiplier(step: int, s: Schedule) -> float:
    """``step`` counts optimizer steps from 0. Warmup is linear from 1/warmup to 1."""
    warmup = s.warmup
    if warmup and step < warmup:
        return (step + 1) / warmup
    floor = s.min_lr_ratio
    if s.kind == "constant":
        return 1.0
    if s.kind == "wsd":
        decay = s.decay
        decay_start = s.total - decay
        if step < decay_start:
            return 1.0
        frac = (step - decay_start) / max(1, decay)
        return 1.0 - (1.0 - floor) * min(1.0, frac)
    frac = (step - warmup) / max(1, s.total - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def lr_scheduler(s: Schedule) -> Callable[[torch.optim.Optimizer], LambdaLR]:
    """The schedule as ``deepspeed.initialize(lr_scheduler=...)`` takes it: a callable that DeepSpeed calls with the
    optimizer it trains with, the client's or the one its config section builds."""
    return lambda optimizer: LambdaLR(optimizer, lambda step: lr_multiplier(step, s))
