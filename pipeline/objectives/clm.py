"""Causal language modelling: causal attention, position i predicts token i + 1 of the same document.

Targets never cross a document boundary, with or without document masking: the first token of the next
document (its BOS after the previous EOS) is either unpredictable or trivially predictable, so it carries no
signal. Padding is never a target.
"""

from __future__ import annotations

from pipeline.data.loading.batch import Batch
from pipeline.objectives.base import Objective, Targets, next_token_targets


class CLM(Objective):
    name = "clm"
    causal = True
    predicts_next = True

    def targets(self, batch: Batch) -> Targets:
        return next_token_targets(batch.input_ids, batch.input_ids, batch.doc_ids, batch.doc_ids >= 0)
