"""Fixtures shared by the test modules. The read-only ones that cost a build (the tokenizer, shards, the tiny
checkpoint) are session-scoped: every module reads the same files, built once; a test that changes them copies them."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from filelock import FileLock

from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import SAMPLE_DIR
from pipeline.model.build import build_model, model_spec
from pipeline.tokenizer import load_tokenizer
from pipeline.train.deepspeed_import import skip_autotuner_mlflow
from pipeline.train.deepspeed_ops import use_install_ops_dir

# DeepSpeed's ops built by the tests and their ranks (children inherit it) stay in this install's folder; its import
# skips the autotuner's mlflow, as every launch/ script's does
use_install_ops_dir()
skip_autotuner_mlflow()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test's two workers (pytest -n 2) one core each, and so every process a test starts: two threads beside
    # the other worker's process spin on one core (OpenMP's barriers), up to 5x slower; inductor compiles in-process
    torch.set_num_threads(1)
    os.environ.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")

TOKENIZER = os.path.join(SAMPLE_DIR, "tokenizer")
SAMPLE_TRAIN = os.path.join(SAMPLE_DIR, "train", "**", "*.jsonl.zst")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the slow tier's longest test (~7 min), first: on two workers it would otherwise start late and run on alone
LONGEST_FIRST = ("test_reproduce_quick_magnet_end_to_end",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.originalname not in LONGEST_FIRST)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _environ_per_test():
    """Each test's changes to os.environ end with it: an in-process rank's RANK or MASTER_PORT=0 must not reach a
    later test's children (the SLURM cluster's jobs inherit the environment they are submitted from)."""
    with mock.patch.dict(os.environ):
        yield


def built_once(tmp_path_factory, name: str, build: Callable[[str], object]) -> str:
    """The path ``name`` of this session, made by ``build(path)`` once for all its workers (make test's two): the
    first builds it under a lock, the others wait for it and read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # a worker's base folder is one of the session's
    path = root / "shared" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not os.path.exists(f"{path}.done"):
            build(str(path))
            open(f"{path}.done", "w").close()
    return str(path)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> str:
    """The real SmolLM2-135M as an HF directory (launch/import_gguf.py), imported once for the slow suite's runs."""
    return built_once(tmp_path_factory, "smollm2/hf", lambda out: subprocess.run(
        [sys.executable, os.path.join(REPO, "launch", "import_gguf.py"), "--output", out], check=True,
        capture_output=True, cwd=REPO))


@pytest.fixture(scope="session")
def tokenizer():
    """The sample tokenizer the shipped shards and the tiny checkpoints use."""
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="session")
def build_shards(tmp_path_factory):
    """``build_shards(inputs=..., **BuildConfig fields)`` -> shards in the sample tokenizer (64-token samples of the
    sample corpus's train split unless told), built once a session for each distinct set of settings."""

    def build(inputs: tuple[str, ...] = (SAMPLE_TRAIN,), **settings) -> str:
        config = BuildConfig(**{"inputs": tuple(inputs), "tokenizer": TOKENIZER, "output": "", "seq_len": 64,
                                "progress": False, **settings})
        key = hashlib.sha256(repr((tuple(inputs), sorted(settings.items()))).encode()).hexdigest()[:16]
        return built_once(tmp_path_factory, f"shards-{key}",
                          lambda out: run_job(dataclasses.replace(config, output=out)))
    return build


@pytest.fixture(scope="session")
def shards(build_shards) -> str:
    """The whole train split of the sample corpus in 512-sample shards."""
    return build_shards(samples_per_shard=512)


@pytest.fixture(scope="session")
def init_dir(tmp_path_factory) -> str:
    """A tiny random HF checkpoint, so the ZeRO-3 run and the reference loop start from the same weights (and a
    run started from an HF checkpoint directory is exercised)."""
    tok = load_tokenizer(TOKENIZER)
    torch.manual_seed(0)
    lm = build_model(model_spec("tiny", tok.info.vocab_size, pad_token_id=tok.info.pad_id, bos_token_id=tok.info.bos_id,
                     eos_token_id=tok.info.eos_id))
    out = str(tmp_path_factory.mktemp("init") / "tiny")
    lm.save_pretrained(out)
    tok.hf.save_pretrained(out)
    return out
