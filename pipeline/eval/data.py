"""Reading evaluation data: local files first, an HF ``datasets`` name when no such file exists (online only).

Every reader yields ``Row``s: the fields of one record plus ``where`` (``file:line``, or ``name[split]#index`` for a
hub dataset), so every later error can name the record. Layouts (``docs/evaluation.md``):

- ``.tsv`` / ``.csv`` with a header row (GLUE's SST-2/MNLI/QQP/STS-B, SICK's ``SICK.txt`` as ``.tsv`` or ``.txt``);
  tab-separated files are read without quote handling, as GLUE's are meant to be;
- ``.jsonl``: one JSON object per line (MTEB / HF exports);
- ``.json``: a list of objects, or SQuAD's nested ``{"data": [...]}``;
- CoNLL column files (``read_conll``): one token per line, columns separated by whitespace, blank lines between
  sentences, ``-DOCSTART-`` lines skipped.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.io import read_json, read_jsonl

TABLE_EXTS = (".tsv", ".csv", ".txt")
RECORD_EXTS = (*TABLE_EXTS, ".jsonl", ".json")


class DataError(ValueError):
    """Bad evaluation data: the message names the file (and line or field) and the fix."""


@dataclass
class Row:
    fields: dict[str, Any]
    where: str

    def get(self, aliases: Sequence[str], what: str, required: bool = True) -> Any:
        """The first of ``aliases`` present in the row (case-insensitive column names)."""
        lowered = {k.lower(): v for k, v in self.fields.items()}
        for name in aliases:
            if name.lower() in lowered and lowered[name.lower()] not in (None, ""):
                return lowered[name.lower()]
        if not required:
            return None
        raise DataError(f"{self.where}: no {what} column; expected one of {list(aliases)}, the record has "
                        f"{list(self.fields)}")


def _table_rows(path: str) -> Iterator[Row]:
    delimiter = "," if path.endswith(".csv") else "\t"
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter=delimiter, quoting=csv.QUOTE_MINIMAL if delimiter == "," else csv.QUOTE_NONE)
        header = next(reader, None)
        if not header:
            raise DataError(f"{path}: empty; expected a header row naming the columns, then one record per line")
        for values in reader:
            line = reader.line_num
            if not values:
                continue
            if len(values) != len(header):
                sep = "commas" if delimiter == "," else "tabs"
                raise DataError(f"{path}:{line}: {len(values)} columns, but the header has {len(header)} "
                                f"({', '.join(header)}); fix the row (a stray tab or comma?) so fields are "
                                f"separated by {sep}")
            yield Row(dict(zip(header, values)), f"{path}:{line}")


def _jsonl_rows(path: str) -> Iterator[Row]:
    for line_no, record in read_jsonl(path, DataError):
        yield Row(record, f"{path}:{line_no}")


def _json_rows(path: str) -> Iterator[Row]:
    data = read_json(path, top=None, error=DataError)
    if isinstance(data, dict) and isinstance(data.get("data"), list):  # SQuAD: one row per question
        for a, article in enumerate(data["data"]):
            for p, paragraph in enumerate(article.get("paragraphs", [])):
                for q, qa in enumerate(paragraph.get("qas", [])):
                    yield Row({**qa, "context": paragraph.get("context")},
                              f"{path}: data[{a}].paragraphs[{p}].qas[{q}]")
    elif isinstance(data, list):
        for i, record in enumerate(data):
            if not isinstance(record, dict):
                raise DataError(f"{path}: item {i} is a {type(record).__name__}, expected an object")
            yield Row(record, f"{path}: item {i}")
    else:
        raise DataError(f"{path}: expected a list of records or SQuAD's {{'data': [...]}}")


def _hub_rows(name: str, split: str) -> Iterator[Row]:
    """``owner/name`` or ``owner/name:config`` through ``datasets.load_dataset`` (needs the network or its cache)."""
    import datasets

    path, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(path, config or None, split=split)
    except Exception as e:  # datasets raises many types for a missing dataset, split or network
        raise DataError(f"{name}: no such local file, and loading it as an HF dataset (split {split!r}) failed "
                        f"({type(e).__name__}: {e}); put the file under --data-dir (see docs/evaluation.md)") from e
    for i, record in enumerate(ds):
        yield Row(dict(record), f"{name}[{split}]#{i}")


def read_rows(dataset: str, split: str = "test") -> list[Row]:
    """All records of a local file, or of split ``split`` of the HF dataset ``dataset`` when no such file exists."""
    if os.path.isfile(dataset):
        if dataset.endswith(".jsonl"):
            return list(_jsonl_rows(dataset))
        if dataset.endswith(".json"):
            return list(_json_rows(dataset))
        if dataset.endswith(TABLE_EXTS):
            return list(_table_rows(dataset))
        raise DataError(f"{dataset}: unknown file type; use one of {', '.join(RECORD_EXTS)}")
    if os.path.exists(dataset) or os.path.isabs(dataset) or dataset.endswith(RECORD_EXTS) or "/" not in dataset:
        raise DataError(f"{dataset}: no such file; put it there or pass an HF dataset name (owner/name[:config]) "
                        f"when online (see docs/evaluation.md)")
    return list(_hub_rows(dataset, split))


def find_files(directory: str, exts: Sequence[str], what: str) -> list[str]:
    """The data files of one task family, sorted; an error naming the directory when there are none."""
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: no such directory; {what} reads its files from there (see docs/evaluation.md)")
    files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(tuple(exts)))
    if not files:
        raise DataError(f"{directory}: no {'/'.join(exts)} files for {what} (see docs/evaluation.md)")
    return files


def dataset_name(path: str) -> str:
    """A file's dataset name in results: its name without the extension (``sts/stsb.tsv`` -> ``stsb``)."""
    base = os.path.basename(path.rstrip("/"))
    for ext in RECORD_EXTS:
        if base.endswith(ext):
            return base[: -len(ext)]
    return base.replace("/", "_").replace(":", "_")


def split_file(directory: str, split: str, names: dict[str, Sequence[str]], what: str) -> str:
    """``directory``'s file for ``split`` under any of its usual names (``names[split]``, e.g. CoNLL's
    ``eng.testa`` for dev)."""
    for name in names[split]:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise DataError(f"{directory}: no {split} file for {what}; expected one of {list(names[split])}")


@dataclass
class Sentence:
    """One CoNLL sentence: its words and each tag column."""

    words: list[str]
    tags: list[list[str]] = field(default_factory=list)  # tags[c][i]: column c + 1 of word i
    where: str = ""


def read_conll(path: str) -> list[Sentence]:
    """Sentences of a CoNLL column file (token, then tag columns such as POS, chunk, NER in CoNLL-2003). Every
    token line must have as many columns as the file's first one."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such CoNLL file (see docs/evaluation.md)")
    sentences, words, columns, width, start = [], [], [], None, 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            parts = line.split()
            if parts and parts[0] == "-DOCSTART-":
                parts = []
            if not parts:
                if words:
                    sentences.append(Sentence(words, [list(c) for c in zip(*columns)], f"{path}:{start}"))
                words, columns = [], []
                continue
            if width is None:
                width = len(parts)
                if width < 2:
                    raise DataError(f"{path}:{line_no}: one column; a CoNLL file has the token then its tags "
                                    f"(CoNLL-2003: token POS chunk NER)")
            if len(parts) != width:
                raise DataError(f"{path}:{line_no}: {len(parts)} columns, but the file's first token line has "
                                f"{width}; every token line needs the token and the same tag columns")
            if not words:
                start = line_no
            words.append(parts[0])
            columns.append(parts[1:])
    if words:
        sentences.append(Sentence(words, [list(c) for c in zip(*columns)], f"{path}:{start}"))
    if not sentences:
        raise DataError(f"{path}: no sentences")
    return sentences
