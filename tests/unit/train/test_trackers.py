"""The experiment trackers (``train.trackers``) with the real libraries and no network: W&B offline, its
transaction log read back; MLflow's local sqlite store read back with its client; TensorBoard's events.

One training run of 4 steps is resumed after losing its step-4 checkpoint (as a kill between logging a step and
checkpointing it would) and trained on to 6: W&B and MLflow continue their runs and are sent steps 5 and 6 only,
so each tracker holds every step once.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
from helpers import ONE_RANK, launch_training, logged_steps, one_error

from pipeline.config import ConfigError, to_dict
from pipeline.experiment import TrainConfig, load_experiment
from pipeline.run_dir import RunDir
from pipeline.train.trackers import Trackers, check_trackers, trackers_spec

COMMON = ["train.micro_batch=2", "train.log_every=1", "optim.schedule=constant", "optim.warmup_steps=0",
          "optim.decay_steps=0", "checkpoint.every=2", "checkpoint.keep_last=3", "data.seq_len=64",
          "data.build_if_missing=false", "train.export_hf=false", "train.trackers=[tensorboard,wandb,mlflow]",
          "train.wandb_mode=offline"]


def launch(run_dir: str, shards: str, *overrides: str, env: dict, **kwargs) -> subprocess.CompletedProcess:
    """The default experiment with this module's settings on one rank (the fastest CPU layout)."""
    return launch_training(run_dir, None, *COMMON, f"data.shards={shards}", *overrides, nproc=1,
                           ds_config=ONE_RANK["ds_config"], env={**ONE_RANK["env"], **env}, **kwargs)


@pytest.fixture
def wandb_home(tmp_path, monkeypatch) -> dict:
    """W&B's own settings, cache and credentials in ``tmp_path``: no login from the machine's user."""
    env = {"WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "NETRC": str(tmp_path / "netrc")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return env


def wandb_records(path: str):
    """The records of a W&B transaction log (``run-<id>.wandb``): LevelDB's log format (32 KiB blocks, each
    record a 7-byte header: checksum, length, type 1 full / 2 first / 3 middle / 4 last) after the header
    ``:W&B``, holding W&B's own protobuf ``Record`` messages."""
    from wandb.proto.wandb_internal_pb2 import Record

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, chunk, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_logged(run: RunDir) -> tuple[set[str], list[dict], dict[int, list[dict]]]:
    """(the run ids, the config of each W&B process, step -> the scalars logged at it) of every W&B log."""
    ids, configs, steps = set(), [], {}
    for path in sorted(glob.glob(os.path.join(run.wandb, "offline-run-*", "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                configs.append({u.key: json.loads(u.value_json) for u in record.run.config.update
                                if not u.key.startswith("_")})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}  # a/b: nested
                scalars = {k: json.loads(v) for k, v in items.items() if not k.startswith("_")}
                steps.setdefault(record.history.step.num, []).append(scalars)
    return ids, configs, steps


def mlflow_logged(run: RunDir) -> tuple:
    """(MLflow's client, its one run, step -> every value logged at it, by key)."""
    from mlflow.tracking import MlflowClient

    with open(run.trackers) as f:
        stored = json.load(f)["mlflow"]
    client = MlflowClient(stored["tracking_uri"])
    (experiment,) = [e for e in client.search_experiments() if e.name == "decoder-encoders"]
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == stored["run_id"]
    steps: dict[int, dict[str, list[float]]] = {}
    for key in found.data.metrics:
        for m in client.get_metric_history(found.info.run_id, key):
            steps.setdefault(m.step, {}).setdefault(key, []).append(m.value)
    return client, found, steps


@pytest.mark.e2e
def test_a_resumed_run_continues_its_tracker_runs_with_every_step_once(shards, tmp_path, wandb_home):
    run = RunDir(str(tmp_path / "run"))
    launch(run.path, shards, "train.steps=4", env=wandb_home)
    first = logged_steps(run.path)
    with open(run.experiment_json) as f:
        first_experiment = json.load(f)
    shutil.rmtree(run.checkpoint(4))  # lost: the restart replays steps 3 and 4
    proc = launch(run.path, shards, "train.steps=6", env=wandb_home)
    assert "resumed from step00000002" in proc.stdout
    final = logged_steps(run.path)
    assert sorted(final) == [1, 2, 3, 4, 5, 6]
    # W&B and MLflow runs are append-only: they keep the first run's steps 3 and 4, and get 5 and 6 on resume
    expected = {s: (first if s <= 4 else final)[s] for s in final}
    expected = {s: {k: v for k, v in rec.items() if k not in ("step", "phase")} for s, rec in expected.items()}

    ids, configs, wandb_steps = wandb_logged(run)
    with open(run.trackers) as f:
        assert ids == {json.load(f)["wandb"]}  # one W&B run, continued
    assert len(configs) == 2 and configs[0] == first_experiment
    assert {s: v for s, (v,) in wandb_steps.items()} == expected  # each step once: none dropped by W&B

    client, found, mlflow_steps = mlflow_logged(run)
    assert found.info.status == "FINISHED"
    assert {s: {k: v for k, (v,) in by_key.items()} for s, by_key in mlflow_steps.items()} == expected
    assert found.data.params["train.steps"] == "4"  # the params of the run when it was created
    assert found.data.params["phases.0.objectives.0.name"] == "clm"
    with open(client.download_artifacts(found.info.run_id, "experiment.json", str(tmp_path))) as f:
        assert json.load(f)["train"]["steps"] == 6  # the config artifact: the resumed run's

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(run.tensorboard).Reload().Scalars("loss/clm")
    assert [e.step for e in scalars] == sorted(final)
    assert [e.value for e in scalars] == pytest.approx([final[s]["loss/clm"] for s in sorted(final)], rel=1e-6)


@pytest.mark.e2e
def test_a_missing_tracker_package_is_one_config_error_before_training(shards, tmp_path):
    fake = tmp_path / "no-wandb"
    fake.mkdir()
    (fake / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
    path = os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])])
    run_dir = str(tmp_path / "run")
    proc = launch(run_dir, shards, "train.trackers=[tensorboard,wandb]", env={"PYTHONPATH": path}, check=False,
                  launcher="deepspeed")  # the README's launcher: torchrun adds a traceback of its own
    assert one_error(proc, "config error") == ("config error: train.trackers: wandb needs the wandb package: "
                                               "pip install wandb (or pip install 'decoder-encoders[trackers]')")
    assert not os.path.exists(RunDir(run_dir).metrics) and not os.path.exists(RunDir(run_dir).tensorboard)


def test_online_wandb_without_a_login_is_a_config_error_naming_the_fix(wandb_home):
    with pytest.raises(ConfigError, match=r"^train\.wandb_mode: online W&B needs a login: run `wandb login` or set "
                                          r"WANDB_API_KEY; or set train\.wandb_mode=offline"):
        check_trackers(TrainConfig(trackers=["wandb"]))
    check_trackers(TrainConfig(trackers=["wandb"], wandb_mode="offline"))  # offline needs none


def test_mlflow_without_its_local_store_package_names_it():
    """In a fresh process: MLflow registers its sqlite store at import only when sqlalchemy imports."""
    code = ("import sys; sys.modules['sqlalchemy'] = None\n"
            "from pipeline.experiment import TrainConfig\nfrom pipeline.train.trackers import check_trackers\n"
            "check_trackers(TrainConfig(trackers=['tensorboard', 'mlflow']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stderr.strip().splitlines()[-1] == (
        "pipeline.config.ConfigError: train.trackers: mlflow needs the sqlalchemy package: pip install sqlalchemy "
        "(or pip install 'decoder-encoders[trackers]')")


@pytest.mark.parametrize("override, message", [
    ("train.trackers=[wandb,mlflow,wandb]", "train.trackers: wandb is listed twice; name each tracker once"),
    ("train.trackers=[neptune]", "train.trackers.0: 'neptune' is not allowed; choose one of ['tensorboard', "
                                 "'wandb', 'mlflow']"),
])
def test_bad_tracker_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_experiment(None, [override])
    assert str(e.value) == message


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(tmp_path, wandb_home, capsys):
    exp = load_experiment(None, [f"run_dir={tmp_path}", "train.trackers=[wandb,mlflow]", "train.wandb_mode=offline"])
    run = RunDir(exp.run_dir)
    trackers = Trackers(trackers_spec(exp, to_dict(exp)), run, start_step=0, logged_until=0)
    trackers.log(1, {"loss/clm": 2.0})
    trackers.open[0][1].run.finish()  # W&B's run ends under the trainer: its next log raises
    for step in (2, 3):
        trackers.log(step, {"loss/clm": 1.0})
    trackers.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: train.trackers")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: train.trackers: wandb failed at step 2 and logs "
                                                         "no more in this run (UsageError: ")
    _, _, steps = mlflow_logged(run)
    assert steps == {1: {"loss/clm": [2.0]}, 2: {"loss/clm": [1.0]}, 3: {"loss/clm": [1.0]}}  # MLflow went on
