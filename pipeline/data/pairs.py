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
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.data.format import Sample, sample_key
from pipeline.data.sources import RecordStats, has_surrogate

DEFAULT_FORMAT = "{instruction}: "  # LLM2Vec's evaluation join ("...: text"); training and use share it here


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


def check_format(fmt: str) -> None:
    try:
        ok = fmt.format(instruction="X") != fmt and "{instruction}" in fmt
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"instruction format {fmt!r} must hold '{{instruction}}' once and no other field, "
                         f"e.g. '{DEFAULT_FORMAT}'")


def format_instruction(fmt: str | None, instruction: str | None) -> str:
    """The prefix joined to a text: ``fmt`` filled with ``instruction`` ("" for none; ``fmt`` None: verbatim)."""
    if not instruction:
        return ""
    return instruction if fmt is None else fmt.format(instruction=instruction)


def load_instructions(path: str) -> dict:
    """The ``--instructions`` table, checked: every entry's query and document are a string (document: or null)
    or a non-empty list of them."""
    with open(path) as f:
        table = json.load(f)

    def ok(value, nullable: bool) -> bool:
        items = value if isinstance(value, list) and value else [value]
        return all(isinstance(v, str) and v.strip() or (nullable and v is None) for v in items)

    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object {{task: {{query, document}}}}")
    for task, entry in table.items():
        if (not isinstance(entry, dict) or set(entry) - {"query", "document"} or not ok(entry.get("query"), False)
                or not ok(entry.get("document"), True)):
            raise ValueError(f"{path}: task {task!r}: expected {{\"query\": str | [str, ...], \"document\": "
                             f"str | null | [str | null, ...]}}, got {entry!r}")
    return table


def text_hash(text: str) -> int:
    """A text's 64-bit blake2b (signed, for an int64 array): equal texts hash equal under any instruction."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def _tokenize(tok, texts: Sequence[str], prefixes: Sequence[str], max_length: int, head: list[int],
              tail: list[int]) -> tuple[list[tuple[list[int], int, int, bool] | None], int]:
    """(per text: (ids, first text position, end of text, whether it was cut), or None where the prefix leaves no
    room for the text; the longest prefix's token count). The text starts after as many tokens as the prefix has
    alone, sentence-transformers' rule (``include_prompt: false``), so its export pools what this pools. A prefix
    ending in a space the tokenizer merges into the text's first word ("X: " is ``▁X : ▁`` alone but
    ``▁X : ▁Norfolk`` joined) thus leaves that word out of pooling, in training and in use alike."""
    distinct = sorted({p for p in prefixes if p})
    skips = dict(zip(distinct, (len(ids) for ids in tok.encode_batch(distinct)))) | {"": 0}
    room = max_length - len(head) - len(tail)
    out = []
    for ids, prefix in zip(tok.encode_batch([p + t for p, t in zip(prefixes, texts)]), prefixes):
        skip = skips[prefix]
        cut = ids[:room]
        out.append(None if room <= skip else
                   (head + cut + tail, len(head) + min(skip, len(cut)), len(head) + len(cut), len(ids) > room))
    return out, max((skips[p] for p in prefixes), default=0)


def instructed_rows(tok, texts: Sequence[str], prefixes: Sequence[str], max_length: int, head: list[int],
                    tail: list[int]) -> list[tuple[list[int], int, int]]:
    """(ids, first text position, end of text) per ``prefixes[i] + texts[i]``, tokenized as one string and cut to
    ``max_length`` tokens with ``head`` and ``tail`` around it; the prefix's own token count marks the text's
    start. Raises ValueError when a prefix leaves no room for the text."""
    rows, longest = _tokenize(tok, texts, prefixes, max_length, head, tail)
    if any(r is None for r in rows):
        raise ValueError(f"the instruction takes {len(head) + longest} of the {max_length} tokens allowed; shorten "
                         f"it or raise max_length")
    return [r[:3] for r in rows]


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
                 file_index: int, first_index: int, stats: RecordStats) -> tuple[list[Sample], int, int, dict]:
    """(samples, tokens, texts cut to the width, rows per task) of ``rows``, tokenized in one batch; a row whose
    instruction leaves no room for its text in the width is counted bad in ``stats``."""
    head = [tok.bos_id] if bos else []
    tail = [tok.eos_id] if eos else []
    t = settings.slots
    slots, _ = _tokenize(tok, [x for r in rows for x in r.texts], [p for r in rows for p in r.prefixes],
                         settings.width, head, tail)
    samples, tokens, cut, tasks = [], 0, 0, {}
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
        tasks[row.task] = tasks.get(row.task, 0) + 1
    return samples, tokens, cut, tasks
