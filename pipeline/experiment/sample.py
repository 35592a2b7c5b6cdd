"""Where the embedded sample corpus lives: what the experiment trains on when it names no data of its own."""

from __future__ import annotations

import os

from pipeline.io import REPO, repo_relative

SAMPLE_DIR = os.path.join(REPO, "data", "sample")
SAMPLE_INPUTS = (os.path.join(SAMPLE_DIR, "train", "**", "*.jsonl.zst"),)


def sample_shards(seq_len: int) -> str:
    """The shard directory of the embedded sample corpus at ``seq_len``, the only one built from it unasked."""
    return os.path.join("runs", "shards", f"sample-{seq_len}")


def is_sample(inputs: list[str]) -> bool:
    """``inputs`` are the sample corpus's (as the config holds them, or as a record relative to the repository)."""
    return all(os.path.normpath(p) in (SAMPLE_INPUTS[0], repo_relative(SAMPLE_INPUTS[0])) for p in inputs)
