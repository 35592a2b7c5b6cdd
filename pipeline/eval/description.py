"""The evaluated model as a results file records it (:class:`ModelDescription`, from ``EvalModel.describe``), and
the paths a results file names, relative to the results root (:func:`recorded_path`): the directory of the runs
evaluated (``make reproduce``: OUT, whose run directories RESULTS/SCALE/runs keeps the records of under the same
names; ``launch/evaluate.py``: the repository), so a record names no machine's layout."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from pipeline.export.record import EncoderRecord
from pipeline.io import REPO, repo_relative


def recorded_path(path: str, root: str = REPO) -> str:
    """``path`` as a results file names it: relative to ``root`` when inside it, else as ``repo_relative`` does
    (relative to the repository inside it, absolute outside: a model or data the user placed there)."""
    full, root = os.path.abspath(path), os.path.abspath(root)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else repo_relative(full)


@dataclass(frozen=True)
class ModelDescription:
    """Which model an evaluation read and how: its export and run (paths relative to the results root), the
    checkpoint step, the attention it was read with, its training record, tokenizer and size."""

    hf_dir: str
    run_dir: str | None  # the training run it came from, when known
    step: int | None  # the checkpoint step exported, when known
    attention: str  # "causal" | "bidirectional": how encoders read text
    reads_previous: bool  # MNTP-trained: token i is read from position i - 1
    record: EncoderRecord  # how its training says to read it
    tokenizer: str
    parameters: int

    def to_json(self) -> dict:
        return {**asdict(self), "record": self.record.as_dict()}

    @classmethod
    def from_json(cls, data: dict) -> ModelDescription:
        return cls(**{**data, "record": EncoderRecord.from_dict(data["record"])})
