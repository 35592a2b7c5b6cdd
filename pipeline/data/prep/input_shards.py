"""The shard directory of named inputs: where the trainer builds ``data.build_inputs`` when ``data.shards`` is left
at its default, so the files a user names are what trains (never the sample's directory, which the default would
otherwise be). The name is a function of what determines the shard bytes: each input's path, size and modification
time (a changed file gets a new directory instead of stale shards), the tokenizer's files (the same), the sequence
length and the source settings; the same inputs find the directory again and reuse it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from pipeline.data.prep.sources import expand_inputs

SHARDS_ROOT = os.path.join("runs", "shards")


def _stat_lines(path: str) -> list[str]:
    """``path size mtime`` of a file, or of every file under a directory (a saved dataset, a tokenizer); the path
    alone when there is none (a tokenizer preflight will refuse)."""
    if not os.path.exists(path):
        return [os.path.abspath(path)]
    files = [path] if not os.path.isdir(path) else sorted(
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    return [f"{os.path.abspath(f)} {(s := os.stat(f)).st_size} {s.st_mtime_ns}" for f in files]


def input_shards(inputs: Sequence[str], tokenizer: str, seq_len: int, source: tuple[str, str] = ("", "")) -> str:
    """``runs/shards/<first input's stem>-<fingerprint>-<seq_len>`` for the files ``inputs`` (globs) match, built
    with ``tokenizer`` (a path) at ``seq_len`` with ``source`` (field, default); ValueError when a pattern matches no
    input file."""
    paths = expand_inputs(inputs)
    digest = hashlib.sha256()
    for line in [*(x for p in paths for x in _stat_lines(p)), "tokenizer", *_stat_lines(tokenizer),
                 f"seq_len {seq_len}", f"source {source[0]!r} {source[1]!r}"]:
        digest.update(line.encode() + b"\n")
    stem = os.path.basename(os.path.normpath(paths[0])).split(".")[0] or "inputs"
    return os.path.join(SHARDS_ROOT, f"{stem}-{digest.hexdigest()[:12]}-{seq_len}")
