"""Masked language modelling: bidirectional attention, each masked token predicted at its own position."""

from __future__ import annotations

from pipeline.data.loading.batch import Batch
from pipeline.objectives.base import MaskedObjective, Targets


class MLM(MaskedObjective):
    name = "mlm"

    def targets(self, batch: Batch) -> Targets:
        masked_ids, is_target = self.masking.apply(batch)
        return Targets(input_ids=masked_ids, predict_at=is_target, labels=batch.input_ids)
