"""Concat-and-chunk packing of one input file's documents into fixed-length samples with document boundaries."""

from __future__ import annotations

from collections import deque
from itertools import takewhile

import numpy as np

REMAINDER_POLICIES = ("drop", "pad")


class Packer:
    """Concatenates documents (each wrapped in BOS/EOS when given) and cuts the stream into ``seq_len`` samples.

    Long documents are split across samples; each sample records its document pieces as [start, end) segments, so a
    segment that starts at 0 may continue the previous sample's last document. At the end of the file, ``finish``
    drops the remainder or pads it with ``pad_id`` (padding lies outside every segment).
    """

    def __init__(self, seq_len: int, pad_id: int, bos_id: int | None, eos_id: int | None, remainder: str):
        if remainder not in REMAINDER_POLICIES:
            raise ValueError(f"remainder must be one of {REMAINDER_POLICIES}, got {remainder!r}")
        self.seq_len, self.pad_id, self.bos_id, self.eos_id, self.remainder = seq_len, pad_id, bos_id, eos_id, remainder
        self._buf: list[int] = []
        self._pos = 0  # read pointer into _buf; compacted lazily so long documents stay O(n)
        self._starts: deque[int] = deque()  # absolute _buf positions where a document begins

    def add(self, doc_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        self._starts.append(len(self._buf))
        if self.bos_id is not None:
            self._buf.append(self.bos_id)
        self._buf.extend(doc_ids)
        if self.eos_id is not None:
            self._buf.append(self.eos_id)
        out = []
        while len(self._buf) - self._pos >= self.seq_len:
            out.append(self._emit(self.seq_len))
        if self._pos > (1 << 20):
            self._compact()
        return out

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        n = len(self._buf) - self._pos
        out = [self._emit(n)] if n and self.remainder == "pad" else []
        self._buf, self._pos, self._starts = [], 0, deque()
        return out

    def _emit(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._pos, self._pos + n
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        ids[:n] = self._buf[lo:hi]
        while self._starts and self._starts[0] <= lo:
            self._starts.popleft()
        bounds = [0, *(s - lo for s in takewhile(lambda s: s < hi, self._starts)), n]
        segments = np.array(list(zip(bounds[:-1], bounds[1:])), dtype=np.int32).reshape(-1, 2)
        self._pos = hi
        return ids, segments

    def _compact(self) -> None:
        del self._buf[: self._pos]
        self._starts = deque(s - self._pos for s in self._starts)
        self._pos = 0
