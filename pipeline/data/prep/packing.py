"""Concat-and-chunk packing of one input file's documents into fixed-length samples with document boundaries."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import takewhile

import numpy as np

REMAINDER_POLICIES = ("drop", "pad")


class Packer:
    """Concatenates documents (each wrapped in BOS/EOS when given) and cuts the stream into ``seq_len`` samples.

    Long documents are split across samples; each sample records its document pieces as [start, end) segments, so a
    segment that starts at 0 may continue the previous sample's last document. At the end of the file, ``finish``
    drops the remainder or pads it with ``pad_id`` (padding lies outside every segment).

    Each document is converted to int32 once, on arrival, and samples are cut from those arrays: converting the
    tokenizer's Python ints is most of packing's cost, and a Python-list buffer paid it again on every slice.
    """

    def __init__(self, seq_len: int, pad_id: int, bos_id: int | None, eos_id: int | None, remainder: str):
        if remainder not in REMAINDER_POLICIES:
            raise ValueError(f"remainder must be one of {REMAINDER_POLICIES}, got {remainder!r}")
        self.seq_len, self.pad_id, self.bos_id, self.eos_id, self.remainder = seq_len, pad_id, bos_id, eos_id, remainder
        self._pieces: deque[np.ndarray] = deque()  # buffered tokens, in stream order
        self._buffered = 0  # tokens in _pieces
        self._pos = 0  # stream position of the first buffered token
        self._starts: deque[int] = deque()  # stream positions where a document begins

    def add(self, doc_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        bos, eos = int(self.bos_id is not None), int(self.eos_id is not None)
        doc = np.empty(bos + len(doc_ids) + eos, dtype=np.int32)
        doc[bos : len(doc) - eos] = doc_ids
        if bos:
            doc[0] = self.bos_id
        if eos:
            doc[-1] = self.eos_id
        self._starts.append(self._pos + self._buffered)
        self._pieces.append(doc)
        self._buffered += len(doc)
        out = []
        while self._buffered >= self.seq_len:
            out.append(self._emit(self.seq_len))
        return out

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        out = [self._emit(self._buffered)] if self._buffered and self.remainder == "pad" else []
        self._pieces, self._buffered, self._pos, self._starts = deque(), 0, 0, deque()
        return out

    def _emit(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.empty(self.seq_len, dtype=np.int32)
        ids[n:] = self.pad_id
        filled = 0
        while filled < n:
            piece = self._pieces[0]
            take = min(n - filled, len(piece))
            ids[filled : filled + take] = piece[:take]
            if take == len(piece):
                self._pieces.popleft()
            else:
                self._pieces[0] = piece[take:]
            filled += take
        lo, hi = self._pos, self._pos + n
        while self._starts and self._starts[0] <= lo:
            self._starts.popleft()
        bounds = [0, *(s - lo for s in takewhile(lambda s: s < hi, self._starts)), n]
        segments = np.array(list(zip(bounds[:-1], bounds[1:])), dtype=np.int32).reshape(-1, 2)
        self._pos, self._buffered = hi, self._buffered - n
        return ids, segments
