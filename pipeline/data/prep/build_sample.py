"""One packed (input_ids, segments) pair -> a complete shard Sample with its masking plan and MAGNET spans."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.data.format.masking import maskable_positions, plan_masks, regular_token_table, sample_rng
from pipeline.data.format.sample import Sample, sample_key
from pipeline.data.prep.spans import sample_spans


@dataclass(frozen=True)
class PlanSettings:
    seed: int
    special_ids: np.ndarray
    span_min: int = 8
    span_max: int = 32
    span_fraction: float = 0.15
    regular: np.ndarray = field(init=False, repr=False)  # regular_token_table(special_ids), built once

    def __post_init__(self) -> None:
        object.__setattr__(self, "regular", regular_token_table(self.special_ids))


def make_sample(input_ids: np.ndarray, segments: np.ndarray, file_index: int, sample_index: int,
                settings: PlanSettings, paraphrase: np.ndarray | None = None) -> Sample:
    """``paraphrase``: the unit's paraphrase ids, for unit shards built with a paraphrase field."""
    rng = sample_rng(settings.seed, file_index, sample_index)
    rank, draw = plan_masks(maskable_positions(input_ids, segments, settings.regular), rng)
    spans = sample_spans(segments, rng, settings.span_min, settings.span_max, settings.span_fraction)
    return Sample(sample_key(file_index, sample_index), input_ids, segments, rank, draw, spans, paraphrase)
