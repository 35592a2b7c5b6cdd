"""MAGNET in the trainer: every experiment file validates, and real 2-rank DeepSpeed ZeRO-3 CPU runs of the smoke
twins (packed shards with spans and sentence-unit shards, both built from the sample corpus by build_shards).

The two-stage smoke run (MNTP + SSCL for 4 steps, then all three) is stopped at the stage switch and resumed: the
losses after the resume are bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import glob
import os

import pytest
from helpers import launch_training, logged_steps
from shard_corpus import HOLDOUT, TOKENIZER, documents, write_jsonl_zst

from pipeline.data.build import BuildConfig, run_job
from pipeline.tokenizer import load_tokenizer
from pipeline.train.experiment import load_experiment
from pipeline.train.phases import build_objectives

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(REPO, "experiments", "magnet")
LOSSES = ("loss/mntp", "loss/msg", "loss/sscl")
FULL = sorted(p for p in glob.glob(os.path.join(EXPERIMENTS, "*.yaml")) if not p.endswith("-smoke.yaml"))


def _objectives(exp) -> list[list[tuple]]:
    return [[(o.name, o.weight, o.ratio, o.policy, o.options) for o in p.objectives] for p in exp.phases]


@pytest.mark.parametrize("path", FULL, ids=os.path.basename)
def test_experiment_and_its_smoke_twin_validate_and_agree(path):
    full = load_experiment(path)
    smoke = load_experiment(path.replace(".yaml", "-smoke.yaml"))
    assert _objectives(full) == _objectives(smoke)
    assert [p.share for p in full.phases] == [p.share for p in smoke.phases]
    assert full.model.attention_dropout == smoke.model.attention_dropout
    assert full.data.seq_len == 512 and full.model.dtype == "bf16"
    assert all(o.mask_token == "_" for p in full.phases for o in p.objectives if o.name == "magnet")  # Llama-2: none
    assert smoke.model.init == "tiny" and smoke.train.steps == 8
    uses_units = any(o.name == "sscl" for p in full.phases for o in p.objectives)
    assert bool(full.data.unit_shards) == bool(smoke.data.unit_shards) == uses_units
    tokenizer = load_tokenizer(TOKENIZER)
    for phase in smoke.phases:  # the objectives build (options accepted) with the sample tokenizer
        assert build_objectives(phase, tokenizer)


def test_the_variants_are_the_ablations():
    losses = {}
    for path in FULL:
        exp = load_experiment(path)
        names = set()
        for o in exp.phases[-1].objectives:
            if o.name == "sscl":
                names.add("sscl")
            else:
                names |= {k for k in ("mntp", "msg") if o.options.get(f"{k}_weight", 1.0) > 0}
        losses[os.path.basename(path)] = names
    assert losses == {"magnet.yaml": {"mntp", "msg", "sscl"}, "magnet-two-stage.yaml": {"mntp", "msg", "sscl"},
                      "no-mntp.yaml": {"msg", "sscl"}, "no-sscl.yaml": {"mntp", "msg"},
                      "no-msg.yaml": {"mntp", "sscl"}, "mntp-only.yaml": {"mntp"}}
    first = load_experiment(os.path.join(EXPERIMENTS, "magnet-two-stage.yaml")).phases[0]
    assert [(o.name, o.options.get("msg_weight")) for o in first.objectives] == [("magnet", 0.0), ("sscl", None)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """--set overrides pointing a smoke experiment at packed shards (spans of 8-32 tokens, build_shards' defaults)
    and sentence-unit shards (build_shards --units sentence) of a few sample-corpus documents."""
    root = tmp_path_factory.mktemp("magnet-data")
    corpus = write_jsonl_zst(root / "docs.jsonl.zst", documents(HOLDOUT, max_chars=3000)[:20])
    shards, units = str(root / "packed"), str(root / "units")
    run_job(BuildConfig(inputs=(corpus,), tokenizer=TOKENIZER, output=shards, seq_len=64, progress=False))
    run_job(BuildConfig(inputs=(corpus,), tokenizer=TOKENIZER, output=units, seq_len=32, units="sentence",
                        progress=False))
    return [f"data.shards={shards}", f"data.unit_shards={units}", "data.build_if_missing=false"]


def test_two_stage_zero3_run_resumes_exactly_at_the_stage_switch(data, tmp_path):
    experiment = os.path.join(EXPERIMENTS, "magnet-two-stage-smoke.yaml")
    whole = str(tmp_path / "whole")
    launch_training(whole, experiment, *data)
    resumed = str(tmp_path / "resumed")
    first = launch_training(resumed, experiment, *data, "train.stop_at_step=4")
    assert "stopped at step 4" in first.stdout
    second = launch_training(resumed, experiment, *data)
    assert "resumed from step00000004" in second.stdout
    ours, base = logged_steps(resumed), logged_steps(whole)
    assert sorted(base) == list(range(1, 9))
    for step in range(1, 9):  # stage 1 (steps 1-4): MNTP + SSCL; stage 2: all three
        stage2 = step > 4
        assert base[step]["progress/phase"] == int(stage2)
        assert [k in base[step] for k in LOSSES] == [True, stage2, True], step
        assert {k: ours[step].get(k) for k in LOSSES} == {k: base[step].get(k) for k in LOSSES}, step
