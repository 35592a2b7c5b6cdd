"""The whole experiment (``ExperimentConfig``: its sections together, checked across them when it loads) and
:func:`load_experiment`, which reads it from a file and ``--set`` overrides."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from pipeline.config import apply_overrides, check_ranges, from_dict, load_experiment_file
from pipeline.experiment.checks import (
    check_batch_warmup,
    check_phase_data,
    check_phase_seq_lens,
    check_phases,
    check_schedule_fits,
    keep_best_mode,
)
from pipeline.experiment.phases import PhaseData, phase_lengths, phase_starts, resolve_phases_data
from pipeline.experiment.sections import (
    CheckpointConfig,
    DataConfig,
    ExportConfig,
    ModelConfig,
    OptimConfig,
    PhaseSpec,
    TrainConfig,
    ValidationConfig,
)
from pipeline.objectives import CLMConfig

DEFAULT_NAME = "sample-tiny-clm"  # the embedded default experiment's run


@dataclass
class ExperimentConfig:
    name: str = ""  # default: the run directory's name when run_dir is set, else sample-tiny-clm
    run_dir: str = ""  # default runs/<name>
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    phases: list[PhaseSpec] = field(default_factory=lambda: [PhaseSpec(objectives=[CLMConfig()])])
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: ValidationConfig = field(default_factory=ValidationConfig)
    export: ExportConfig = field(default_factory=ExportConfig)  # the exports' model card

    def validate(self) -> None:
        self.__dict__.pop("phases_data", None)
        self.name = self.name or (os.path.basename(os.path.normpath(self.run_dir)) if self.run_dir else DEFAULT_NAME)
        self.run_dir = self.run_dir or os.path.join("runs", self.name)
        check_ranges(self)
        self.data.validate()
        check_phases(self.phases, self.model, self.train)
        check_batch_warmup(self.train, self.phase_lengths()[0])
        check_phase_seq_lens(self.phases)
        check_phase_data(self.phases_data, self.data, self.train)
        check_schedule_fits(self.optim, self.train.steps)
        if self.checkpoint.keep_best:
            self.keep_best_mode()

    def keep_best_mode(self) -> str:
        """"max" or "min" for ``checkpoint.keep_best`` (:func:`~pipeline.experiment.checks.keep_best_mode`)."""
        return keep_best_mode(self.checkpoint, self.eval)

    @functools.cached_property
    def phases_data(self) -> tuple[PhaseData, ...]:
        """:meth:`phase_data` of every phase, resolved once (by :meth:`validate`, which clears it first: the config
        is not changed after it is validated)."""
        return resolve_phases_data(self.phases, self.data, self.train.micro_batch)

    def phase_data(self, i: int) -> PhaseData:
        """Phase ``i``'s shards, sequence length, micro-batch and RoPE settings, its unset fields filled from the
        run's ``data`` and ``train`` (and the earlier phases, for the RoPE theta)."""
        return self.phases_data[i]

    def phase_starts(self) -> list[int]:
        """First global step of each phase (the phase of a step: :func:`~pipeline.experiment.phases.phase_at`)."""
        return phase_starts(self.phases, self.train.steps)

    def phase_lengths(self) -> list[int]:
        """Optimizer steps of each phase."""
        return phase_lengths(self.phases, self.train.steps)


def load_experiment(path: str | None, overrides: list[str] = ()) -> ExperimentConfig:
    data = load_experiment_file(path) if path else {}
    return from_dict(ExperimentConfig, apply_overrides(data, list(overrides)))
