"""``train.batch_warmup`` on this world size: the loaders' :class:`~pipeline.data.loading.order.BatchWarmup`, checked."""

from __future__ import annotations

from pipeline.config import ConfigError
from pipeline.data.loading.order import BatchWarmup
from pipeline.experiment import TrainConfig


def batch_warmup(t: TrainConfig, world: int) -> BatchWarmup | None:
    """The warmup in global micro-batches of ``train.micro_batch`` samples (None without one). Its multiple (default
    ``micro_batch x world``) must split into whole micro-batches on every rank, and fit in the full batch."""
    w = t.batch_warmup
    if not w.steps or w.start == 1:
        return None
    split, full = t.micro_batch * world, t.global_batch(world)
    multiple = w.multiple or split
    if multiple % split or multiple > full:
        raise ConfigError(f"train.batch_warmup.multiple: {multiple} samples do not make whole micro-batches of "
                          f"{t.micro_batch} on each of {world} ranks within the global batch of {full}; set it to a "
                          f"multiple of {split} up to {full} (for a resume on other world sizes, a multiple of "
                          f"micro_batch x each of them)")
    return BatchWarmup(full // t.micro_batch, w.start, w.steps, multiple // t.micro_batch)
