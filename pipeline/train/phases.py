"""A phase's objectives, built once from the experiment config and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.objectives import MaskingConfig, Objective, make_objective
from pipeline.train.experiment import PhaseSpec


@dataclass(frozen=True)
class WeightedObjective:
    name: str
    weight: float
    objective: Objective


def build_objectives(phase: PhaseSpec, tokenizer) -> list[WeightedObjective]:
    out = []
    for spec in phase.objectives:
        masking = None if spec.name == "clm" else MaskingConfig(spec.ratio, spec.policy, spec.mask_token)
        obj = make_objective(spec.name, tokenizer=tokenizer, masking=masking,
                             document_masking=phase.document_masking)
        out.append(WeightedObjective(spec.name, spec.weight, obj))
    return out
