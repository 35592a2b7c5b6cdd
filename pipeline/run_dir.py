"""The run directory: every file a run holds is named here, once, and read back as typed objects.

Training (``pipeline.train``), the HF export, evaluation, the report and the sweep find a run's files through
:class:`RunDir` instead of spelling the names again. The layout of ``RUN/``::

    experiment.yaml       the resolved experiment (the sweep writes it before training; --experiment reads it)
    experiment.json       the same, as JSON; read back by the export, evaluation and the report
    model_config.json     the HF config of the trained model
    ds_config.json        the resolved DeepSpeed config
    data.json             the shards trained on: directory, fingerprint, samples, tokens
    metrics.jsonl         one record per optimizer step; tensorboard/ has the same scalars, loss.png their plot
    trackers.json         the W&B and MLflow run ids (train.trackers), continued by a resume
    wandb/                W&B's files of the run; mlflow.db, mlflow-artifacts/: MLflow's local store
    logs/                 error-rank{r}.log of a failed run
    checkpoints/stepNNNNNNNN/   DeepSpeed's files, rng-rank{r}.pt, the run files above, COMPLETE (the marker)
    hf/                   the HF export at the end of training
    eval/                 results of launch/evaluate.py (*.json) and checkpoint exports (hf-stepNNNNNNNN/)
    job.sbatch, jobs.txt, slurm-<job>.out   the sweep's job file, submissions and SLURM logs
    .lock                 held by the run's rank 0 while it trains
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from pipeline.config import ConfigError, from_dict, to_dict
from pipeline.experiment import ExperimentConfig
from pipeline.io import read_json, write_json_atomic

MARKER = "COMPLETE"  # written into a checkpoint directory once every rank has finished writing it
BEST = "BEST"  # marks checkpoint.keep_best's checkpoint directory, with its record (pipeline.train.checkpoint)
EXPERIMENT, MODEL_CONFIG, DS_CONFIG, DATA = "experiment.json", "model_config.json", "ds_config.json", "data.json"
_TAG = re.compile(r"^step(\d{8})$")


def tag(step: int) -> str:
    """The name of a step's checkpoint directory (DeepSpeed's tag)."""
    return f"step{step:08d}"


@dataclass(frozen=True)
class DataRecord:
    """``data.json``: the shard directory a run trained on (data.shards), and each phase's own by its loader's name
    (``phases[i]``: directory, fingerprint), which a resume is held to before anything is built."""
    directory: str
    fingerprint: str
    samples: int
    tokens: int
    phase_shards: dict[str, dict[str, str]] = field(default_factory=dict)


class RunDir:
    """The run directory at ``path``: its files' paths (properties), what it holds, and its contents typed."""

    def __init__(self, path: str):
        self.path = path

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    experiment_yaml = property(lambda self: self._file("experiment.yaml"))
    experiment_json = property(lambda self: self._file(EXPERIMENT))
    model_config_json = property(lambda self: self._file(MODEL_CONFIG))
    metrics = property(lambda self: self._file("metrics.jsonl"))
    tensorboard = property(lambda self: self._file("tensorboard"))
    loss_plot = property(lambda self: self._file("loss.png"))
    trackers = property(lambda self: self._file("trackers.json"))
    wandb = property(lambda self: self._file("wandb"))  # W&B makes it: wandb.init(dir=RUN)
    mlflow_db = property(lambda self: self._file("mlflow.db"))
    mlflow_artifacts = property(lambda self: self._file("mlflow-artifacts"))
    logs = property(lambda self: self._file("logs"))
    checkpoints = property(lambda self: self._file("checkpoints"))
    hf = property(lambda self: self._file("hf"))
    hf_best = property(lambda self: self._file("hf-best"))  # checkpoint.keep_best's step, exported at the end
    eval = property(lambda self: self._file("eval"))
    job_file = property(lambda self: self._file("job.sbatch"))
    jobs_log = property(lambda self: self._file("jobs.txt"))
    slurm_log = property(lambda self: self._file("slurm-%j.out"))  # SLURM fills in the job id
    lock = property(lambda self: self._file(".lock"))

    def checkpoint(self, step: int) -> str:
        return os.path.join(self.checkpoints, tag(step))

    def eval_export(self, step: int) -> str:
        """Where evaluation exports a checkpoint it reads (once)."""
        return os.path.join(self.eval, f"hf-{tag(step)}")

    def eval_results(self, name: str = "results", step: int | None = None) -> str:
        """A kept checkpoint's results go under ``eval/stepN/``, where the run's own (final) results are not read."""
        return os.path.join(self.eval if step is None else os.path.join(self.eval, tag(step)), f"{name}.json")

    def training_eval_results(self, step: int) -> str:
        """What ``eval.evaluators`` scored at a validation step (``eval/training/stepN.json``), which the card of that
        step's export (``hf-best``) carries where no ``launch/evaluate.py`` file of the step has it."""
        return os.path.join(self.eval, "training", f"{tag(step)}.json")

    def all_eval_results(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.eval, "*.json")))

    def step_eval_results(self) -> list[str]:
        """The kept checkpoints' results (``eval/stepN/*.json``)."""
        return sorted(glob.glob(os.path.join(self.eval, "step[0-9]*", "*.json")))

    # what the directory holds

    def exists(self) -> bool:
        """Whether this is a run directory of launch/train.py (it has written its experiment)."""
        return os.path.isfile(self.experiment_json)

    def has_hf(self) -> bool:
        """Whether ``hf/`` holds a finished export (its config and weights)."""
        return os.path.isfile(os.path.join(self.hf, "config.json")) and any(
            ".safetensors" in f for f in os.listdir(self.hf))

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint (the marker written); a directory without it is never read."""
        if not os.path.isdir(self.checkpoints):
            return []
        return sorted(int(m.group(1)) for d in os.listdir(self.checkpoints)
                      if (m := _TAG.match(d)) and os.path.exists(os.path.join(self.checkpoints, d, MARKER)))

    def latest_complete(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def best_mark(self, step: int) -> str:
        """The step's ``BEST``, where it is ``checkpoint.keep_best``'s checkpoint, written when it became the best."""
        return os.path.join(self.checkpoint(step), BEST)

    def best(self) -> dict | None:
        """The record (step, value, metric, mode) of ``checkpoint.keep_best``'s complete checkpoint, which its
        directory's ``BEST`` holds; None without one."""
        marked = [s for s in self.complete_steps() if os.path.isfile(self.best_mark(s))]
        return read_json(self.best_mark(marked[-1])) if marked else None

    def checkpoint_steps(self) -> list[int]:
        """Steps with a checkpoint directory, complete or half-written."""
        if not os.path.isdir(self.checkpoints):
            return []
        return sorted(int(m.group(1)) for d in os.listdir(self.checkpoints) if (m := _TAG.match(d)))

    # typed contents

    def experiment(self) -> ExperimentConfig:
        """The experiment the run trained (``experiment.json``)."""
        return _experiment(read_json(self.experiment_json, "not a run directory of launch/train.py"),
                           self.experiment_json)

    def checkpoint_experiment(self, step: int) -> ExperimentConfig:
        """The experiment of the run that wrote the step's checkpoint (saved with every checkpoint)."""
        path = os.path.join(self.checkpoint(step), EXPERIMENT)
        return _experiment(read_json(path, "written with every checkpoint"), path)

    def checkpoint_run_file(self, step: int, name: str) -> dict | None:
        """One of the :meth:`run_files` saved with the step's checkpoint, as written (None: that checkpoint has
        none, an older one)."""
        path = os.path.join(self.checkpoint(step), name)
        return read_json(path, "written with every checkpoint") if os.path.isfile(path) else None

    def checkpoint_world_size(self, step: int) -> int:
        """The number of ranks that wrote the step's checkpoint (from its completion marker)."""
        path = os.path.join(self.checkpoint(step), MARKER)
        world = read_json(path, "not a complete checkpoint").get("world_size", 1)
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"{path}: world_size {world!r} is no number of ranks; the trainer writes an integer "
                             f">= 1 there: resume only checkpoints this project wrote, or delete this step's "
                             f"directory to resume from an earlier one")
        return world

    def checkpoint_zero_stage(self, step: int) -> int:
        """The ZeRO stage that wrote the step's checkpoint (its DeepSpeed config; 0 without a ZeRO section)."""
        ds = read_json(os.path.join(self.checkpoint(step), DS_CONFIG), "written with every checkpoint")
        return int(ds.get("zero_optimization", {}).get("stage", 0))

    def model_config(self):
        """The trained model's HF config (``model_config.json``), a ``PretrainedConfig``."""
        from transformers import AutoConfig

        return AutoConfig.for_model(**read_json(self.model_config_json, "not a run directory of launch/train.py"))

    def run_files(self, experiment: dict, ds_config: dict, model_config: dict, data: DataRecord
                  ) -> dict[str, dict]:
        """The run's description, by file name, as written into the run and into every checkpoint; ``experiment``:
        the experiment as a dict (``to_dict``)."""
        return {EXPERIMENT: experiment, DS_CONFIG: ds_config, MODEL_CONFIG: model_config, DATA: to_dict(data)}

    def write_run_files(self, files: dict[str, dict]) -> None:
        """Write :meth:`run_files` and ``experiment.yaml`` (the same experiment, for ``--experiment``)."""
        import yaml

        os.makedirs(self.path, exist_ok=True)
        for name, obj in files.items():
            write_json_atomic(self._file(name), obj)
        with open(self.experiment_yaml, "w") as f:
            yaml.safe_dump(files[EXPERIMENT], f, sort_keys=False)


def _experiment(raw: dict, path: str) -> ExperimentConfig:
    try:
        return from_dict(ExperimentConfig, raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
