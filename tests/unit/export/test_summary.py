"""The model card's account of training in words (pipeline/export/summary.py): every registered objective has its
words, and the options that change what it trains are in them."""

from __future__ import annotations

import typing

from pipeline.config import from_tagged
from pipeline.export.summary import WORDS, objective_words
from pipeline.objectives import ObjectiveConfig

REQUIRED = {"distill": {"teacher": "runs/shards/pairs/teacher"}}  # fields without a default


def words(objective: dict) -> str:
    return objective_words(from_tagged(ObjectiveConfig, {**REQUIRED.get(objective["name"], {}), **objective}))


def test_every_registered_objective_has_its_words():
    """An objective added to ``ObjectiveConfig`` (pipeline/objectives/configs.py) without words in ``WORDS`` fails
    here, and so does words left behind for one that is gone."""
    registered = {typing.get_type_hints(c)["name"].__args__[0] for c in typing.get_args(ObjectiveConfig)}
    assert set(WORDS) == registered
    for name in registered:
        text = words({"name": name})
        assert len(text) > 2 * len(name) and "; loss weight" not in text, name
    assert words({"name": "clm", "weight": 0.5}).endswith("; loss weight 0.5")


def test_the_options_that_change_what_an_objective_trains_are_in_its_words():
    matryoshka = {"matryoshka": {"dims": [64, 32], "weights": [1.0, 0.5]}}
    for name in ("simcse", "sscl", "supervised"):
        assert "InfoNCE" in words({"name": name}) and "Matryoshka" not in words({"name": name}), name
        assert "summed over the leading 64, 32 dims (weights 1, 0.5) (Matryoshka" in words({"name": name, **matryoshka})
    assert "(Matryoshka" in words({"name": "simcse", "matryoshka": {"dims": [64]}})
    assert "weights" not in words({"name": "simcse", "matryoshka": {"dims": [64]}})
    supervised = words({"name": "supervised"})
    assert "its hard negatives and the batch's other positives the negatives" in supervised
    assert "left out" in supervised and "GradCache" not in supervised
    assert "its own hard negatives (no other rows')" in words({"name": "supervised", "in_batch_negatives": False})
    assert "the batch's other positives the negatives" in words({"name": "supervised", "hard_negatives": False})
    assert "left out" not in words({"name": "supervised", "mask_collisions": False})
    assert "(GradCache, a chunk per micro-batch)" in words({"name": "supervised", "grad_cache": True})
    assert "(GradCache, chunks of at most 4096 real tokens)" in words({"name": "supervised",
                                                                      "grad_cache": {"tokens": 4096}})
