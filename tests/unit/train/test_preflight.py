"""Preflight is the trainer's whole hand-over: every config error is raised by it, before any model is built (the
builders below it check nothing), and a run it refuses exits 2 with one line and leaves nothing behind."""

from __future__ import annotations

import ast
import json
import os

import pytest
from helpers import REPO, ZERO1, in_process_entry

# The modules of pipeline/train/ whose checks run before a model is built: preflight and what it calls, the
# entry's rendezvous (TORCH_CUDA_ARCH_LIST) and ``--check``.
CHECKING = {"preflight.py", "agreement.py", "run_setup.py", "shard_checks.py", "ds_config.py", "kernels.py",
            "compiling.py", "batch_warmup.py", "phases.py", "trackers.py", "deepspeed_ops.py", "check.py", "keep_best.py"}


def config_error_raises(path: str) -> list[int]:
    """The lines of ``path`` that raise ConfigError."""
    tree = ast.parse(open(path).read(), path)
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Raise) and node.exc is not None
            and isinstance(call := node.exc, ast.Call) and getattr(call.func, "id", None) == "ConfigError"]


def test_no_config_error_is_raised_below_preflight():
    train = os.path.join(REPO, "pipeline", "train")
    found = [f"pipeline/train/{name}:{line}" for name in sorted(os.listdir(train)) if name.endswith(".py")
             and name not in CHECKING for line in config_error_raises(os.path.join(train, name))]
    assert found == [], f"raise ConfigError in preflight (pipeline/train/preflight.py), not at {found}"
    assert config_error_raises(os.path.join(train, "preflight.py"))  # the walk sees a raise where there is one


@pytest.mark.parametrize("case", ["compile", "deepcompile", "moe grad_cache", "ds config", "matryoshka dims"])
def test_a_refused_setting_exits_2_before_any_model_is_built(shards, tmp_path, capsys, case):
    """Settings that were refused only while (or after) the engine's model was built: compile with selective
    checkpointing, DeepCompile without CUDA, an MoE model's router loss with grad_cache, a DeepSpeed JSON
    that contradicts the experiment, and Matryoshka dims above the model's hidden size (known once the model's
    config is read). Each is one ``config error`` line and exit 2 before the run directory is
    made, so no model (nor anything else) was built."""
    run = tmp_path / "run"
    conflicting = tmp_path / "ds.json"
    conflicting.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    config, overrides, expected = {
        "compile": (ZERO1, ["model.compile=true", "model.activation_checkpointing=selective"],
                    "config error: model.compile: true with model.activation_checkpointing: selective"),
        "deepcompile": (os.path.join(REPO, "ds_configs", "zero1_deepcompile.json"), [],
                        "config error: DeepSpeed config: compile.deepcompile needs CUDA"),
        "moe grad_cache": (ZERO1, ["model.init=tiny-moe", "train.grad_accum=2",
                                   "phases=[{objectives: [{name: supervised, grad_cache: true}]}]"],
                           "config error: model.init 'tiny-moe' is a mixture-of-experts model, whose router loss"),
        "ds config": (str(conflicting), [], "config error: DeepSpeed config: train_micro_batch_size_per_gpu = 8 "
                                            "contradicts the experiment's train.micro_batch = 4"),
        "matryoshka dims": (ZERO1, ["phases=[{objectives: [{name: supervised, matryoshka: {dims: [128, 64]}}]}]"],
                            "config error: phases[0].objectives[0].matryoshka.dims: 128 is above the model's hidden "
                            "size 64; use dims of at most 64, e.g. [64]"),
    }[case]
    base = [f"run_dir={run}", f"data.shards={shards}", "data.seq_len=64", "data.build_if_missing=false",
            "train.steps=10", *overrides]
    with in_process_entry() as main:
        rc = main(["--config", config, *[a for o in base for a in ("--set", o)]])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(expected), err
    assert not run.exists(), sorted(os.listdir(run))
