"""What every evaluation task shares: its registry entry and the context it runs in.

A task is its description (:class:`pipeline.tasks.TaskSpec`: name, options type, headline, Hub labels, ...) and a
``run`` that takes the context and the typed options and returns a JSON-able dict, from which the spec's
``headline`` picks the few numbers the ablation report tabulates and plots (``launch/report.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.eval.data import find_files
from pipeline.eval.load import EvalModel
from pipeline.tasks import TaskSpec


@dataclass
class EvalContext:
    model: EvalModel
    data_dir: str
    batch_size: int = 16  # rows per batch of generation and intrinsic tasks
    progress: bool = True
    seed: int = 0
    max_tokens: int = 16384  # padded tokens per batch of encode() and the probes' features
    dim: int | None = None  # the embedding tasks' leading dims (a Matryoshka model's); None: the model's default

    def datasets(self, family: str, given: Sequence[str], exts: Sequence[str]) -> list[str]:
        """The data of one task: ``given`` entries (a file under --data-dir, any file path, or an HF dataset name),
        or else every matching file in ``DATA_DIR/family``."""
        if not given:
            return find_files(os.path.join(self.data_dir, family), exts, f"task family {family!r}")
        return [os.path.join(self.data_dir, g) if os.path.exists(os.path.join(self.data_dir, g)) else g for g in given]


@dataclass(frozen=True)
class Task:
    spec: TaskSpec  # what the task is (pipeline.tasks.SPECS)
    run: Callable[[EvalContext, Any], dict]  # how it runs: its result from the context and its typed options
