"""LLM2Vec's unsupervised SimCSE: a sentence unit against itself, the two views differing by dropout alone.

The batch's units run through the model twice in one forward pass (the batch stacked on itself), with
bidirectional attention and attention-probability dropout (``model.attention_dropout``, 0.3 in LLM2Vec), so each
copy of a unit draws its own dropout mask: the two views of two separate passes, at one pass's cost. Each view is
mean-pooled, and InfoNCE on cosine similarity (``scale`` 20, i.e. tau = 0.05) makes the first copy of each unit pick
its second copy among the second copies of every unit of the global batch (``info_nce``: negatives all-gathered
across ranks with gradient; one direction, as LLM2Vec's ``HardNegativeNLLLoss``).

Pooling is the mean over the unit's text tokens: padding, BOS and EOS are left out, as LLM2Vec's ``encode()`` pools
at inference (its ``embed_mask`` covers the text alone). LLM2Vec's SimCSE training differs by a quirk: its
collator leaves ``embed_mask`` empty, so training pools every position of the left-padded row, padding included.
Pooling what inference pools keeps training and use consistent and makes a unit's embedding independent of how
much padding its batch has.

There is no projection head and no instruction: the embedding is the model's own, as in LLM2Vec.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from pipeline.data.format.index import ShardKind
from pipeline.data.loading.batch import Batch
from pipeline.objectives.base import Objective, ObjectiveOutput
from pipeline.objectives.configs import SimCSEConfig
from pipeline.objectives.infonce import info_nce
from pipeline.tokenizer import Tokenizer


def check_units(batch: Batch, objective: str) -> None:
    """Refuse packed samples: a sentence-unit objective needs one unit (one segment) per sample. Checked on the
    batch's host values (no read of the device where the loader's copy is there)."""
    packed = (batch.host_values().doc_ids.numpy() > 0).any(-1)
    if packed.any():
        keys = [k for k, bad in zip(batch.keys, packed) if bad][:3]
        raise ValueError(f"{objective} reads sentence units (one per sample), but samples {keys} hold several "
                         "documents: point data.unit_shards at shards built with data_prep/build_shards.py --units")


def rows_index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 indices of the True entries of host bools ``rows``, on ``device`` in a non-blocking copy: an index that
    selects them without the device read of a boolean index (``nonzero``)."""
    return torch.from_numpy(np.flatnonzero(rows)).to(device, non_blocking=True)


def mean_pool(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B, d] mean of ``hidden`` [B, L, d] over the positions where ``keep`` [B, L] is True (zero for none)."""
    weights = keep.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)

class SimCSE(Objective):
    name = "simcse"
    shard_kind = ShardKind.UNITS
    predicts_tokens = False
    needs_tokenizer = "to know which tokens are special (pooling leaves them out)"

    def __init__(self, config: SimCSEConfig, tokenizer: Tokenizer, document_masking: bool = True):
        """The tokenizer names the special ids that pooling leaves out."""
        super().__init__(config, document_masking)
        self.scale, self.matryoshka = config.scale, config.matryoshka
        self.special_ids = torch.tensor(tokenizer.special_ids, dtype=torch.long)
        self.host_special_ids = np.array(tokenizer.special_ids, dtype=np.int64)
        self._special_on: dict[torch.device, torch.Tensor] = {}  # copied to each device once (a copy waits)

    def text_tokens(self, batch: Batch) -> torch.Tensor:
        """Bool [B, L]: the units' text tokens, the positions that are pooled."""
        device = batch.input_ids.device
        if device not in self._special_on:
            self._special_on[device] = self.special_ids.to(device)
        return (batch.doc_ids >= 0) & ~torch.isin(batch.input_ids, self._special_on[device])

    def num_targets(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One query per unit; padding rows (no text) have none."""
        return {self.name: self.text_tokens(batch).any(-1).sum()}

    def body_work(self, batch: Batch) -> torch.Tensor:
        """Two passes: the batch runs stacked on itself."""
        return 2 * super().body_work(batch)

    def __call__(self, model: PreTrainedModel, batch: Batch) -> dict[str, ObjectiveOutput]:
        check_units(batch, self.name)
        host = batch.host_values()
        host_ids = host.doc_ids.numpy()
        keep = self.text_tokens(batch)
        hidden = self.hidden_states(model, torch.cat([batch.input_ids, batch.input_ids]),
                                    torch.cat([batch.doc_ids, batch.doc_ids]),
                                    host_doc_ids=np.concatenate([host_ids, host_ids]))
        pooled = mean_pool(hidden, torch.cat([keep, keep]))
        with_text = (host_ids >= 0) & ~np.isin(host.input_ids.numpy(), self.host_special_ids)
        units = rows_index(with_text.any(-1), pooled.device)
        n = len(keep)
        return {self.name: info_nce(pooled[:n].index_select(0, units), pooled[n:].index_select(0, units), self.scale,
                                    matryoshka=self.matryoshka)}
