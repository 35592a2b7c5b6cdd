"""Which parameters get weight decay: the same split for pretraining (the engine's AdamW, or DeepSpeed's own
optimizer) and for evaluation's fine-tuning."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms or biases); ZeRO-3 partitioned params keep their shape in
    ``ds_shape``."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
