"""The divergence guard: a run whose updates are skipped or whose loss is not finite stops instead of "succeeding".

With a far too high learning rate the gradient norm becomes inf, DeepSpeed skips the update, the schedule stops
moving, and without this guard such a run exits 0 and exports a broken model. A step is *bad* when DeepSpeed
skipped it or when a loss or the gradient norm is not finite; ``train.max_bad_steps`` bad steps in a row stop the
run (non-zero exit, no checkpoint of the bad state, no HF export), and no checkpoint is written while the newest
step is bad, so the good checkpoints are never overwritten or pruned away by bad ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class Diverged(RuntimeError):
    pass


class DivergenceGuard:
    def __init__(self, max_bad_steps: int, skipped_before: int = 0):
        self.max_bad_steps = max_bad_steps
        self.bad_in_row = 0
        self._engine_skipped = skipped_before  # DeepSpeed's cumulative counter at the last check

    @property
    def healthy(self) -> bool:
        """Whether the newest step was good: only then may a checkpoint be written."""
        return self.bad_in_row == 0

    def count(self, losses: dict[str, float], grad_norm: float, engine_skipped: int) -> None:
        """Count a step; ``engine_skipped`` is DeepSpeed's cumulative skipped-step counter."""
        skipped = engine_skipped > self._engine_skipped
        self._engine_skipped = engine_skipped
        finite = all(math.isfinite(v) for v in losses.values()) and math.isfinite(grad_norm)
        self.bad_in_row = self.bad_in_row + 1 if skipped or not finite else 0

    def check(self, step: int, losses: dict[str, float], grad_norm: float, last_good: Callable[[], str | None]
              ) -> None:
        """Raise :class:`Diverged` once ``max_bad_steps`` counted steps in a row were bad; ``last_good`` gives the
        newest complete checkpoint for the message."""
        if self.bad_in_row >= self.max_bad_steps:
            loss = " ".join(f"{k}={v:.4g}" for k, v in losses.items())
            raise Diverged(f"training diverged: {self.bad_in_row} bad steps in a row (skipped updates or non-finite "
                           f"loss) up to step {step}: loss {loss}, grad norm {grad_norm:.4g}; no checkpoint of this "
                           f"state and no HF export were written; the last good checkpoint is "
                           f"{last_good() or 'none (no checkpoint before the divergence)'}; start a new run with a lower "
                           f"optim.lr (or more optim.warmup_steps), or, if the spikes pass, resume with a larger "
                           f"train.max_bad_steps")
