"""The experiment config: what to train, on which shards, with which objectives in which phases."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

from pipeline.config import ConfigError, apply_overrides, from_dict, load_yaml
from pipeline.model.presets import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_DIR = os.path.join(REPO, "data", "sample")


@dataclass
class DataConfig:
    shards: str = "runs/shards/sample-128"  # shard directory (built from `build` when missing and `build` is set)
    tokenizer: str = os.path.join(SAMPLE_DIR, "tokenizer")
    seq_len: int = 128
    num_workers: int = 0  # DataLoader worker processes per rank; the order does not depend on it
    build_inputs: list[str] = field(default_factory=lambda: [os.path.join(SAMPLE_DIR, "train", "**", "*.jsonl.zst")])
    build_if_missing: bool = True  # rank 0 builds the shards from build_inputs when the directory has none
    unit_shards: str = ""  # sentence-unit shards (build_shards.py --units) for contrastive objectives
    unit_micro_batch: int = 0  # sentence units per rank per micro-step (0: train.micro_batch)

    def validate(self) -> None:
        if self.seq_len < 8:
            raise ConfigError(f"data.seq_len must be >= 8, got {self.seq_len}")


@dataclass
class ModelConfig:
    init: str = "tiny"  # a preset name (tiny, 20m, 210m, 610m, 1b, 7b, 8b) or a local HF checkpoint directory
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    activation_checkpointing: bool = False
    attention_dropout: float = 0.0  # dropout on attention probabilities (SimCSE's positives need > 0, e.g. 0.3)
    shape: str = ""  # a preset whose shape the checkpoint in `init` must have (continued pretraining); "": unchecked

    def validate(self) -> None:
        if self.shape and self.shape not in PRESETS:
            raise ConfigError(f"model.shape: {self.shape!r} is not a preset; choose one of {list(PRESETS)} (or \"\")")


@dataclass
class ObjectiveSpec:
    name: Literal["clm", "mlm", "mntp", "magnet", "sscl", "simcse"]
    weight: float = 1.0
    ratio: float = 0.3  # masking ratio (mlm, mntp); any value in (0, 1] from the same shards
    policy: Literal["80-10-10", "mask"] = "80-10-10"  # replacement of masked tokens: BERT's split, or all [MASK]
    mask_token: str | None = None  # None: the tokenizer's mask token; or an ordinary token such as "_" (LLM2Vec)
    options: dict = field(default_factory=dict)  # the objective's own settings (see docs/training.md)

    def validate(self) -> None:
        if self.weight <= 0:
            raise ConfigError(f"objective {self.name}: weight must be > 0, got {self.weight}")
        if not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"objective {self.name}: ratio must be in (0, 1], got {self.ratio}")


@dataclass
class PhaseSpec:
    objectives: list[ObjectiveSpec]
    share: float = 1.0  # fraction of train.steps; shares of all phases sum to 1
    name: str = ""
    document_masking: bool = True  # attend only within the document inside packed samples

    def validate(self) -> None:
        if not self.objectives:
            raise ConfigError(f"phase {self.name!r}: needs at least one objective")
        if not 0.0 < self.share <= 1.0:
            raise ConfigError(f"phase {self.name!r}: share must be in (0, 1], got {self.share}")
        self.name = self.name or "+".join(o.name for o in self.objectives)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = 30
    decay_steps: int = 60  # wsd: length of the final linear decay
    min_lr_ratio: float = 0.0  # lr at the end of the decay, as a fraction of lr


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch: int = 4  # samples per rank per micro-step
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    peak_tflops: float = 0.0  # per device, for MFU; 0 = look up the GPU, none on CPU
    export_hf: bool = True  # write an HF directory at the end
    stop_at_step: int = 0  # checkpoint and exit after this global step (0: run to train.steps); e.g. to fit a time slot


@dataclass
class CheckpointConfig:
    every: int = 50
    keep_last: int = 2
    keep_every: int = 0  # also keep every N-th step for good (0: none)
    resume: bool = True  # continue from the newest complete checkpoint in run_dir


DEFAULT_NAME = "sample-tiny-clm"  # the embedded default experiment's run


@dataclass
class ExperimentConfig:
    name: str = ""  # default: the run directory's name when run_dir is set, else sample-tiny-clm
    run_dir: str = ""  # default runs/<name>
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    phases: list[PhaseSpec] = field(default_factory=lambda: [PhaseSpec(objectives=[ObjectiveSpec("clm")])])
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        self.name = self.name or (os.path.basename(os.path.normpath(self.run_dir)) if self.run_dir else DEFAULT_NAME)
        self.run_dir = self.run_dir or os.path.join("runs", self.name)
        for phase in self.phases:  # defaults are built without from_dict, so validate (and name) them here
            phase.validate()
        if not math.isclose(sum(p.share for p in self.phases), 1.0, abs_tol=1e-6):
            raise ConfigError(f"phases: shares must sum to 1, got {[p.share for p in self.phases]}")
        if self.optim.schedule == "wsd" and self.optim.warmup_steps + self.optim.decay_steps > self.train.steps:
            raise ConfigError(f"optim: warmup_steps + decay_steps ({self.optim.warmup_steps} + "
                              f"{self.optim.decay_steps}) exceed train.steps ({self.train.steps})")

    def phase_starts(self) -> list[int]:
        """First global step of each phase (a function of the step, so a resume lands in the right phase)."""
        starts, acc = [], 0.0
        for p in self.phases:
            starts.append(round(acc * self.train.steps))
            acc += p.share
        return starts

    def phase_at(self, step: int) -> tuple[int, PhaseSpec]:
        idx = max(i for i, s in enumerate(self.phase_starts()) if s <= step)
        return idx, self.phases[idx]


def load_experiment(path: str | None, overrides: list[str] = ()) -> ExperimentConfig:
    data = load_yaml(path) if path else {}
    return from_dict(ExperimentConfig, apply_overrides(data, list(overrides)))
