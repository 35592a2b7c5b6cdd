"""A phase's objectives, built once from the experiment config and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.objectives import OBJECTIVES, MaskedObjective, MaskingConfig, Objective, make_objective
from pipeline.train.experiment import PhaseSpec


@dataclass(frozen=True)
class WeightedObjective:
    name: str
    weight: float
    objective: Objective


def build_objectives(phase: PhaseSpec, tokenizer) -> list[WeightedObjective]:
    out = []
    for spec in phase.objectives:
        masked = issubclass(OBJECTIVES[spec.name], MaskedObjective)
        masking = MaskingConfig(spec.ratio, spec.policy, spec.mask_token) if masked else None
        try:
            obj = make_objective(spec.name, tokenizer=tokenizer, masking=masking,
                                 document_masking=phase.document_masking, **spec.options)
        except TypeError as e:  # an option the objective does not take
            raise ConfigError(f"phase {phase.name!r}, objective {spec.name}: bad options {spec.options} ({e})") from e
        out.append(WeightedObjective(spec.name, spec.weight, obj))
    return out
