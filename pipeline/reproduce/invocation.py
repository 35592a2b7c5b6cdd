"""One ``make reproduce`` invocation checked and resolved (:class:`Reproduction`): the scale, its studies, the device,
where runs, records and page go, and each study's runs at the scale."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipeline.grid import Variant, load_grid
from pipeline.io import REPO, repo_relative
from pipeline.reproduce.studies import STUDIES, Study

SCALES = ("full", "quick", "paper", "gpu-short")
DEVICES = ("auto", "cuda", "cpu")


def resolve_device(device: str) -> str:
    """``--device``: "auto" is the GPU where torch sees one, else the CPU; "cuda" without a GPU is an error."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False); run on a GPU "
                         "machine or pass --device cpu")
    return device


@dataclass(frozen=True)
class Reproduction:
    """What one invocation reproduces, and where: the scale, its studies, the device, the run directories (OUT),
    the records (RESULTS/SCALE) and the page."""

    mode: str  # the scale
    out: str  # run directories: relative to the repository when inside it, as the records name them
    results: str  # RESULTS/SCALE
    page: str
    device: str  # resolved: cuda or cpu
    studies: tuple[Study, ...]
    seeds: bool = False  # train the studies' extra seeds alone, seed 0 read beside them (make reproduce-seeds)
    records: bool = False  # --from-records: the page from RESULTS/SCALE's records; nothing trains

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @property
    def logs(self) -> str:
        return os.path.join(self.results, "logs")

    @property
    def timings(self) -> str:
        """The name of the seconds' files (OUT's ledger, RESULTS/SCALE's record): the extra seeds' apart from the
        run that made seed 0, so neither overwrites the other's."""
        return "timings-seeds.json" if self.seeds else "timings.json"

    @property
    def ledger(self) -> str:
        """Every invocation's seconds per stage into OUT, summed (from records: their own, apart)."""
        return os.path.join(self.out, "timings-from-records.json" if self.records else self.timings)

    @property
    def baselines(self) -> str:
        """Where the untrained baselines' results are written: OUT's, or the records' when reading those (and
        with --seeds, which reads seed 0's runs and the baselines beside its own)."""
        return os.path.join(self.results if self.records or self.seeds else self.out, "baselines")


def reproduction(scale: str, out: str, results: str, page: str, studies: list[str],
                 device: str = "auto", seeds: bool = False, records: bool = False) -> Reproduction:
    """The invocation checked: a known scale, studies that have a grid at it, a device torch can use."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: expected one of {', '.join(SCALES)}")
    chosen = tuple(s for s in STUDIES if s.name in studies)
    if seeds and (unseeded := [s.name for s in chosen if not s.extra_seeds]):
        raise ValueError(f"--seeds --study {', '.join(unseeded)}: that study has no extra seeds (its grid trains its "
                         "own); pass " + " and ".join(f"--study {s.name}" for s in STUDIES if s.extra_seeds))
    if without := [s.name for s in chosen if not s.grid_for(scale)]:
        have = [s.name for s in STUDIES if s.grid_for(scale)]
        raise ValueError(f"--study {', '.join(without)}: no {scale} grid; at --scale {scale} pass "
                         + " or ".join(f"--study {n}" for n in have) + " (or no --study)")
    return Reproduction(scale, repo_relative(out), os.path.abspath(os.path.join(results, scale)),
                        os.path.abspath(page), resolve_device(device), chosen, seeds, records)


def variants(r: Reproduction, study: Study) -> list[Variant]:
    """The runs of the study's grid at this scale (the -smoke twins in quick mode), resolved and validated."""
    return load_grid(os.path.join(REPO, study.grid_for(r.mode))).variants(smoke=r.quick, out=r.out)


def chosen_runs(r: Reproduction, study: Study) -> list[str]:
    """The sweep's --only for the study: with --seeds its extra seeds alone, else every run of its grid but those;
    [] (every run) for a study without extra seeds."""
    if not study.extra_seeds:
        return []
    return [v.name for v in variants(r, study) if study.is_extra_seed(v.name) == r.seeds]


def gpu_grids(r: Reproduction) -> list[str]:
    """The selected studies' grids at this scale whose runs declare GPU ranks (the paper and gpu-short scales)."""
    return [s.grid_for(r.mode) for s in r.studies if any(v.resources.gpu for v in variants(r, s))]
