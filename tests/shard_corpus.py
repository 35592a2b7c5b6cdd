"""Small real inputs for data-prep tests: documents of the embedded sample corpus (Shakespeare) re-split into a few
``.jsonl.zst`` files, and the shipped tokenizer. Import with ``from shard_corpus import ...``."""

from __future__ import annotations

import json
import os

import zstandard

from pipeline.data.prep.sources import RecordStats, read_texts

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


def genre(title: str) -> str:
    """The rule that splits the sample corpus into named sources: the histories ("King ..."), the poems, the other
    plays (about 34 %, 5 % and 61 % of its text)."""
    if title.startswith("King "):
        return "histories"
    if title in ("Sonnets", "The Rape of Lucrece", "The Passionate Pilgrim", "The Phoenix and the Turtle",
                 "Venus and Adonis", "A Lover's Complaint"):
        return "poems"
    return "plays"


def sourced_corpus(directory, paths: list[str], max_docs: int | None = None, per_source: int | None = None,
                   max_chars: int | None = None) -> list[str]:
    """The sample-corpus files ``paths`` rewritten into ``directory`` with SlimPajama's source field
    (``meta.redpajama_set_name``) set by :func:`genre` of each document's title; the first ``max_docs`` documents of
    each file (default all), at most ``per_source`` of each source, each cut to ``max_chars``. Their paths, sorted."""
    out = []
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            records = [json.loads(line) for line in zstandard.ZstdDecompressor().stream_reader(f).read().splitlines()]
        kept, taken = [], {}
        for r in records[:max_docs]:
            source = genre(r["meta"]["title"])
            taken[source] = taken.get(source, 0) + 1
            if per_source is None or taken[source] <= per_source:
                kept.append({**r, "text": r["text"][:max_chars], "meta": {**r["meta"], "redpajama_set_name": source}})
        lines = b"".join(json.dumps(r).encode() + b"\n" for r in kept)
        out.append(os.path.join(directory, f"part-{i:02d}.jsonl.zst"))
        with open(out[-1], "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(lines))
    return out
