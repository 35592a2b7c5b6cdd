"""Training objectives by name; the trainer builds them once from their typed configs and the tokenizer."""

from __future__ import annotations

from pipeline.objectives.base import (
    BaseConfig,
    MaskedConfig,
    MaskedObjective,
    Masking,
    MaskingConfig,
    Objective,
    ObjectiveOutput,
)
from pipeline.objectives.clm import CLM, CLMConfig
from pipeline.objectives.magnet import Magnet, MagnetConfig
from pipeline.objectives.mlm import MLM, MLMConfig
from pipeline.objectives.mntp import MNTP, MNTPConfig
from pipeline.objectives.simcse import SimCSE, SimCSEConfig
from pipeline.objectives.sscl import SSCL, SSCLConfig
from pipeline.objectives.supervised import Supervised, SupervisedConfig
from pipeline.tokenizer import Tokenizer

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (CLM, MLM, MNTP, Magnet, SSCL, SimCSE, Supervised)}
# an experiment's objective: its ``name`` picks the config (pipeline.config.from_tagged)
ObjectiveConfig = (CLMConfig | MLMConfig | MNTPConfig | MagnetConfig | SSCLConfig | SimCSEConfig
                   | SupervisedConfig)

__all__ = ["CLM", "MLM", "MNTP", "OBJECTIVES", "SSCL", "BaseConfig", "CLMConfig", "MLMConfig", "MNTPConfig", "Magnet",
           "MagnetConfig", "MaskedConfig", "MaskedObjective", "Masking", "MaskingConfig", "Objective",
           "ObjectiveConfig", "ObjectiveOutput", "SSCLConfig", "SimCSE", "SimCSEConfig", "Supervised",
           "SupervisedConfig", "make_objective"]


def make_objective(config: ObjectiveConfig, tokenizer: Tokenizer | None = None,
                   document_masking: bool = True) -> Objective:
    """The objective of ``config``; objectives that mask or encode text need the data's ``tokenizer``."""
    return OBJECTIVES[config.name].build(config, tokenizer, document_masking)
