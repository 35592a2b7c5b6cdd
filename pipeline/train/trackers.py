"""Experiment trackers (``train.trackers``): TensorBoard, Weights & Biases and MLflow get the scalars of every step
that metrics.jsonl gets, at the same step, and W&B and MLflow the experiment as their run's config.

:func:`check_trackers` runs in the preflight, so a missing package or W&B login is one config error before
training. A resumed run continues the same tracker run: W&B's and MLflow's run ids are kept in ``trackers.json``
of the run directory. Their runs are append-only (W&B drops a step below its newest with a warning), so the steps
a resume replays, which they already hold, are not sent again; TensorBoard purges them and takes the replay, as
metrics.jsonl does. A tracker that fails mid-run is dropped with one warning: training goes on.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.config import ConfigError
from pipeline.experiment import ExperimentConfig, TrainConfig
from pipeline.io import write_json_atomic
from pipeline.run_dir import RunDir

PACKAGES = {"wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}  # sqlalchemy, alembic: the sqlite store
INSTALL = "pip install 'decoder-encoders[trackers]'"


class Tracker(Protocol):
    continued: bool  # it continues its run from before a restart

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_trackers(train: TrainConfig) -> None:
    """What each tracker needs before a run starts: its packages, and a W&B login unless offline."""
    for name in train.trackers:
        for module in PACKAGES.get(name, ()):
            try:
                importlib.import_module(module)
            except ImportError:
                raise ConfigError(f"train.trackers: {name} needs the {module} package: pip install {module} "
                                  f"(or {INSTALL})") from None
    if "wandb" in train.trackers and train.wandb_mode == "online":
        import wandb

        if not wandb.login(verify=False, prompt=False):
            raise ConfigError("train.wandb_mode: online W&B needs a login: run `wandb login` or set WANDB_API_KEY; "
                              "or set train.wandb_mode=offline to keep the run in RUN/wandb for `wandb sync`")


@dataclass(frozen=True)
class TrackersSpec:
    """The run's trackers as preflight decided them (:func:`trackers_spec`); the default: TensorBoard alone."""

    names: tuple[str, ...] = ("tensorboard",)
    project: str = ""  # train.tracker_project
    run_name: str = ""  # the experiment's name
    wandb_mode: str = "online"
    mlflow_uri: str = ""  # "": a local store in the run directory
    config: Mapping = field(default_factory=dict)  # the experiment, as W&B and MLflow record it


def trackers_spec(exp: ExperimentConfig, config: Mapping) -> TrackersSpec:
    """``config``: the experiment as a dict (``to_dict``)."""
    t = exp.train
    return TrackersSpec(tuple(t.trackers), t.tracker_project, exp.name, t.wandb_mode, t.mlflow_tracking_uri, config)


class TensorBoard:
    """``purge_step``: TensorBoard hides the events of the steps a resume replays, logged before the restart."""

    continued = False  # the replayed steps are written again

    def __init__(self, run: RunDir, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run.tensorboard, purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandB:
    """A W&B run (id in ``trackers.json``, resumed with ``resume="allow"``), its files under ``RUN/wandb/``."""

    def __init__(self, spec: TrackersSpec, run: RunDir, config: dict, run_id: str | None):
        import wandb

        self.continued = run_id is not None
        self.run = wandb.init(project=spec.project, name=spec.run_name, id=run_id, resume="allow",
                              mode=spec.wandb_mode, dir=run.path, config=config)
        self.id = self.run.id  # W&B's new id when run_id is None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run (id in ``trackers.json`` with its store); the config as flattened params when the run is
    created (MLflow's params cannot change) and as the artifact ``experiment.json``."""

    def __init__(self, spec: TrackersSpec, run: RunDir, config: dict, stored: dict | None):
        from mlflow.tracking import MlflowClient

        local = not spec.mlflow_uri
        self.uri = f"sqlite:///{os.path.abspath(run.mlflow_db)}" if local else spec.mlflow_uri
        self.client = MlflowClient(self.uri)
        self.continued = bool(stored) and stored["tracking_uri"] == self.uri
        if self.continued:
            self.id = stored["run_id"]
            self.client.update_run(self.id, status="RUNNING")
        else:
            project = spec.project
            found = self.client.get_experiment_by_name(project)
            experiment = found.experiment_id if found else self.client.create_experiment(
                project, artifact_location=f"file://{os.path.abspath(run.mlflow_artifacts)}" if local else None)
            self.id = self.client.create_run(experiment, run_name=spec.run_name).info.run_id
            self._log_params(_flat(config))
        self.client.log_dict(self.id, config, "experiment.json")

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.id, params=[Param(k, v) for k, v in params.items()])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 3}}`` as ``{"train.steps": "3"}``: strings as they are, other values as JSON; list
    items by index (``phases.0.share``)."""
    items = config.items() if isinstance(config, dict) else enumerate(config)
    out = {}
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)) and v:
            out |= _flat(v, f"{key}.")
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


class Trackers:
    """The run's trackers behind one ``log``: a tracker that continues its run from before a restart is sent only
    the steps after ``logged_until`` (the newest step metrics.jsonl held at the restart)."""

    def __init__(self, spec: TrackersSpec, run: RunDir, start_step: int, logged_until: int):
        ids = _read_ids(run.trackers)
        self.open: list[tuple[str, Tracker, int]] = []
        config = copy.deepcopy(dict(spec.config))  # the trackers' own: W&B keeps and may change it
        for name in spec.names:
            if name == "tensorboard":
                tracker = TensorBoard(run, start_step)
            elif name == "wandb":
                tracker = WandB(spec, run, config, ids.get("wandb"))
                ids["wandb"] = tracker.id
            else:
                tracker = MLflow(spec, run, config, ids.get("mlflow"))
                ids["mlflow"] = {"run_id": tracker.id, "tracking_uri": tracker.uri}
            self.open.append((name, tracker, logged_until if tracker.continued else 0))
        if ids:
            write_json_atomic(run.trackers, ids)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for entry in list(self.open):
            name, tracker, holds_until = entry
            if step <= holds_until:
                continue
            try:
                tracker.log(step, scalars)
            except Exception as e:  # noqa: BLE001 - a tracker must not stop training; metrics.jsonl has the step
                self.open.remove(entry)
                print(f"warning: train.trackers: {name} failed at step {step} and logs no more in this run "
                      f"({type(e).__name__}: {' '.join(str(e).split())}); metrics.jsonl has every step",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        for _, tracker, _ in self.open:
            tracker.close()


def _read_ids(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
