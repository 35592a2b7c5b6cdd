"""MAGNET in the trainer: every experiment file validates, and real 2-rank DeepSpeed ZeRO-3 CPU runs of the smoke
twins (packed shards with spans and sentence-unit shards, both built from the sample corpus by build_shards).

The two-stage smoke run (MNTP + SSCL for 4 steps, then all three) is stopped at the stage switch and resumed: the
losses after the resume are bit-identical to an uninterrupted run. Slow: every other smoke twin trains, and full
MAGNET from the real SmolLM2-135M checkpoint lowers all three losses.
"""

from __future__ import annotations

import glob
import os

import pytest
from helpers import ONE_RANK, REPO, launch_training, logged_steps
from shard_corpus import HOLDOUT, TOKENIZER, TRAIN, documents, write_jsonl_zst

from pipeline.config import to_dict
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import load_experiment
from pipeline.model.attention import VARLEN
from pipeline.tokenizer import load_tokenizer
from pipeline.train.kernels import attn_implementation
from pipeline.train.phases import build_objectives

EXPERIMENTS = os.path.join(REPO, "experiments", "magnet")
LOSSES = ("loss/mntp", "loss/msg", "loss/sscl")
FULL = sorted(p for p in glob.glob(os.path.join(EXPERIMENTS, "*.yaml")) if not p.endswith("-smoke.yaml"))


def _names(objectives) -> set[str]:
    """The losses a phase's objectives train."""
    names = set()
    for o in objectives:
        names |= {"sscl"} if o.name == "sscl" else {k for k in ("mntp", "msg") if getattr(o, f"{k}_weight")}
    return names


def _objectives(exp) -> list[list[tuple]]:
    """Each objective's fields but the mask token (Llama-2's "_" in the full runs, the tokenizer's in the smoke)."""
    return [[{k: v for k, v in to_dict(o).items() if k != "mask_token"} for o in p.objectives] for p in exp.phases]


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
    for phase in smoke.phases:  # the objectives build with the sample tokenizer
        assert build_objectives(phase, tokenizer)


def test_the_variants_are_the_ablations():
    losses = {os.path.basename(p): _names(load_experiment(p).phases[-1].objectives) for p in FULL}
    assert losses == {"magnet.yaml": {"mntp", "msg", "sscl"}, "magnet-two-stage.yaml": {"mntp", "msg", "sscl"},
                      "no-mntp.yaml": {"msg", "sscl"}, "no-sscl.yaml": {"mntp", "msg"},
                      "no-msg.yaml": {"mntp", "sscl"}, "mntp-only.yaml": {"mntp"}}
    first = load_experiment(os.path.join(EXPERIMENTS, "magnet-two-stage.yaml")).phases[0]
    assert [(o.name, getattr(o, "msg_weight", None)) for o in first.objectives] == [("magnet", 0.0), ("sscl", None)]


def test_magnet_trains_on_flex_with_token_edits_for_the_positive_view():
    """The shipped MAGNET run makes SSCL's x+ by attention dropout, which FlexAttention has not, so on CUDA it trains
    on dense-mask SDPA; the documented flex recipe (x+ by cropping, no attention dropout) validates, builds its
    objectives and resolves to the block-sparse kernel (docs/magnet.md, "Attention dropout and FlexAttention")."""
    recipe = ["model.attention_dropout=0", "phases.0.objectives.1.augment=crop"]
    for name in ("magnet.yaml", "magnet-smoke.yaml"):
        path = os.path.join(EXPERIMENTS, name)
        assert attn_implementation(load_experiment(path).model, cuda=True) == "sdpa"
        assert attn_implementation(load_experiment(path, recipe).model, cuda=True) == VARLEN  # FLEX's masks
    smoke = load_experiment(os.path.join(EXPERIMENTS, "magnet-smoke.yaml"), recipe)  # the sample tokenizer's
    magnet, sscl = build_objectives(smoke.phases[0], load_tokenizer(TOKENIZER))
    assert (magnet.objective.name, sscl.objective.config.augment) == ("magnet", "crop")


def build_data(root, docs: list[str], tokenizer: str) -> list[str]:
    """--set overrides pointing a smoke experiment at packed shards of ``docs`` (64 tokens, spans of 8-32 tokens:
    build_shards' defaults) and at their sentence units (build_shards --units sentence, 32 tokens)."""
    corpus = write_jsonl_zst(root / "docs.jsonl.zst", docs)
    shards, units = str(root / "packed"), str(root / "units")
    run_job(BuildConfig(inputs=(corpus,), tokenizer=tokenizer, output=shards, seq_len=64, progress=False))
    run_job(BuildConfig(inputs=(corpus,), tokenizer=tokenizer, output=units, seq_len=32, units="sentence",
                        progress=False))
    return [f"data.shards={shards}", f"data.unit_shards={units}", "data.build_if_missing=false",
            f"data.tokenizer={tokenizer}"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return build_data(tmp_path_factory.mktemp("magnet-data"), documents(HOLDOUT, max_chars=3000)[:20], TOKENIZER)


@pytest.mark.e2e
def test_two_stage_zero3_run_resumes_exactly_at_the_stage_switch(data, tmp_path):
    """With a masking ratio falling from 0.2 to 0.1 over stage 1 and dropping to 0.1 half-way through stage 2."""
    experiment = os.path.join(EXPERIMENTS, "magnet-two-stage-smoke.yaml")
    schedules = ["phases.0.objectives.0.ratio_schedule={shape: linear, final: 0.1}",
                 "phases.1.objectives.0.ratio_schedule={shape: step, steps: [[0.5, 0.1]]}"]
    whole = str(tmp_path / "whole")
    launch_training(whole, experiment, *data, *schedules)
    resumed = str(tmp_path / "resumed")
    first = launch_training(resumed, experiment, *data, *schedules, "train.stop_at_step=4")
    assert "stopped at step 4" in first.stdout
    second = launch_training(resumed, experiment, *data, *schedules)
    assert "resumed from step00000004" in second.stdout
    ours, base = logged_steps(resumed), logged_steps(whole)
    assert sorted(base) == list(range(1, 9))
    assert [base[s]["mask_ratio/mntp"] for s in range(1, 9)] == pytest.approx(
        [0.2, 0.2 - 0.1 / 3, 0.2 - 0.2 / 3, 0.1, 0.2, 0.2, 0.1, 0.1], abs=1e-12)
    for step in range(1, 9):  # stage 1 (steps 1-4): MNTP + SSCL; stage 2: all three
        stage2 = step > 4
        assert base[step]["progress/phase"] == int(stage2)
        assert [k in base[step] for k in LOSSES] == [True, stage2, True], step
        assert {k: ours[step].get(k) for k in (*LOSSES, "mask_ratio/mntp")} == \
            {k: base[step].get(k) for k in (*LOSSES, "mask_ratio/mntp")}, step


# the full recipe and the one without SSCL (no sentence units) in the slow suite; the other ablations (weights of
# zero: every phase of theirs validates and builds in the fast tests) in the extended tests
SMOKE_TWINS = [pytest.param(path, marks=() if os.path.basename(path) in ("magnet-smoke.yaml", "no-sscl-smoke.yaml")
                            else pytest.mark.extended, id=os.path.basename(path))
               for path in sorted(p.replace(".yaml", "-smoke.yaml") for p in FULL if "two-stage" not in p)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("path", SMOKE_TWINS)
def test_smoke_twin_trains(data, tmp_path, path):
    """Every other smoke twin (the two-stage one runs above) trains its losses on 2 ZeRO-3 ranks."""
    launch_training(str(tmp_path / "run"), path, *data)
    steps = logged_steps(str(tmp_path / "run"))
    expected = {f"loss/{n}" for n in _names(load_experiment(path).phases[0].objectives)}
    assert sorted(steps) == list(range(1, 9))
    assert all({k for k in steps[s] if k.startswith("loss/")} == expected for s in steps)


@pytest.mark.e2e
@pytest.mark.slow
def test_smollm2_magnet_run_lowers_all_three_losses(smollm2, tmp_path):
    """Full MAGNET (MNTP + SSCL + MSG) from the real SmolLM2-135M checkpoint (launch/import_gguf.py) on the fastest
    CPU layout (one rank, ZeRO-0; the smoke twins run on 2 ZeRO-3 ranks): each training loss of the last two steps is
    well below that of the first two."""
    data = build_data(tmp_path, documents(TRAIN, max_chars=2000)[:40], smollm2)
    run = str(tmp_path / "run")
    launch_training(run, os.path.join(EXPERIMENTS, "magnet-smoke.yaml"), *data, f"model.init={smollm2}",
                    "phases.0.objectives.0.mask_token=_", "train.micro_batch=4", "train.grad_accum=2",
                    "data.unit_micro_batch=8", "optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=1e-4",
                    "optim.weight_decay=0.0", "checkpoint.every=100", **ONE_RANK)
    steps = logged_steps(run)
    assert sorted(steps) == list(range(1, 9))
    for loss in LOSSES:
        first, last = (sum(steps[s][loss] for s in pair) / 2 for pair in ((1, 2), (7, 8)))
        assert last < first - 0.3, (loss, [round(steps[s][loss], 3) for s in steps])
