"""MAGNET's sentence-level self-supervised contrastive learning (SSCL).

A sentence unit x, prefixed with the instruction "Given the sentence, find its representation:", and its
augmented view x+ (prefixed the same way) run in one forward pass with bidirectional attention. The hidden state
of each view's last token (the unit's EOS when data prep adds one; it never takes part in MNTP) goes through the
projection head, and InfoNCE on cosine similarity pulls x towards its own x+ against the x+ of every other unit in
the global batch (``info_nce``: negatives gathered across ranks with gradient).

The projection head (``model.sscl_head``, attached before DeepSpeed wraps the model so it is trained and
checkpointed with it) is SimCSE's: ``Linear(d, d)`` then ``tanh``, d = hidden size (weight [d, d], bias [d]),
initialised to the identity so the first steps contrast tanh of the hidden states themselves, the same on every
rank without a broadcast. It serves the loss only: embeddings for evaluation are the last hidden states. The HF
export leaves it out.

x+ (``augment``):

- ``dropout`` (default): x+ is x again and only dropout differs (``model.attention_dropout`` must be > 0). The paper
  used a T5 paraphraser, which is not available offline; SimCSE found dropout noise alone beats deletion, cropping
  and word replacement for unsupervised sentence embeddings, so it is the best offline stand-in.
- ``delete``, ``crop``, ``swap``: token edits of about ``edit_ratio`` of the sentence (``augment.py``), seeded by the
  sample key and ``seed`` (no RNG in the loop, so a resumed run is exact); dropout, if on, applies as well.
- ``paraphrase``: precomputed paraphrase ids from the unit shards (``Batch.paraphrase_ids``; data prep's
  ``--units record --paraphrase-field``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from pipeline.data.format.index import ShardKind
from pipeline.data.loading.batch import Batch
from pipeline.model.flops import body_work
from pipeline.objectives.augment import edit_tokens
from pipeline.objectives.base import Objective, ObjectiveOutput
from pipeline.objectives.configs import INSTRUCTION as INSTRUCTION
from pipeline.objectives.configs import SSCLConfig
from pipeline.objectives.infonce import info_nce
from pipeline.objectives.simcse import check_units, rows_index
from pipeline.tokenizer import Tokenizer

HEAD = "sscl_head"

@dataclass
class SentenceViews:
    input_ids: torch.Tensor  # [2n, W] the n anchors (instruction + unit), then their n positives
    doc_ids: torch.Tensor  # [2n, W] 0 on tokens, -1 on padding (a row without a unit is all padding)
    last: torch.Tensor  # int64 [2n] position of each row's last token: its hidden state is the embedding
    valid: torch.Tensor  # bool [n] rows that hold a unit (the loader may fill a batch with empty rows)
    rows: torch.Tensor  # int64 the indices of ``valid`` (an index_select needs no read of the device)
    host_doc_ids: np.ndarray  # ``doc_ids`` on the host, where the views were built


class SSCL(Objective):
    name = "sscl"
    shard_kind = ShardKind.UNITS
    predicts_tokens = False
    needs_tokenizer = "to encode its instruction"

    def __init__(self, config: SSCLConfig, tokenizer: Tokenizer, document_masking: bool = True):
        super().__init__(config, document_masking)
        self.augment, self.edit_ratio, self.scale, self.seed = (config.augment, config.edit_ratio, config.scale,
                                                                config.seed)
        self.matryoshka = config.matryoshka
        self.prefix = np.asarray(tokenizer.encode_batch([config.instruction])[0], dtype=np.int64)
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id
        self.pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0

    def attach(self, model: PreTrainedModel) -> None:
        d = model.config.hidden_size
        head = nn.Sequential(nn.Linear(d, d), nn.Tanh()).to(model.dtype)
        with torch.no_grad():
            head[0].weight.copy_(torch.eye(d))
            head[0].bias.zero_()
        model.add_module(HEAD, head)
        # the HF export is the encoder/decoder itself; HF would load the head's weights as unexpected keys
        model._keys_to_ignore_on_save = [*(model._keys_to_ignore_on_save or ()),
                                         *(f"{HEAD}.{k}" for k in head.state_dict())]

    def _wrap(self, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(BOS if the unit has one, the unit's text tokens, EOS if it has one)."""
        start = int(len(unit) > 0 and unit[0] == self.bos)
        end = len(unit) - int(len(unit) > start and unit[-1] == self.eos)
        return unit[:start], unit[start:end], unit[end:]

    def _positive(self, text: np.ndarray, batch: Batch, row: int) -> np.ndarray:
        if self.augment == "dropout":
            return text
        if self.augment == "paraphrase":
            if batch.paraphrase_ids is None:
                raise ValueError("sscl: augment is 'paraphrase' but the unit shards carry no paraphrases; "
                                 "build them with data_prep/build_shards.py --units record --paraphrase-field FIELD "
                                 "from records that hold a paraphrase, or pick augment dropout, delete, crop or swap")
            paraphrase = batch.paraphrase_ids.numpy()[row]
            paraphrase = self._wrap(paraphrase[paraphrase != self.pad])[1]
            if not len(paraphrase):
                raise ValueError(f"sample {batch.keys[row]}: its paraphrase is empty; fix the input record's "
                                 "paraphrase field (or drop the record)")
            return paraphrase
        return edit_tokens(self.augment, text, self.edit_ratio, batch.keys[row], self.seed)

    def views(self, batch: Batch) -> SentenceViews:
        """The instruction-prefixed anchors and positives of the batch's units, right-padded into one tensor."""
        check_units(batch, self.name)
        device, batch = batch.input_ids.device, batch.host_values()  # built on the host, copied over non-blocking
        ids, docs = batch.input_ids.numpy(), batch.doc_ids.numpy()
        anchors: list[np.ndarray] = []
        positives: list[np.ndarray] = []
        for row in range(len(ids)):
            head, text, tail = self._wrap(ids[row][docs[row] >= 0])
            if not len(head) + len(text) + len(tail):
                anchors.append(np.zeros(0, np.int64))
                positives.append(anchors[-1])
                continue
            anchors.append(np.concatenate([head, self.prefix, text, tail]))
            positives.append(np.concatenate([head, self.prefix, self._positive(text, batch, row), tail]))
        rows = anchors + positives
        width = max(1, *(len(r) for r in rows))
        input_ids = np.full((len(rows), width), self.pad, dtype=np.int64)
        doc_ids = np.full((len(rows), width), -1, dtype=np.int32)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = r
            doc_ids[i, : len(r)] = 0
        valid = np.array([len(r) > 0 for r in anchors], dtype=bool)
        return SentenceViews(input_ids=torch.from_numpy(input_ids).to(device, non_blocking=True),
                             doc_ids=torch.from_numpy(doc_ids).to(device, non_blocking=True), host_doc_ids=doc_ids,
                             last=torch.tensor([max(len(r) - 1, 0) for r in rows]).to(device, non_blocking=True),
                             valid=torch.from_numpy(valid).to(device, non_blocking=True),
                             rows=rows_index(valid, device))

    def num_targets(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One query per unit."""
        return {self.name: (batch.doc_ids >= 0).any(-1).sum()}

    def body_work(self, batch: Batch) -> torch.Tensor:
        """Two views of each unit, the instruction prepended to both; the positive counted at the anchor's length
        (exact for dropout and swap; an edit or a paraphrase changes it a little), so no views are built here."""
        units = (batch.doc_ids >= 0).sum(-1)
        return 2 * body_work(torch.where(units > 0, units + len(self.prefix), 0))

    def __call__(self, model: PreTrainedModel, batch: Batch) -> dict[str, ObjectiveOutput]:
        views = self.views(batch)
        hidden = self.hidden_states(model, views.input_ids, views.doc_ids, host_doc_ids=views.host_doc_ids)
        embeddings = getattr(model, HEAD)(hidden[torch.arange(len(views.last), device=hidden.device), views.last])
        n = len(views.valid)
        return {self.name: info_nce(embeddings[:n].index_select(0, views.rows),
                                    embeddings[n:].index_select(0, views.rows), self.scale,
                                    matryoshka=self.matryoshka)}
