"""The project's own loads of checkpoint files run no code from them (issue 43, item 6): a pickle that would run
code, placed where a resume or an export reads, is refused with one line naming the file, and the code does not
run; the real files (the old-checkpoint fixture, written by DeepSpeed and the trainer, and its universal copy) still
load. Before DeepSpeed's own unpickling loaders, the scan of the directory refuses the file."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from helpers import REPO

from pipeline.eval.load import ModelError, load_model
from pipeline.experiment import load_experiment
from pipeline.export.hf import STAGE0_MODEL_STATES, checkpoint_state_dict, export_checkpoint
from pipeline.io import read_json, write_json_atomic
from pipeline.run_dir import DS_CONFIG, RunDir
from pipeline.safe_load import UnsafeCheckpoint, check_directory, load_weights_only
from pipeline.train.async_checkpoint import WeightsOnlyLoads
from pipeline.train.checkpoint import restore_rng, rng_state, to_universal
from pipeline.train.errors import one_line
from pipeline.train.run_setup import resume_point

OLD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                   "old_checkpoint", "step00000002")
MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class WritesAFile:
    """Unpickled, it calls ``open(path, "w")``: the file's existence shows that the load ran code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def plant(path: str, proof: str) -> None:
    torch.save({"module": {}, "python": WritesAFile(proof)}, path)


def refused(load, path: str, proof: str) -> str:
    with pytest.raises(UnsafeCheckpoint) as e:
        load()
    line = one_line(e.value)
    assert not os.path.exists(proof), "the planted code ran"
    assert line.startswith(f"{path}: not loaded: it names ") and "which unpickling would call" in line, line
    assert "check where this directory came from" in line
    return line


def test_the_fixtures_files_load_weights_only():
    """What a resume reads (DeepSpeed's model and optimizer states through the engine's checkpoint engine, the
    trainer's RNG states) loads with only the allowed types; and the RNG state restores exactly."""
    engine = WeightsOnlyLoads(TorchCheckpointEngine())
    states = engine.load(os.path.join(OLD, MODEL_STATES), map_location=lambda storage, loc: storage)
    assert states["loaders"]["packed"]["fingerprint"]  # the trainer's client state, saved inside DeepSpeed's file
    assert engine.load(os.path.join(OLD, OPTIM_STATES))["optimizer_state_dict"]
    saved = load_weights_only(os.path.join(OLD, "rng-rank0.pt"))
    restore_rng(OLD, 0)
    assert rng_state()["numpy"][1].tolist() == saved["numpy"][1].tolist()
    assert random.getstate() == saved["python"] and torch.equal(torch.get_rng_state(), saved["torch"])
    np.random.seed(0)  # leave the process's RNG seeded as others expect


def test_code_in_an_rng_file_does_not_run(tmp_path):
    step = str(tmp_path / "step00000002")
    shutil.copytree(OLD, step)
    plant(os.path.join(step, "rng-rank0.pt"), str(tmp_path / "ran"))
    line = refused(lambda: restore_rng(step, 0), os.path.join(step, "rng-rank0.pt"), str(tmp_path / "ran"))
    assert "builtins.open" in line or "io.open" in line


@pytest.mark.parametrize("name", [MODEL_STATES, OPTIM_STATES])
def test_code_in_deepspeeds_files_does_not_run_through_the_engines_loads(tmp_path, name):
    path = str(tmp_path / name)
    plant(path, str(tmp_path / "ran"))
    refused(lambda: WeightsOnlyLoads(TorchCheckpointEngine()).load(path), path, str(tmp_path / "ran"))


def test_code_in_a_stage_0_export_does_not_run(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    os.makedirs(run.checkpoint(2))
    write_json_atomic(os.path.join(run.checkpoint(2), DS_CONFIG), {"train_micro_batch_size_per_gpu": 1})
    path = os.path.join(run.checkpoint(2), STAGE0_MODEL_STATES)
    plant(path, str(tmp_path / "ran"))
    refused(lambda: checkpoint_state_dict(run, 2), path, str(tmp_path / "ran"))


def test_a_file_that_is_no_torch_file_is_one_line(tmp_path):
    path = tmp_path / "rng-rank0.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UnsafeCheckpoint, match=rf"^{path}: not loaded: it is not a plain torch file"):
        load_weights_only(str(path))


def test_the_fixture_and_its_universal_copy_pass_the_scan(tmp_path):
    """What a resume on another world size hands DeepSpeed (the checkpoint, then its universal copy) passes."""
    step = str(tmp_path / "step00000002")
    shutil.copytree(OLD, step)
    check_directory(step)
    to_universal(step)
    check_directory(step)


@pytest.mark.parametrize("where", [OPTIM_STATES, MODEL_STATES, "universal/zero/embed.weight/fp32.pt"])
def test_code_in_a_zero_checkpoint_is_refused_before_deepspeed_unpickles_it(tmp_path, where):
    """DeepSpeed's zero_to_fp32 (the export of a ZeRO checkpoint) and universal loads unpickle with
    ``weights_only=False``: the scan before them refuses the planted file, without unpickling it."""
    run = RunDir(str(tmp_path / "run"))
    shutil.copytree(OLD, run.checkpoint(2))
    path = os.path.join(run.checkpoint(2), where)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plant(path, str(tmp_path / "ran"))
    refused(lambda: checkpoint_state_dict(run, 2), path, str(tmp_path / "ran"))


# The load path as a whole (issue 55, item 1): a checkpoint directory made hostile each way into DeepSpeed's
# unpickling loaders is refused in one line naming the file, by a resume's preflight, an export and an evaluation,
# and the planted code never runs.


def link_out(step: str, outside: str, proof: str) -> str:
    """``universal -> ../../elsewhere`` holding a marker and a pickle that would run: os.walk does not enter it."""
    os.makedirs(os.path.join(outside, "zero"))
    write_json_atomic(os.path.join(outside, "COMPLETE"), {"converted_from": "step00000002"})
    plant(os.path.join(outside, "zero", "optimizer_state.pt"), proof)
    os.symlink(os.path.relpath(outside, step), os.path.join(step, "universal"))
    return os.path.join(os.path.realpath(step), "universal")


def link_a_file_out(step: str, outside: str, proof: str) -> str:
    os.makedirs(outside)
    plant(os.path.join(outside, OPTIM_STATES), proof)
    os.remove(os.path.join(step, OPTIM_STATES))
    os.symlink(os.path.join(outside, OPTIM_STATES), os.path.join(step, OPTIM_STATES))
    return os.path.join(os.path.realpath(step), OPTIM_STATES)


def dotdot_in_a_name(step: str, outside: str, proof: str) -> str:
    """A parameter named ``../../x``: the universal conversion makes each name a folder of its output."""
    path = os.path.join(step, MODEL_STATES)
    states = torch.load(path, weights_only=False)
    states["param_shapes"][0] = {"../../x" if i == 0 else k: v for i, (k, v) in enumerate(
        states["param_shapes"][0].items())}
    torch.save(states, path)
    return os.path.join(os.path.realpath(step), MODEL_STATES)


def shapes_of_another_form(step: str, outside: str, proof: str) -> str:
    """``param_shapes`` that are no lists of name -> shape maps: the check itself must not fail on them."""
    path = os.path.join(step, MODEL_STATES)
    torch.save(torch.load(path, weights_only=False) | {"param_shapes": 5}, path)
    return os.path.join(os.path.realpath(step), MODEL_STATES)


def universal_made_elsewhere(step: str, outside: str, proof: str) -> str:
    """A real ``universal/`` (no link), copied from elsewhere, with a file that would run code."""
    os.makedirs(os.path.join(step, "universal", "zero"))
    write_json_atomic(os.path.join(step, "universal", "COMPLETE"), {"converted_from": "step00000002"})
    plant(os.path.join(step, "universal", "zero", "optimizer_state.pt"), proof)
    return os.path.join(os.path.realpath(step), "universal", "zero", "optimizer_state.pt")


HOSTILE = {"linked directory": link_out, "linked file": link_a_file_out, "dotdot name": dotdot_in_a_name,
           "shapes of another form": shapes_of_another_form, "universal made elsewhere": universal_made_elsewhere}


def resume(run: RunDir, tmp_path):
    """The resume's preflight on one rank, the checkpoint's marker saying two: the universal path."""
    resume_point(load_experiment(None, [f"run_dir={run.path}"]), 1)


def export(run: RunDir, tmp_path):
    export_checkpoint(run, str(tmp_path / "hf"), 2)


def evaluation(run: RunDir, tmp_path):
    load_model(run.path, step=2)


@pytest.mark.parametrize("way", list(HOSTILE))
@pytest.mark.parametrize("entry", [resume, export, evaluation])
def test_a_hostile_checkpoint_is_refused_by_every_load_before_any_code_runs(tmp_path, way, entry):
    run = RunDir(str(tmp_path / "run"))
    step = run.checkpoint(2)
    shutil.copytree(OLD, step)
    experiment = read_json(os.path.join(step, "experiment.json"))
    experiment["data"]["tokenizer"] = os.path.join(REPO, "data", "sample", "tokenizer")
    write_json_atomic(run.experiment_json, experiment)
    write_json_atomic(os.path.join(step, "COMPLETE"), read_json(os.path.join(step, "COMPLETE")) | {"world_size": 2})
    shutil.copy(os.path.join(step, "model_config.json"), run.model_config_json)
    proof = str(tmp_path / "ran")
    path = HOSTILE[way](step, str(tmp_path / "elsewhere"), proof)
    with pytest.raises((UnsafeCheckpoint, ModelError)) as e:
        entry(run, tmp_path)
    line = one_line(e.value)
    assert not os.path.exists(proof), "the planted code ran"
    assert f"{path}: not loaded: " in line and "check where this directory came from" in line, line
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(run.eval_export(2))


def test_a_marker_whose_world_size_is_no_number_of_ranks_is_one_line(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    shutil.copytree(OLD, run.checkpoint(2))
    marker = os.path.join(run.checkpoint(2), "COMPLETE")
    write_json_atomic(marker, {"step": 2, "world_size": "2"})
    with pytest.raises(ValueError, match=rf"^{marker}: world_size '2' is no number of ranks; the trainer writes an "
                                         "integer >= 1 there"):
        resume_point(load_experiment(None, [f"run_dir={run.path}"]), 1)


def test_a_universal_copy_made_from_another_checkpoint_is_made_again(tmp_path):
    """A ``universal/`` copied in from another run's step of the same number (its files pass the scan) would load
    that run's weights: the copy names the checkpoint it was made from, and this one's is made again."""
    other, step = str(tmp_path / "other" / "step00000002"), str(tmp_path / "run" / "step00000002")
    shutil.copytree(OLD, other)
    to_universal(other)
    shutil.copytree(OLD, step)
    write_json_atomic(os.path.join(step, "COMPLETE"), read_json(os.path.join(step, "COMPLETE")) | {"time": 1.0})
    shutil.copytree(os.path.join(other, "universal"), os.path.join(step, "universal"))
    to_universal(step)
    assert read_json(os.path.join(step, "universal", "COMPLETE"))["complete"]["time"] == 1.0
    made = os.path.getmtime(os.path.join(step, "universal", "COMPLETE"))
    to_universal(step)  # made from this checkpoint: kept
    assert os.path.getmtime(os.path.join(step, "universal", "COMPLETE")) == made
