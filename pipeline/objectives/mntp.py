"""Masked next-token prediction (LLM2Vec): bidirectional attention, masked input, and the masked token at i
predicted from the hidden state at i - 1, so the model keeps the next-token head layout it was pretrained with.

A masked token at a document start (position 0 or the first token of a packed document) has no predecessor in
its document and is not a target; it stays masked in the input, so the corruption matches the plan's ratio.
"""

from __future__ import annotations

from pipeline.data.loading.batch import Batch
from pipeline.objectives.base import MaskedObjective, Targets, next_token_targets


class MNTP(MaskedObjective):
    name = "mntp"
    predicts_next = True

    def targets(self, batch: Batch) -> Targets:
        masked_ids, is_target = self.masking.apply(batch)
        return next_token_targets(masked_ids, batch.input_ids, batch.doc_ids, is_target)
