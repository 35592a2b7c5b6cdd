"""Training objectives by name; the trainer builds them once from the experiment config and the tokenizer."""

from __future__ import annotations

from pipeline.objectives.base import MaskedObjective, Masking, MaskingConfig, Objective, ObjectiveOutput
from pipeline.objectives.clm import CLM
from pipeline.objectives.magnet import Magnet
from pipeline.objectives.mlm import MLM
from pipeline.objectives.mntp import MNTP
from pipeline.objectives.simcse import SimCSE
from pipeline.objectives.sscl import SSCL
from pipeline.tokenizer import Tokenizer

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (CLM, MLM, MNTP, Magnet, SSCL, SimCSE)}

__all__ = ["CLM", "MLM", "MNTP", "OBJECTIVES", "SSCL", "Magnet", "Masking", "MaskingConfig", "Objective",
           "ObjectiveOutput", "SimCSE", "make_objective"]


def make_objective(name: str, *, tokenizer: Tokenizer | None = None,
                   masking: MaskingConfig | None = None, document_masking: bool = True, **options) -> Objective:
    """The objective ``name``; masked objectives resolve ``masking`` (default ``MaskingConfig()``) with ``tokenizer``.

    ``options`` are the objective's own settings (the experiment's ``objectives[i].options``); objectives that
    take any receive them with the tokenizer as keyword arguments, and an unknown option is an error naming it.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known objectives: {', '.join(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    if issubclass(cls, MaskedObjective):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"objective {name!r} needs the data's pipeline.tokenizer.Tokenizer (load_tokenizer(path)) "
                            f"to resolve its mask token and random-replacement ids, got {type(tokenizer).__name__}")
        return cls(Masking.resolve(masking or MaskingConfig(), tokenizer), document_masking=document_masking,
                   **options)
    if masking is not None:
        raise ValueError(f"objective {name!r} does not mask its input; remove its masking settings")
    if options or getattr(cls, "takes_tokenizer", False):
        return cls(tokenizer=tokenizer, document_masking=document_masking, **options)
    return cls(document_masking=document_masking)
