"""Context extension as a phase (docs/training.md, "Context extension"): a phase's own shards, sequence length,
micro-batch and RoPE theta, filled from the run's settings and refused in one line when they cannot work; the
rotary buffers a model gets from a new theta; the planner's price of each phase; and on 2 ZeRO-3 ranks the switch
at the phase boundary (batches of the new length, the theta in the model and in the export, which plain
transformers reloads with it) and a resume at the start of the extension phase that continues bit for bit."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from helpers import launch_training, logged_steps, make_shard_dir
from transformers import AutoModel, AutoModelForCausalLM

from pipeline.config import ConfigError
from pipeline.experiment import SAMPLE_INPUTS, load_experiment, sample_shards
from pipeline.export.hf import export_checkpoint
from pipeline.model.presets import get_preset
from pipeline.model.rope import set_rope
from pipeline.planner.estimates import run_flops
from pipeline.planner.report import main as plan_main
from pipeline.run_dir import RunDir
from pipeline.train.preflight import check_setup

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))
ETTIN_SMOKE = os.path.join(REPO, "experiments", "ettin", "ettin-210m-smoke.yaml")
MLM = "{name: mlm, ratio: 0.3}"


def phases(*extension: str) -> str:
    """``phases`` of a pretraining phase at the run's settings and an extension phase with ``extension`` fields."""
    return (f"phases=[{{name: pre, share: 0.5, objectives: [{MLM}]}}, "
            f"{{name: ext, share: 0.5, objectives: [{MLM}], {', '.join(extension)}}}]")


def experiment(*extension: str, overrides: tuple[str, ...] = ()):
    return load_experiment(None, ["data.seq_len=64", "train.micro_batch=4", phases(*extension), *overrides])


def test_a_phase_fills_its_data_from_the_run_and_keeps_the_tokens_per_micro_batch():
    exp = experiment("seq_len: 128", "rope_theta: 40000")
    pre, ext = exp.phase_data(0), exp.phase_data(1)
    assert (pre.shards, pre.seq_len, pre.micro_batch, pre.loader) == (sample_shards(64), 64, 4, "packed")
    assert (pre.rope_theta, pre.context) == (None, 64)
    # the sample corpus at the phase's length, built unasked; its own loader and order
    assert (ext.shards, ext.seq_len, ext.micro_batch, ext.loader) == (sample_shards(128), 128, 2, "phases[1]")
    assert (ext.build_inputs, ext.rope_theta, ext.context) == (SAMPLE_INPUTS, 40000.0, 128)
    three = load_experiment(None, ["data.seq_len=64", "data.shards=/d64", "data.build_inputs=[in.jsonl]",
                                   "phases=[{share: 0.5, objectives: [{name: clm}]}, {share: 0.25, objectives: "
                                   "[{name: clm}], seq_len: 256, shards: /d256, rope_theta: 1e5, micro_batch: 3}, "
                                   "{share: 0.25, objectives: [{name: clm}], shards: /d256, seq_len: 256, "
                                   "micro_batch: 3}]"])
    last = three.phase_data(2)  # the decay phase continues the extension's shards (one loader) and keeps its theta
    assert (last.shards, last.loader, last.micro_batch, last.rope_theta) == ("/d256", "phases[1]", 3, 1e5)
    assert last.build_inputs == ("in.jsonl",)


@pytest.mark.parametrize(("fields", "overrides", "starts"), [
    (("seq_len: 128",), ("data.shards=/d64",), "phases[1].shards: the phase's seq_len 128 is not data.seq_len 64"),
    (("seq_len: 96",), (), "phases[1].micro_batch: 0 keeps the run's 256 tokens per micro-batch"),
    (("micro_batch: 2",), (), "phases[1].micro_batch: 2, but runs/shards/sample-64 is read with train.micro_batch 4"),
    (("seq_len: 4",), (), "phases[1].seq_len: 4 is out of range"),
    (("seq_len: 128", "shards: runs/shards/sample-64"), (), "phases[1].seq_len: 128, but its shards "
                                                            "runs/shards/sample-64 are read at data.seq_len 64"),
    (("rope_theta: 0",), (), "phases[1].rope_theta: 0.0 is out of range"),
])
def test_a_phase_that_cannot_work_is_refused_in_one_line_naming_the_field(fields, overrides, starts):
    with pytest.raises(ConfigError) as e:
        experiment(*fields, overrides=overrides)
    assert str(e.value).startswith(starts) and "\n" not in str(e.value), str(e.value)


def test_preflight_refuses_a_phases_missing_shards_it_may_not_build_in_one_line(tmp_path):
    missing = tmp_path / "ext-128"
    exp = load_experiment(None, [f"run_dir={tmp_path / 'run'}", "data.seq_len=32", "train.micro_batch=4",
                                 f"data.shards={make_shard_dir(tmp_path, seq_len=32)}", "data.build_if_missing=false",
                                 phases("seq_len: 128", f"shards: {missing}")])
    with pytest.raises(ConfigError) as e:
        check_setup(exp, 0, 1, False)
    assert str(e.value) == (f"phases[1].shards: {missing} is not a shard directory; build it with "
                            f"data_prep/build_shards.py or set data.build_if_missing=true with data.build_inputs")
    assert not missing.exists()


def test_set_rope_gives_the_model_a_fresh_build_with_that_theta_would_have():
    config = get_preset("tiny").to_config(128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    wanted = copy.deepcopy(config)
    wanted.rope_parameters["rope_theta"], wanted.max_position_embeddings = 40000.0, 512
    fresh = AutoModelForCausalLM.from_config(wanted)
    fresh.load_state_dict(model.state_dict())
    ids = torch.randint(4, 128, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)
        assert set_rope(model, 40000.0, 512)
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)
    assert model.config.rope_parameters["rope_theta"] == 40000.0 and model.config.max_position_embeddings == 512
    assert not set_rope(model, None, 64)  # keep: nothing changes (a context below the config's stays)
    assert not set_rope(model, 40000.0, 512)


def test_the_planner_prices_each_phase_at_its_sequence_length():
    def flops(*overrides: str) -> float:
        return run_flops(load_experiment(None, ["model.init=210m", "train.steps=100", *overrides]), 8, 32000)

    pre = flops("data.seq_len=1024", "train.micro_batch=8", "phases=[{objectives: [{name: mlm, ratio: 0.3}]}]")
    ext = flops("data.seq_len=8192", "train.micro_batch=1", "phases=[{objectives: [{name: mlm, ratio: 0.3}]}]")
    both = flops("data.seq_len=1024", "train.micro_batch=8", "phases=[{share: 0.75, objectives: [{name: mlm, "
                 "ratio: 0.3}]}, {share: 0.25, seq_len: 8192, shards: /d, objectives: [{name: mlm, ratio: 0.3}]}]")
    assert both == pytest.approx(0.75 * pre + 0.25 * ext, rel=1e-12)
    assert ext > pre  # the same tokens per step (micro-batch 8 -> 1): attention over 8x longer rows costs more


def test_the_planners_grid_report_lists_each_phases_tokens(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(
        "data: {shards: /d1024, seq_len: 1024}\nmodel: {init: 210m}\ntrain: {steps: 1000, micro_batch: 16}\n"
        "phases:\n  - {name: pre, share: 0.75, objectives: [{name: mlm, ratio: 0.3}]}\n"
        "  - {name: ext, share: 0.25, objectives: [{name: mlm, ratio: 0.3}], seq_len: 8192, shards: /d8192}\n")
    (tmp_path / "grid.yaml").write_text(
        f"base: base.yaml\nds_config: {REPO}/ds_configs/zero3.json\nglobal_batch: 128\n"
        "resources: {nodes: 1, gpus_per_node: 8}\naxes: {size: {210m: {model.init: 210m}}}\n"
        "groups: {ext: {axes: {size: [210m]}}}\n")
    assert plan_main(["--model", "210m", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "h100", "--grid",
                      str(tmp_path / "grid.yaml")]) == 0
    # 750 steps x 128 x 1024 tokens, then 250 x (8 ranks x micro-batch 2) x 8192: 98.3 M + 32.8 M
    assert "    pre 0.10B at seq_len 1024, ext 0.03B at seq_len 8192" in capsys.readouterr().out


def test_the_ettin_recipe_and_its_smoke_twin_have_the_same_three_phases():
    """experiments/ettin: pretraining, context extension (own shards, longer rows, a larger theta, the tokens per
    step kept), decay on the extension's shards with the masking ratio falling to 0.15 while WSD decays the lr."""
    for name in ("ettin-210m.yaml", "ettin-210m-smoke.yaml"):
        exp = load_experiment(os.path.join(REPO, "experiments", "ettin", name))
        assert [p.name for p in exp.phases] == ["pretrain", "context-extension", "decay"], name
        pre, ext, decay = map(exp.phase_data, range(3))
        assert ext.seq_len == decay.seq_len > pre.seq_len and ext.loader == decay.loader != pre.loader, name
        assert pre.rope_theta is None and ext.rope_theta == decay.rope_theta > 10000, name
        assert ext.micro_batch * ext.seq_len == pre.micro_batch * pre.seq_len, name
        assert exp.optim.decay(exp.train.steps) == exp.phase_lengths()[2], name
        assert exp.train.batch_warmup.steps and exp.checkpoint.async_save, name
        schedule = exp.phases[2].objectives[0].ratio_schedule
        assert (exp.phases[2].objectives[0].ratio, schedule.shape, schedule.final) == (0.3, "linear", 0.15), name


@pytest.mark.e2e
def test_the_ettin_smoke_twin_switches_context_exports_the_theta_and_resumes_exactly(shards, tmp_path):
    """experiments/ettin/ettin-210m-smoke.yaml on 2 ZeRO-3 ranks, 8 steps: 4 at seq_len 64 on ``shards`` (the batch
    warming up over the first 2), 2 of context extension at 128 with RoPE theta 40 000 on shards rank 0 builds at
    the start (micro-batch 2 -> 1: the tokens per step kept), 2 of decay on them with the masking ratio falling from
    0.3 to 0.15; checkpoints written by async_save. The resumed run starts from a copy of the straight run's step-4
    checkpoint (what a run stopped there leaves), at the first step of the extension phase."""
    ext_shards = str(tmp_path / "sample-128")
    settings = [f"data.shards={shards}", f"data.build_inputs=[{SAMPLE_INPUTS[0]}]", f"phases.1.shards={ext_shards}",
                f"phases.2.shards={ext_shards}"]
    straight = str(tmp_path / "straight")
    out = launch_training(straight, ETTIN_SMOKE, *settings).stdout
    assert f"building shards of ['{SAMPLE_INPUTS[0]}'] into {ext_shards} (seq_len 128)" in out
    assert "phase context-extension: seq_len 128, RoPE {'rope_type': 'default', 'rope_theta': 40000.0}" in out
    base = logged_steps(straight)
    assert [base[s]["progress/seq_len"] for s in range(1, 9)] == [64] * 4 + [128] * 4
    assert [base[s]["phase"] for s in range(1, 9)] == ["pretrain"] * 4 + ["context-extension"] * 2 + ["decay"] * 2
    assert [base[s]["batch/samples/packed"] for s in range(1, 9)] == [4, 4, 8, 8, 4, 4, 4, 4]  # warmup, then 1 x 128
    assert [base[s]["mask_ratio/mlm"] for s in range(1, 9)] == [0.3] * 7 + [0.15]

    # each loader's place in its own order: data.shards' 4 steps (24 samples), the extension's 4 steps x 4
    states = torch.load(os.path.join(RunDir(straight).checkpoint(8), "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                        weights_only=False)["loaders"]
    assert (states["packed"]["samples_consumed"], states["phases[1]"]["samples_consumed"]) == (24, 16)
    assert (states["packed"]["global_batch"], states["phases[1]"]["global_batch"]) == (8, 4)

    resumed = str(tmp_path / "resumed")
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step00000008", "hf"))
    assert RunDir(resumed).complete_steps() == [4]
    again = launch_training(resumed, ETTIN_SMOKE, *settings).stdout
    assert "resumed from step00000004" in again and "building shards" not in again
    assert "phase context-extension: seq_len 128, RoPE {'rope_type': 'default', 'rope_theta': 40000.0}" in again
    ours = logged_steps(resumed)
    for step in range(5, 9):
        assert ours[step]["loss/mlm"] == base[step]["loss/mlm"], step
        assert ours[step]["progress/seq_len"] == 128

    hf = os.path.join(straight, "hf")
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    assert config["rope_parameters"]["rope_theta"] == 40000.0 and config["max_position_embeddings"] == 256
    with open(os.path.join(hf, "README.md")) as f:
        assert (f"- **context-extension** (2 steps, 25% of the run; bidirectional attention; data: "
                f"`{os.path.basename(ext_shards)}` at sequence length 128, RoPE θ 40000):\n  - MLM: ") in f.read()
    offline = str(tmp_path / "offline")  # from the checkpoint: the theta of the phase that trained step 8
    assert export_checkpoint(RunDir(straight), offline) == 8
    ids = torch.randint(4, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = AutoModel.from_pretrained(hf).eval()
        head_dim = model.config.head_dim
        assert torch.allclose(model.rotary_emb.inv_freq, 1 / 40000 ** (torch.arange(0, head_dim, 2) / head_dim))
        exported = model(input_ids=ids).last_hidden_state
        assert torch.equal(AutoModel.from_pretrained(offline).eval()(input_ids=ids).last_hidden_state, exported)
        start_theta = AutoModel.from_pretrained(hf, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        assert not torch.allclose(start_theta.eval()(input_ids=ids).last_hidden_state, exported, atol=1e-3)
