"""Small real inputs for data-prep tests: documents of the embedded sample corpus (Shakespeare) re-split into a few
``.jsonl.zst`` files, and the shipped tokenizer. Import with ``from shard_corpus import ...``."""

from __future__ import annotations

import json
import os

import zstandard

from pipeline.data.sources import RecordStats, read_texts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data/sample/tokenizer")
HOLDOUT = os.path.join(ROOT, "data/sample/validation/chunk1/example_holdout_0.jsonl.zst")
TRAIN = os.path.join(ROOT, "data/sample/train/chunk1/example_train_0.jsonl.zst")


def write_jsonl_zst(path, docs: list[str]) -> str:
    lines = b"".join(json.dumps({"text": d, "meta": {"redpajama_set_name": "RedPajamaBook"}}).encode() + b"\n"
                     for d in docs)
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(lines))
    return str(path)


def documents(path: str = HOLDOUT, max_chars: int | None = None) -> list[str]:
    """The documents of a sample-corpus file, each cut to ``max_chars`` (at a line end) to keep tests small."""
    docs = list(read_texts(path, "text", RecordStats()))
    if max_chars is None:
        return docs
    return [d[:max_chars].rsplit("\n", 1)[0] or d[:max_chars] for d in docs]


def split_corpus(directory, num_files: int, path: str = HOLDOUT, max_chars: int | None = None) -> list[str]:
    """The documents of ``path`` dealt round-robin into ``num_files`` files in ``directory``; their paths, sorted."""
    docs = documents(path, max_chars)
    return [write_jsonl_zst(os.path.join(directory, f"part-{f:02d}.jsonl.zst"), docs[f::num_files])
            for f in range(num_files)]
