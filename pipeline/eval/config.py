"""What one evaluation runs (:class:`EvalConfig`): the model, the tasks and their options, the data, how it reads
the model; ``launch/evaluate.py``'s flags and ``make reproduce``'s evaluations alike, recorded in the results."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from pipeline.eval.description import recorded_path
from pipeline.eval.encode import MAX_TOKENS


@dataclass
class EvalConfig:
    model: str
    tasks: list[str]
    data_dir: str
    overrides: list[str] = field(default_factory=list)  # TASK.KEY=VALUE
    attention: str = "auto"
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    batch_size: int = 16  # rows per batch of generation and intrinsic tasks
    seed: int = 0
    progress: bool = True
    step: int | None = None  # a kept checkpoint of the run directory ``model`` (None: its export or newest)
    max_tokens: int = MAX_TOKENS  # padded tokens per batch of encode() and the probes' features
    dim: int | None = None  # leading dims the embedding tasks keep (a Matryoshka model's); None: its default
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("dim",)  # left out of a results file unset: its bytes as before

    def recorded(self, root: str) -> EvalConfig:
        """This config as a results file records it: its paths relative to the results root ``root``."""
        return replace(self, model=recorded_path(self.model, root), data_dir=recorded_path(self.data_dir, root),
                       tokenizer=self.tokenizer and recorded_path(self.tokenizer, root))
