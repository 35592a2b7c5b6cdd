"""What the report reads from a run directory: the variant (from ``experiment.json``), the loss history (from
``metrics.jsonl``) and the evaluation headline numbers (every ``eval/*.json`` that ``launch/evaluate.py`` wrote)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from pipeline.data.manifest import read_json
from pipeline.eval.data import jsonl_records
from pipeline.model.presets import PRESETS
from pipeline.objectives import OBJECTIVES


@dataclass(frozen=True)
class Variant:
    name: str
    phases: str  # objectives per phase, e.g. "clm -> mlm"
    objectives: frozenset[str]
    clm_share: float  # share of the steps in phases that train CLM
    mask_ratio: float | None  # masking ratio of the last masked objective (mlm, mntp, magnet); None without one
    scale: str  # preset name matching the model's shape, or "custom"
    steps: int


@dataclass
class RunSummary:
    run_dir: str
    variant: Variant
    history: dict[str, dict[int, float]]  # "loss/clm" -> step -> value (a replayed step keeps its last value)
    headline: dict[str, float] = field(default_factory=dict)


def model_scale(run_dir: str, experiment: dict) -> str:
    init = experiment.get("model", {}).get("init", "")
    if init in PRESETS:
        return init
    path = os.path.join(run_dir, "model_config.json")
    if os.path.isfile(path):
        config = read_json(path, "model config of the run")
        shape = (config.get("num_hidden_layers"), config.get("hidden_size"), config.get("intermediate_size"))
        for name, p in PRESETS.items():
            if shape == (p.num_layers, p.hidden_size, p.ffn_size):
                return name
    return "custom"


def variant_of(run_dir: str, experiment: dict) -> Variant:
    phases = experiment.get("phases", [])
    names = [[o["name"] for o in p.get("objectives", [])] for p in phases]
    ratio = None
    for phase in phases:
        for spec in phase.get("objectives", []):
            if spec["name"] in OBJECTIVES and OBJECTIVES[spec["name"]].masks:
                ratio = float(spec.get("ratio", 0.3))
    return Variant(name=experiment.get("name", os.path.basename(run_dir.rstrip("/"))),
                   phases=" -> ".join("+".join(n) for n in names), objectives=frozenset(n for ns in names for n in ns),
                   clm_share=float(sum(p.get("share", 1.0) for p, n in zip(phases, names) if "clm" in n)),
                   mask_ratio=ratio, scale=model_scale(run_dir, experiment),
                   steps=int(experiment.get("train", {}).get("steps", 0)))


def read_history(path: str) -> dict[str, dict[int, float]]:
    history: dict[str, dict[int, float]] = {}
    if not os.path.isfile(path):
        return history
    for _, record in jsonl_records(path):
        for key, value in record.items():
            if key.startswith("loss/"):
                history.setdefault(key, {})[int(record["step"])] = float(value)
    return history


def load_run(run_dir: str) -> RunSummary:
    if not os.path.isfile(os.path.join(run_dir, "experiment.json")):
        raise FileNotFoundError(f"{run_dir}: no experiment.json, so not a run directory of launch/train.py")
    experiment = read_json(os.path.join(run_dir, "experiment.json"), "run directory")
    run = RunSummary(run_dir, variant_of(run_dir, experiment), read_history(os.path.join(run_dir, "metrics.jsonl")))
    for path in sorted(glob.glob(os.path.join(run_dir, "eval", "*.json"))):
        results = read_json(path, "results of launch/evaluate.py")
        run.headline.update(results.get("headline", {}))
    return run
