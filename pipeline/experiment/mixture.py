"""``data.mixture`` and ``data.pair_mixture`` typed: each source's ratio and maximum repetition, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.config import ConfigError, from_dict


@dataclass(frozen=True)
class MixtureSource:
    """One source of ``data.mixture`` (written ``SOURCE: ratio``, or ``SOURCE: {ratio: R, max_repetition: M}``)."""

    ratio: float  # target share of the run's training samples; the ratios of all sources sum to 1
    max_repetition: float | None = None  # times over its samples may be read (None: data.mixture_max_repetition)


MIN_RATIO = 1e-6  # mixture ratios are quantised to 2**-20 (pipeline.data.loading.mixture)


@dataclass(frozen=True)
class SourceMixture:
    """``data.mixture`` typed and checked once, when the experiment loads (:meth:`parse`): each source's ratio and
    maximum repetition (filled in from ``data.mixture_max_repetition``), sorted by name; empty: no mixture. The
    config keeps the mapping as written, so experiment files and ``--set data.mixture=...`` read and write as
    before."""

    sources: tuple[tuple[str, MixtureSource], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sources)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sources)

    @property
    def ratios(self) -> dict[str, float]:
        return {name: s.ratio for name, s in self.sources}

    @property
    def max_repetition(self) -> dict[str, float]:
        return {name: s.max_repetition for name, s in self.sources}

    @classmethod
    def parse(cls, mixture: dict[str, Any], max_repetition: float, setting: str = "data.mixture") -> SourceMixture:
        """``data.mixture`` (or ``setting``: ``data.pair_mixture``, whose sources are tasks) as written
        (``max_repetition``: ``data.mixture_max_repetition``), or a ConfigError."""
        out = {}
        for name in sorted(mixture):
            key, value = f"{setting}.{name}", mixture[name]
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{setting}: {name!r} is not a source name; the keys are source names as "
                                  f"data_prep recorded them (pipeline-inspect-shards lists them)")
            if isinstance(value, dict):
                src = from_dict(MixtureSource, value, key)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                src = MixtureSource(float(value))
            else:
                raise ConfigError(f"{key}: {value!r} is not a ratio; write {name}: 0.25 or "
                                  f"{name}: {{ratio: 0.25, max_repetition: 2}}")
            if not MIN_RATIO <= src.ratio <= 1:
                raise ConfigError(f"{key}: ratio {src.ratio} is out of range; it must be in [{MIN_RATIO:g}, 1] "
                                  f"(drop a source to leave it out)")
            repetition = max_repetition if src.max_repetition is None else src.max_repetition
            if not (math.isfinite(repetition) and repetition > 0):
                raise ConfigError(f"{key}.max_repetition: {repetition} is out of range; it must be > 0")
            out[name] = MixtureSource(src.ratio, float(repetition))
        total = sum(s.ratio for s in out.values())
        if out and not math.isclose(total, 1.0, abs_tol=1e-6):
            scaled = ", ".join(f"{n}: {s.ratio / total:.4g}" for n, s in out.items())
            raise ConfigError(f"{setting}: ratios must sum to 1, got {total:.6g}; e.g. {{{scaled}}}")
        return cls(tuple(out.items()))
