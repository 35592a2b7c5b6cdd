"""The experiment config: what to train, on which shards, with which objectives in which phases. This package's
public surface (``from pipeline.experiment import ...``); its modules by job: the sample corpus's place
(sample.py), the mixtures typed (mixture.py), the sections (sections.py), the phases resolved (phases.py), the
checks across sections (checks.py) and the whole config with its loader (experiment_config.py)."""

from pipeline.experiment.checks import VALIDATION_METRICS, metric_mode
from pipeline.experiment.experiment_config import DEFAULT_NAME, ExperimentConfig, load_experiment
from pipeline.experiment.mixture import MIN_RATIO, MixtureSource, SourceMixture
from pipeline.experiment.phases import PhaseData, phase_at
from pipeline.experiment.sample import SAMPLE_DIR, SAMPLE_INPUTS, sample_shards
from pipeline.experiment.sections import (
                                          HUB_LICENSES,
                                          BatchWarmupConfig,
                                          CheckpointConfig,
                                          DataConfig,
                                          EvaluatorConfig,
                                          ExportConfig,
                                          LoraConfig,
                                          ModelConfig,
                                          OptimConfig,
                                          PhaseSpec,
                                          TrainConfig,
                                          ValidationConfig,
)

__all__ = ["DEFAULT_NAME", "HUB_LICENSES", "MIN_RATIO", "SAMPLE_DIR", "SAMPLE_INPUTS", "VALIDATION_METRICS",
           "BatchWarmupConfig", "CheckpointConfig", "DataConfig", "EvaluatorConfig", "ExperimentConfig",
           "ExportConfig", "LoraConfig", "MixtureSource", "ModelConfig", "OptimConfig", "PhaseData", "PhaseSpec",
           "SourceMixture", "TrainConfig", "ValidationConfig", "load_experiment", "metric_mode", "phase_at",
           "sample_shards"]
