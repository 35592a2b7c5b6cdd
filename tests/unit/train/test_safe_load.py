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

from pipeline.export.hf import STAGE0_MODEL_STATES, checkpoint_state_dict
from pipeline.io import write_json_atomic
from pipeline.run_dir import DS_CONFIG, RunDir
from pipeline.safe_load import UnsafeCheckpoint, check_directory, load_weights_only
from pipeline.train.async_checkpoint import WeightsOnlyLoads
from pipeline.train.checkpoint import restore_rng, rng_state, to_universal
from pipeline.train.errors import one_line

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
