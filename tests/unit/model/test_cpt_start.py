"""Continued pretraining: a start checkpoint that is missing or has another shape or architecture is refused with
a message naming the path and the fix, before any model is built."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.experiment import load_experiment
from pipeline.model.build import (
    build_model,
    check_checkpoint_shape,
    model_spec,
    preset_config,
    start_checkpoint_config,
)


def _save_tiny(path, **changes) -> str:
    torch.manual_seed(0)
    lm = build_model(model_spec("tiny", 100))
    for key, value in changes.items():
        setattr(lm.config, key, value)
    lm.save_pretrained(path)
    return str(path)


def test_matching_start_checkpoint_passes(tmp_path):
    start_checkpoint_config(_save_tiny(tmp_path / "tiny"), 100, shape="tiny")
    check_checkpoint_shape("610m", "610m", preset_config("610m", 100))


def test_missing_start_checkpoint_names_path_and_fix(tmp_path):
    missing = str(tmp_path / "scratch-610m-clm" / "hf")
    with pytest.raises(ValueError, match=r"scratch-610m-clm/hf.*start checkpoint does not exist.*launch/export_hf.py"):
        start_checkpoint_config(missing, 100, shape="610m")


def test_start_checkpoint_of_another_size_is_refused(tmp_path):
    path = _save_tiny(tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"config.json: the start checkpoint has 2 layers, hidden 64, FFN 128, 4/2 "
                                         r"heads, but model.shape '610m' has 26 layers, hidden 1152"):
        start_checkpoint_config(path, 100, shape="610m")
    with pytest.raises(ValueError, match="model.shape: '610m', but model.init is the preset '210m'; set model.shape=210m"):
        check_checkpoint_shape("210m", "610m", preset_config("210m", 100))


def test_start_checkpoint_of_another_architecture_is_refused(tmp_path):
    path = _save_tiny(tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported architectures: llama"):
        start_checkpoint_config(path, 100, shape="tiny")


def test_start_config_checks_the_shape_it_read_before_the_tokenizer(tmp_path):
    """Preflight reads the start checkpoint's config once: ``start_checkpoint_config`` checks ``model.shape`` on it
    first (the shape is the first thing wrong), then the tokenizer."""
    path = _save_tiny(tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"the start checkpoint has 2 layers.*but model.shape '610m'"):
        start_checkpoint_config(path, 99, shape="610m")
    with pytest.raises(ValueError, match="vocab_size 100 does not match the data tokenizer's 99"):
        start_checkpoint_config(path, 99, shape="tiny")
    with pytest.raises(ValueError, match="missing'.*start checkpoint does not exist.*launch/export_hf.py"):
        start_checkpoint_config(str(tmp_path / "missing"), 100, shape="tiny")
    with pytest.raises(ValueError, match="no such directory"):
        start_checkpoint_config(str(tmp_path / "missing"), 100)
    assert start_checkpoint_config(path, 100, shape="tiny").num_hidden_layers == 2


def test_unknown_shape_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.shape: '620m' is not a preset; choose one of"):
        load_experiment(None, ["model.shape=620m"])
