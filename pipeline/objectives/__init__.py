"""Training objectives by name; the trainer builds them once from their typed configs and the tokenizer.

The configs (:mod:`pipeline.objectives.configs`) load eagerly and light; the objectives, which import torch and
transformers, load on first use of their names (PEP 562), so checking an experiment imports neither. An objective
is registered by its config alone: ``OBJECTIVES`` takes each config of ``ObjectiveConfig`` to the objective class
of its name in ``pipeline/objectives/<name>.py``."""

from __future__ import annotations

import importlib
import typing
from typing import TYPE_CHECKING, Any

from pipeline.objectives.configs import (
    BaseConfig,
    CLMConfig,
    DistillConfig,
    MagnetConfig,
    MaskedConfig,
    MLMConfig,
    MNTPConfig,
    ObjectiveConfig,
    SimCSEConfig,
    SSCLConfig,
    SupervisedConfig,
)

if TYPE_CHECKING:
    from pipeline.objectives.base import Objective
    from pipeline.tokenizer import Tokenizer

# each heavy name: the module that defines it
_LAZY = {"CLM": "clm", "Distill": "distill", "MLM": "mlm", "MNTP": "mntp", "Magnet": "magnet", "SSCL": "sscl",
         "SimCSE": "simcse", "Supervised": "supervised", "MaskedObjective": "base", "Masking": "base",
         "MaskingConfig": "base", "Objective": "base", "ObjectiveOutput": "base"}

__all__ = ["CLM", "MLM", "MNTP", "OBJECTIVES", "SSCL", "BaseConfig", "CLMConfig", "Distill", "DistillConfig",
           "MLMConfig", "MNTPConfig", "Magnet", "MagnetConfig", "MaskedConfig", "MaskedObjective", "Masking",
           "MaskingConfig", "Objective", "ObjectiveConfig", "ObjectiveOutput", "SSCLConfig", "SimCSE", "SimCSEConfig", "Supervised",
           "SupervisedConfig", "make_objective"]


def __getattr__(name: str) -> Any:
    """An objective's class (or ``OBJECTIVES``, each by its name), imported on first use."""
    if name == "OBJECTIVES":
        value: Any = {config.name: _objective(config.name) for config in typing.get_args(ObjectiveConfig)}
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"pipeline.objectives.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module 'pipeline.objectives' has no attribute {name!r}")
    globals()[name] = value
    return value


def _objective(name: str) -> type[Objective]:
    """The objective class named ``name`` in ``pipeline/objectives/<name>.py``, its config's name."""
    base = __getattr__("Objective")
    module = importlib.import_module(f"pipeline.objectives.{name}")
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, base)
             and c.__module__ == module.__name__ and getattr(c, "name", None) == name]
    if len(found) != 1:
        raise TypeError(f"{module.__file__} defines {len(found)} Objective classes named {name!r}; its config "
                        f"(ObjectiveConfig) needs exactly one")
    return found[0]


def make_objective(config: ObjectiveConfig, tokenizer: Tokenizer | None = None,
                   document_masking: bool = True) -> Objective:
    """The objective of ``config``; objectives that mask or encode text need the data's ``tokenizer``."""
    return __getattr__("OBJECTIVES")[config.name].build(config, tokenizer, document_masking)
