"""(query, positive, hard negatives) rows for supervised contrastive training (LLM2Vec's third stage, E5's layout),
and the instructed text layout that data prep and ``pipeline.eval.encode`` share.

A row is a JSON object ``{"query", "positive", "negative": str | [str, ...], "instruction"?, "doc_instruction"?,
"task"?}``; the task is ``task`` or the file's stem. An instruction is a bare task description ("Retrieve
semantically similar text"); the row's own ``instruction`` wins, else its task's entry in ``--instructions`` (a JSON
``{task: {"query": str | [str, ...], "document": str | null | [str | null, ...]}}``: a list alternates by the row's
position in its file, as LLM2Vec's E5Data alternates allnli's and quora's two instructions; ``document`` instructs
positives and negatives too, the symmetric tasks). ``--instruction-format`` (``"{instruction}: "``) makes the
prefix that is joined to the text: ``prefix + text`` is tokenized as one string, the prefix's own token count marks
where the text starts, and pooling reads the text alone (:func:`instructed_rows`, which ``encode()`` uses too, so
training pools exactly what inference pools).

One sample per row: t = 2 + K slots (query, positive, K negatives) of ``width`` tokens each; slot s holds BOS, the
tokens of ``prefix + text`` cut to fit, EOS, then padding, as one segment. ``pool_spans`` holds each slot's text
tokens, ``text_hash`` a 64-bit hash of each slot's text (without its instruction): the objective masks a candidate
whose text equals a query's positive (another row's hard negative or identical positive) out of that query's
softmax (llm2vec issue #178). A row with more negatives keeps its first K.

A row's task is its sample's source: each task is written in its own shards (``build_file.py``), so a loader knows
every sample's task from the manifest alone (``data.pair_mixture``, ``data.pair_batching: same_task``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from pipeline.data.format.instructions import (
    DEFAULT_FORMAT,
    format_instruction,
    text_hash,
    tokenize_instructed,
)
from pipeline.data.format.sample import Sample, sample_key
from pipeline.data.prep.sources import RecordStats, has_surrogate


@dataclass(frozen=True)
class PairsSettings:
    """What a worker needs to turn rows into samples (picklable); all of it determines the shard bytes."""

    negatives: int = 1
    width: int = 512  # tokens per slot, BOS, instruction and EOS included
    instruction_format: str = DEFAULT_FORMAT
    instructions: dict = field(default_factory=dict)  # task -> {"query": ..., "document": ...}

    @property
    def slots(self) -> int:
        return 2 + self.negatives


@dataclass(frozen=True)
class PairRow:
    where: str  # file:line, for messages
    task: str
    texts: tuple[str, ...]  # query, positive, negatives
    prefixes: tuple[str, ...]  # the instruction prefix of each text ("" for none)


def _pick(value, index: int):
    return value[index % len(value)] if isinstance(value, list) else value


def _texts(record: dict, negatives: int) -> tuple[str, ...] | str:
    """(query, positive, first ``negatives`` negatives), or why the row is bad."""
    negative = record.get("negative", [] if negatives == 0 else None)
    negative = [negative] if isinstance(negative, str) else negative
    if not isinstance(negative, list):
        return f"negative is {type(negative).__name__}, not a string or a list"
    texts = (record.get("query"), record.get("positive"), *negative[:negatives])
    for name, value in zip(("query", "positive", *(["negative"] * negatives)), texts):
        if not isinstance(value, str) or not value.strip():
            return f"{name} is missing, empty or not a string"
        if has_surrogate(value):
            return f"{name} holds a lone surrogate"
    if len(texts) < 2 + negatives:
        return f"{len(texts) - 2} negatives, --negatives is {negatives}"
    return texts


def parse_row(where: str, record: dict, index: int, default_task: str, settings: PairsSettings,
              stats: RecordStats) -> PairRow | None:
    """The row at position ``index`` of its file, or None after counting why it is bad."""
    texts = _texts(record, settings.negatives)
    if isinstance(texts, str):
        stats.add_bad("bad_pair", where, texts)
        return None
    task = record.get("task") if isinstance(record.get("task"), str) and record.get("task") else default_task
    entry = settings.instructions.get(task, {})
    query = record.get("instruction", _pick(entry.get("query"), index))
    document = record.get("doc_instruction", _pick(entry.get("document"), index))
    if query is None and settings.instructions and "instruction" not in record:
        stats.add_bad("no_instruction", where, f"task {task!r}")
        return None
    if not all(v is None or isinstance(v, str) for v in (query, document)):
        stats.add_bad("bad_pair", where, "instruction or doc_instruction is not a string")
        return None
    fmt = settings.instruction_format
    prefixes = (format_instruction(fmt, query), *[format_instruction(fmt, document)] * (len(texts) - 1))
    stats.documents += 1
    return PairRow(where, task, texts, prefixes)


def default_task(path: str) -> str:
    """A file's task name: its stem (``squad.jsonl.zst`` -> ``squad``)."""
    name = os.path.basename(path.rstrip("/"))
    return name.split(".")[0]


def pair_sample(row: PairRow, rows: list[tuple[list[int], int, int]], settings: PairsSettings, pad_id: int,
                file_index: int, sample_index: int) -> Sample:
    """One row's sample from its slots' ``instructed_rows``."""
    t, width = settings.slots, settings.width
    input_ids = np.full(t * width, pad_id, dtype=np.int32)
    segments = np.zeros((t, 2), dtype=np.int32)
    pool = np.zeros((t, 2), dtype=np.int32)
    for s, (ids, start, end) in enumerate(rows):
        input_ids[s * width : s * width + len(ids)] = ids
        segments[s] = s * width, s * width + len(ids)
        pool[s] = s * width + start, s * width + end
    hashes = np.array([text_hash(text) for text in row.texts], dtype=np.int64)
    return Sample(sample_key(file_index, sample_index), input_ids, segments, None, None,
                  np.zeros((0, 2), dtype=np.int32), pool_spans=pool, text_hash=hashes)


def pair_samples(rows: list[PairRow], settings: PairsSettings, tok, bos: bool, eos: bool, pad_id: int,
                 file_index: int, first_index: int, stats: RecordStats) -> tuple[list[Sample], int, int, list[str]]:
    """(samples, tokens, texts cut to the width, each sample's task) of ``rows``, tokenized in one batch; a row
    whose instruction leaves no room for its text in the width is counted bad in ``stats``."""
    head = [tok.bos_id] if bos else []
    tail = [tok.eos_id] if eos else []
    t = settings.slots
    slots, _ = tokenize_instructed(tok, [x for r in rows for x in r.texts], [p for r in rows for p in r.prefixes],
                         settings.width, head, tail)
    samples, tokens, cut, tasks = [], 0, 0, []
    for i, row in enumerate(rows):
        mine = slots[i * t : (i + 1) * t]
        if any(s is None for s in mine):
            stats.documents -= 1
            stats.add_bad("long_instruction", row.where, f"an instruction leaves no room for text in "
                                                         f"{settings.width} tokens")
            continue
        cut += sum(s[3] for s in mine)
        tokens += sum(len(s[0]) for s in mine)
        samples.append(pair_sample(row, [s[:3] for s in mine], settings, pad_id, file_index,
                                   first_index + len(samples)))
        tasks.append(row.task)
    return samples, tokens, cut, tasks
