"""pipeline/io.py: every reader's error names the file, what is wrong and the fix, in the caller's error class."""

import os

import pytest

from pipeline.config import ConfigError, load_experiment_file, load_yaml
from pipeline.io import read_json, read_jsonl, read_yaml, write_json_atomic


def test_read_json_names_the_file_the_problem_and_the_fix(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(FileNotFoundError, match=rf"{path}: file not found; rebuild it"):
        read_json(str(path), "rebuild it")
    path.write_text("{")
    with pytest.raises(ValueError, match=rf"{path}: not valid JSON \(.*\); rebuild it"):
        read_json(str(path), "rebuild it")
    path.write_text("[1]")
    with pytest.raises(ValueError, match=rf"{path}: the file's top level must be a mapping, got list"):
        read_json(str(path))
    assert read_json(str(path), top=None) == [1]


def test_read_yaml_in_the_callers_error_class(tmp_path):
    path = tmp_path / "exp.yaml"
    with pytest.raises(ConfigError, match=rf"{path}: experiment file not found"):
        load_yaml(str(path))
    path.write_text("a: [")
    with pytest.raises(ConfigError, match=rf"{path}: not valid YAML"):
        load_yaml(str(path))
    path.write_text("- a\n")
    with pytest.raises(ConfigError, match=rf"{path}: the experiment file's top level must be a mapping, got list"):
        load_yaml(str(path))
    path.write_text("")
    assert read_yaml(str(path)) == {}


def test_an_experiment_file_changes_its_base(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "full.yaml").write_text(
        "name: full\nmodel: {init: ckpt, attention_dropout: 0.3}\nphases: [{objectives: [{name: mntp}]}]\n")
    (tmp_path / "lora.yaml").write_text("base: recipes/full.yaml\nname: lora\nmodel: {lora: {r: 16}}\n"
                                        "phases: [{objectives: [{name: simcse}]}]\n")
    (tmp_path / "lora-smoke.yaml").write_text("base: lora.yaml\ntrain: {steps: 8}\n")
    assert load_experiment_file(str(tmp_path / "lora-smoke.yaml")) == {
        "name": "lora", "model": {"init": "ckpt", "attention_dropout": 0.3, "lora": {"r": 16}},
        "phases": [{"objectives": [{"name": "simcse"}]}], "train": {"steps": 8}}  # lists replace, mappings merge
    (tmp_path / "recipes" / "full.yaml").write_text("base: ../lora-smoke.yaml\n")
    cycle = r"full.yaml: base: ../lora-smoke.yaml leads back to a file that names it \(.*lora-smoke.yaml -> .*lora.yaml"
    with pytest.raises(ConfigError, match=cycle):
        load_experiment_file(str(tmp_path / "lora-smoke.yaml"))
    (tmp_path / "lora.yaml").write_text("base: [full.yaml]\n")
    with pytest.raises(ConfigError, match=r"lora.yaml: base: expected the path of another experiment file"):
        load_experiment_file(str(tmp_path / "lora.yaml"))
    (tmp_path / "lora.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere.yaml: experiment file not found"):
        load_experiment_file(str(tmp_path / "lora.yaml"))


def test_read_jsonl_names_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n[2]\n')
    records = read_jsonl(str(path))
    assert next(records) == (1, {"a": 1})
    with pytest.raises(ValueError, match=rf"{path}:3: expected a JSON object, got list"):
        next(records)


def test_write_json_atomic_leaves_only_the_file(tmp_path):
    path = tmp_path / "out.json"
    write_json_atomic(str(path), {"b": 1, "a": [1, 2]})
    assert read_json(str(path)) == {"a": [1, 2], "b": 1}
    assert os.listdir(tmp_path) == ["out.json"]
