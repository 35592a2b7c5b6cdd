"""What :meth:`pipeline.train.trainer.Trainer.fit` returns: the run's end, typed, so callers read fields instead of
keys, and the console's ``summary:`` line made from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class BestExport:
    """The best checkpoint of ``checkpoint.keep_best`` and its HF export (``RUN/hf-best``)."""

    metric: str
    step: int
    value: float
    hf: str


@dataclass(frozen=True)
class FitSummary:
    steps: int  # optimizer steps done (the stop's step when the run stopped early)
    tokens_seen: int
    elapsed_s: float  # this process's time in the loop and its last checkpoint (not the exports)
    run_dir: str
    hf_export: str | None = None  # the HF directory of a finished healthy run with train.export_hf
    best: BestExport | None = None  # a finished healthy run with checkpoint.keep_best
    loss_plot: str | None = None  # RUN/loss.png, drawn on rank 0

    def line(self) -> str:
        """``summary: steps=... tokens_seen=... ...``: the fields that are set, in order."""
        fields = dataclasses.asdict(self)
        return "summary: " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
