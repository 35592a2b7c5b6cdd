"""The micro-batch the loader hands to the objectives: shard samples stacked into [B, L] tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from pipeline.data.format.sample import UNMASKABLE, Sample


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L] token ids; padding is the tokenizer's pad id
    doc_ids: torch.Tensor  # int32 [B, L] index of the document piece (segment) in its sample, -1 on padding
    mask_rank: torch.Tensor  # int32 [B, L] masking-plan rank, format.UNMASKABLE (65535) where never masked
    mask_draw: torch.Tensor  # int64 [B, L] replacement draw (the shard's uint32)
    span_ids: torch.Tensor  # int32 [B, L] index of the MAGNET span holding the position, -1 on context
    keys: list[str]  # sample keys, to trace a batch back to its shard samples
    # int64 [B, L] the units' paraphrases (MAGNET's x+), wrapped and padded like input_ids; None when the shards
    # carry none (built without --paraphrase-field)
    paraphrase_ids: torch.Tensor | None = None
    # pairs shards only (build_shards.py --pairs): int64 [B, t, 2] each slot's pooled text tokens (positions in the
    # sample) and int64 [B, t] each slot's text hash; None for other shards
    pool_spans: torch.Tensor | None = None
    text_hash: torch.Tensor | None = None
    # int64 [B] each row's source (its position in the shard directory's sorted sources), -1 on padding rows; None
    # when the directory has one source
    source_ids: torch.Tensor | None = None
    # the batch this one was copied from on the host (``to``): what the objectives and the attention decide on
    # without reading the device back (a read waits for everything queued there)
    host: Batch | None = field(default=None, repr=False, compare=False)

    def _map(self, fn) -> Batch:
        return Batch(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                        for f in fields(self) if f.name not in ("keys", "host")}, keys=self.keys)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        moved = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        moved.host = self.on_host()
        return moved

    def on_host(self) -> Batch | None:
        """The batch's values on the host: itself when it is there, else the copy it was moved from, else None."""
        return self if self.doc_ids.device.type == "cpu" else self.host

    def host_values(self) -> Batch:
        """:meth:`on_host`, or, for a batch made on the device, its values read back (one read of the device)."""
        host = self.on_host()
        return host if host is not None else self.to("cpu")

    def pin_memory(self) -> Batch:
        """Called by DataLoader(pin_memory=True) so host-to-GPU copies can be asynchronous."""
        return self._map(torch.Tensor.pin_memory)

    def rows(self, begin: int, end: int) -> Batch:
        """Rows ``begin:end`` (views), their host copy's too (GradCache's token-budget chunks)."""
        out = self._map(lambda t: t[begin:end])
        out.keys, out.host = self.keys[begin:end], None if self.host is None else self.host.rows(begin, end)
        return out


def cat_rows(batches: list[Batch]) -> Batch:
    """The rows of ``batches`` (one seq_len, the same fields set) in order in one batch, their host copies' too
    where every batch has one."""
    values = {f.name: None if getattr(batches[0], f.name) is None else torch.cat([getattr(b, f.name) for b in batches])
              for f in fields(Batch) if f.name not in ("keys", "host")}
    hosts = [b.host for b in batches]
    return Batch(**values, keys=[k for b in batches for k in b.keys],
                 host=cat_rows(hosts) if all(h is not None for h in hosts) else None)


def _interval_ids(intervals: np.ndarray, out: np.ndarray) -> None:
    """Write into ``out`` (pre-filled with -1) the index of the [start, end) interval holding each position."""
    for k, (start, end) in enumerate(intervals):
        out[start:end] = k


def _paraphrases(samples: list[Sample]) -> torch.Tensor | None:
    """int64 [B, L] paraphrase ids, or None when no sample has one. A padding row (key "") has none and gets its
    own all-padding ids; any other sample without one means shard directories were mixed."""
    if all(s.paraphrase is None for s in samples):
        return None
    missing = [s.key for s in samples if s.paraphrase is None and s.key]
    if missing:
        raise ValueError(f"samples {missing[:3]} have no paraphrase while others in their batch do; build every unit "
                         f"shard of a directory with the same --paraphrase-field")
    return torch.from_numpy(np.stack([s.input_ids if s.paraphrase is None else s.paraphrase
                                      for s in samples]).astype(np.int64))


def _plan(samples: list[Sample], name: str, fill: int, dtype) -> torch.Tensor:
    """A masking-plan member stacked; pairs samples have none and read as never masked (``fill``)."""
    seq_len = len(samples[0].input_ids)
    return torch.from_numpy(np.stack([np.full(seq_len, fill) if getattr(s, name) is None else getattr(s, name)
                                      for s in samples]).astype(dtype))


def _pairs(samples: list[Sample]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if all(s.pool_spans is None for s in samples):
        return None, None
    if any(s.pool_spans is None for s in samples):
        raise ValueError(f"samples {[s.key for s in samples if s.pool_spans is None][:3]} are not pairs samples "
                         f"while others in their batch are; point data.pair_shards at shards built with --pairs")
    return (torch.from_numpy(np.stack([s.pool_spans for s in samples]).astype(np.int64)),
            torch.from_numpy(np.stack([s.text_hash for s in samples])))


def collate(samples: list[Sample]) -> Batch:
    """Stack samples (all of one seq_len) into a Batch; widens the shard dtypes to what torch indexes with."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    input_ids = np.stack([s.input_ids for s in samples]).astype(np.int64)
    doc_ids = np.full(input_ids.shape, -1, dtype=np.int32)
    span_ids = np.full(input_ids.shape, -1, dtype=np.int32)
    for row, sample in enumerate(samples):
        _interval_ids(sample.segments, doc_ids[row])
        _interval_ids(sample.spans, span_ids[row])
    pool_spans, text_hash = _pairs(samples)
    return Batch(input_ids=torch.from_numpy(input_ids), doc_ids=torch.from_numpy(doc_ids),
                 mask_rank=_plan(samples, "mask_rank", UNMASKABLE, np.int32),
                 mask_draw=_plan(samples, "mask_draw", 0, np.int64),
                 span_ids=torch.from_numpy(span_ids), keys=[s.key for s in samples],
                 paraphrase_ids=_paraphrases(samples), pool_spans=pool_spans, text_hash=text_hash)
