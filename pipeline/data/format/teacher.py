"""A teacher's embeddings of pair shards, stored once beside them (``data_prep/teacher_embed.py``) so distillation
(the ``distill`` objective) trains without the teacher in memory or in the step.

A teacher directory (default ``<pair shards>/teacher``) holds ``teacher.json`` (:data:`RECORD`: the teacher's path,
how it was read, its dims, pooling and normalisation, and the fingerprint and sample count of the shards it
embedded), ``keys.npy`` (each row's sample key, in the shards' sample order) and one float32 ``<slot>.npy`` [N, dim]
per text column (``query``, ``positive``, ``negative1`` ...). Rows are looked up by sample key, so any loader order,
mixture or resume reads the right ones; the record's fingerprint ties them to the shards they were made from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from pipeline.io import read_json

RECORD = "teacher.json"
KEYS = "keys.npy"


def slot_names(slots: int) -> list[str]:
    """The text columns of a pairs sample of ``slots`` slots: query, positive, then its negatives."""
    return ["query", "positive", *(f"negative{k}" for k in range(1, slots - 1))]


def default_directory(shards: str) -> str:
    return os.path.join(shards.rstrip("/"), "teacher")


class TeacherError(ValueError):
    """A teacher directory that does not hold, or does not match, what reads it; the message is one line."""


@dataclass(frozen=True)
class TeacherEmbeddings:
    """A teacher directory, read: its record, each sample key's row, and the [N, slots, dim] embeddings."""

    directory: str
    record: dict
    rows: dict[str, int]
    embeddings: np.ndarray  # float32 [N, slots, dim]

    @property
    def dim(self) -> int:
        return self.embeddings.shape[-1]

    def lookup(self, keys: list[str]) -> np.ndarray:
        """float32 [len(keys), slots, dim]: each key's row; a key the teacher never embedded is a TeacherError."""
        missing = [k for k in keys if k not in self.rows]
        if missing:
            raise TeacherError(f"{self.directory}: no teacher embedding for sample {missing[0]}; re-run "
                               "data_prep/teacher_embed.py on the pair shards this run reads")
        return self.embeddings[[self.rows[k] for k in keys]]


def check_teacher(directory: str, fingerprint: str, samples: int, slots: int) -> dict:
    """The record of ``directory``, checked against the pair shards (their ``fingerprint``, ``samples`` and
    ``slots``): a missing file, other shards or another row count is a one-line :class:`TeacherError`."""
    fix = "run data_prep/teacher_embed.py --shards <data.pair_shards> --model <teacher>"
    path = os.path.join(directory, RECORD)
    if not os.path.isfile(path):
        raise TeacherError(f"{path}: no teacher record; {fix}")
    record = read_json(path, fix, error=TeacherError)
    if record.get("shards_fingerprint") != fingerprint:
        embedded = str(record.get("shards_fingerprint"))[:12]
        raise TeacherError(f"{path}: the teacher embedded shards of fingerprint {embedded}, but data.pair_shards has "
                           f"{fingerprint[:12]}; {fix} again")
    if record.get("samples") != samples:
        raise TeacherError(f"{path}: {record.get('samples')} teacher rows, but data.pair_shards holds {samples} "
                           f"samples; {fix} again")
    for name in [KEYS[:-4], *slot_names(slots)]:
        if not os.path.isfile(os.path.join(directory, f"{name}.npy")):
            raise TeacherError(f"{os.path.join(directory, name)}.npy: missing (the shards have {slots} text columns); "
                               f"{fix} again")
    return record


def read_record(directory: str) -> dict:
    """``directory``'s teacher.json (a TeacherError where it is missing or not JSON)."""
    path = os.path.join(directory, RECORD)
    if not os.path.isfile(path):
        raise TeacherError(f"{path}: no teacher record; run data_prep/teacher_embed.py on the pair shards")
    return read_json(path, "run data_prep/teacher_embed.py on the pair shards", error=TeacherError)


def teacher_dim(directory: str) -> int:
    """The teacher's embedding width, from its record alone."""
    return int(read_record(directory)["dim"])


def load_teacher(directory: str, slots: int) -> TeacherEmbeddings:
    """The embeddings of ``directory`` (its record's own checks: files present, every column N rows of one dim)."""
    record = read_record(directory)
    check_teacher(directory, record.get("shards_fingerprint", ""), record.get("samples"), slots)
    keys = np.load(os.path.join(directory, KEYS))
    columns = [np.load(os.path.join(directory, f"{n}.npy"), mmap_mode="r") for n in slot_names(slots)]
    bad = [n for n, c in zip(slot_names(slots), columns) if c.shape != (len(keys), record["dim"])]
    if bad:
        raise TeacherError(f"{os.path.join(directory, bad[0])}.npy: not [{len(keys)}, {record['dim']}] float32 as "
                           f"{RECORD} records; re-run data_prep/teacher_embed.py")
    embeddings = np.stack(columns, axis=1).astype(np.float32)
    return TeacherEmbeddings(directory, record, {str(k): i for i, k in enumerate(keys)}, embeddings)
