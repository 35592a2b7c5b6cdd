"""What a new user trips over (issue 33): a mistyped path, a broken override, a short run, an unknown key, a
planner without --gpu. Each is one line that names the setting and the fix, or a default that fits, and nothing
trains on data the user did not name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, cpu_env, launch_training, one_error, training_launch

from pipeline.config import ConfigError
from pipeline.data.format.index import load_index
from pipeline.experiment import SAMPLE_INPUTS, load_experiment
from pipeline.planner.estimates import GPUS, gpu_key
from pipeline.train.engine_spec import lr_schedule
from pipeline.train.schedule import lr_multiplier

BAD_YAML = "phases=[{objectives: [{name: mlm, ratio: 0.3}]"


def test_only_the_sample_shard_directory_is_built_from_the_sample_corpus():
    default = load_experiment(None)
    assert default.data.shards == "runs/shards/sample-128" and default.data.build_inputs == list(SAMPLE_INPUTS)
    shorter = load_experiment(None, ["data.seq_len=64"])
    assert shorter.data.shards == "runs/shards/sample-64" and shorter.data.build_inputs == list(SAMPLE_INPUTS)
    assert load_experiment(None, ["data.shards=runs/shards/sampel-128"]).data.build_inputs == []
    named = load_experiment(None, ["data.shards=/data/mine", "data.build_inputs=[/data/mine.jsonl]"])
    assert named.data.build_inputs == ["/data/mine.jsonl"]


def _my_data(path) -> str:
    """A corpus that is not the sample: 300 numbered records of its own words (~60 packed samples of 128)."""
    with open(path, "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"Record {i}: the ledger of harbour {i % 17} lists {i * 7} crates of "
                                        f"tin and {i % 5} barrels of oil, checked at dawn."}) + "\n")
    return str(path)


def test_named_inputs_get_a_shard_directory_of_their_own_and_never_the_samples(tmp_path):
    """data.build_inputs named with data.shards left at its default used to read the sample's directory."""
    mine = _my_data(tmp_path / "mydata.jsonl")
    first = load_experiment(None, [f"data.build_inputs=[{mine}]"]).data.shards
    assert first.startswith(os.path.join("runs", "shards", "mydata-")) and first.endswith("-128")
    assert load_experiment(None, [f"data.build_inputs=[{mine}]"]).data.shards == first  # found again: reused
    assert load_experiment(None, [f"data.build_inputs=[{mine}]", "data.seq_len=64"]).data.shards.endswith("-64")
    with open(mine, "a") as f:
        f.write(json.dumps({"text": "one more record"}) + "\n")
    assert load_experiment(None, [f"data.build_inputs=[{mine}]"]).data.shards != first  # changed: built anew
    with pytest.raises(ConfigError, match=r"^data.shards: runs/shards/sample-128 is the sample corpus's directory, "
                                          r"but data.build_inputs names .*; leave data.shards unset"):
        load_experiment(None, ["data.shards=runs/shards/sample-128", f"data.build_inputs=[{mine}]"])
    with pytest.raises(ConfigError, match=r"^data.build_inputs: '.*nope.jsonl' matches no file"):
        load_experiment(None, [f"data.build_inputs=[{tmp_path / 'nope.jsonl'}]"])


@pytest.mark.e2e
@pytest.mark.slow
def test_the_deepspeed_launcher_trains_on_the_inputs_named(tmp_path):
    """The issue's command: ``deepspeed launch/train.py --config ds_configs/zero3.json --set
    'data.build_inputs=[mydata.jsonl]' --set train.steps=3`` builds and trains on mydata.jsonl."""
    mine = _my_data(tmp_path / "mydata.jsonl")
    shards = os.path.join(REPO, load_experiment(None, [f"data.build_inputs=[{mine}]"]).data.shards)
    try:
        proc = launch_training(str(tmp_path / "run"), None, f"data.build_inputs=[{mine}]", "train.steps=3",
                               nproc=1, launcher="deepspeed")
        assert f"building shards of ['{mine}'] into {os.path.relpath(shards, REPO)} (seq_len 128)" in proc.stdout
        recorded = json.load(open(tmp_path / "run" / "experiment.json"))["data"]["shards"]
        assert os.path.join(REPO, recorded) == shards
        assert [f["path"] for job in load_index(shards).jobs for f in job["files"]] == [mine]
    finally:
        shutil.rmtree(shards, ignore_errors=True)


@pytest.mark.e2e
def test_a_mistyped_shard_directory_is_one_line_and_trains_nothing(tmp_path):
    """It used to build the sample corpus (Shakespeare) into the misspelt directory, train on it and exit 0."""
    typo = tmp_path / "shardz"
    proc = subprocess.run(_train(f"run_dir={tmp_path / 'run'}", f"data.shards={typo}", "train.steps=2"),
                          capture_output=True, text=True, cwd=REPO, env=cpu_env(), timeout=600)
    line = one_error(proc, "config error")
    assert line.startswith(f"config error: data.shards: {typo} holds no shards (no manifest.json) and "
                           f"data.build_inputs names nothing to build them from; check the path")
    assert "set data.build_inputs=[FILES]" in line and proc.returncode == 2
    assert not typo.exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_lora_on_a_preset_is_one_line_and_trains_nothing(tmp_path):
    """It trained and wrote an adapter whose base_model_name_or_path was "tiny": no loader can find that base."""
    proc = subprocess.run(_train(f"run_dir={tmp_path / 'run'}", "model.lora.r=4", "train.steps=2"),
                          capture_output=True, text=True, cwd=REPO, env=cpu_env(), timeout=600)
    line = one_error(proc, "config error")
    assert line == ("config error: model.lora.r: 4, but model.init 'tiny' is a preset with random weights, and LoRA "
                    "adapts a trained model; set model.init to a checkpoint directory (e.g. a run's hf/ export) or "
                    "model.lora.r=0 for full-parameter training") and proc.returncode == 2
    assert not (tmp_path / "run" / "hf").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def _train(*overrides: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "launch", "train.py"), *[a for o in overrides for a in ("--set", o)]]


@pytest.mark.e2e
@pytest.mark.parametrize("command,prefix", [
    (_train(BAD_YAML), "config error"),
    ([sys.executable, os.path.join(REPO, "launch", "sweep.py"), os.path.join(REPO, "experiments", "mlm_vs_clm",
                                                                             "grid.yaml"), "--set", BAD_YAML], "error"),
    ([sys.executable, os.path.join(REPO, "launch", "evaluate.py"), "--model", "runs/none", "--tasks", "sts",
      "--out", "x.json", "--set", "sts.batch=[1"], "error"),
], ids=["train", "sweep", "evaluate"])
def test_an_override_that_is_not_yaml_is_one_line(command, prefix, tmp_path):
    """It was PyYAML's traceback of some 60 lines."""
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=cpu_env(), timeout=300)
    line = one_error(proc, prefix)
    assert "the value is not valid YAML (expected ',' or " in line and "at character" in line, line
    assert "e.g. --set 'phases=[{objectives: [{name: mlm, ratio: 0.3}]}]'" in line


def test_a_short_run_fits_the_default_schedule_and_fixed_counts_that_do_not_fit_say_the_fix():
    """warmup 30 + decay 60 steps made every run under 90 steps a config error."""
    short = load_experiment(None, ["train.steps=10"])
    assert (short.optim.warmup(10), short.optim.decay(10)) == (1, 2)
    assert [lr_multiplier(s, lr_schedule(short.optim, 10)) for s in (0, 1, 7, 8, 9)] == [1.0, 1.0, 1.0, 1.0, 0.5]
    default = load_experiment(None)  # 0.1 and 0.2 of 300 steps: the fixed counts it had
    assert (default.optim.warmup(300), default.optim.decay(300)) == (30, 60)
    cosine = load_experiment(None, ["train.steps=10", "optim.schedule=cosine", "optim.decay_steps=30"])
    assert cosine.optim.decay(10) == 0  # only wsd decays at the end
    with pytest.raises(ConfigError, match=r"^optim: 30 warmup \+ 2 decay steps \(optim.warmup_steps=30\) exceed "
                                          r"train.steps \(10\); lower them, or leave them unset to take fractions "
                                          r"of the run \(optim.warmup_ratio=0.1, optim.decay_ratio=0.2\)$"):
        load_experiment(None, ["train.steps=10", "optim.warmup_steps=30"])
    with pytest.raises(ConfigError, match=r"^optim: warmup_ratio \+ decay_ratio \(0.9 \+ 0.2\) exceed 1"):
        load_experiment(None, ["optim.warmup_ratio=0.9"])


def test_an_unknown_key_suggests_the_one_meant():
    with pytest.raises(ConfigError, match=r"^data.shard: unknown key; did you mean data.shards\? allowed keys: "):
        load_experiment(None, ["data.shard=x"])
    with pytest.raises(ConfigError, match=r"^zzz: unknown key; allowed keys: \['name'"):
        load_experiment(None, ["zzz=1"])


def test_the_planner_takes_the_visible_gpu_and_without_one_names_the_choices():
    assert [gpu_key(n, m) for n, m in [("NVIDIA H200", 139.8), ("NVIDIA H100 80GB HBM3", 79.1),
                                       ("NVIDIA A100-SXM4-40GB", 39.4), ("NVIDIA A100-SXM4-80GB", 79.2),
                                       ("NVIDIA L40S", 44.5), ("AMD Instinct MI300X", 191.5), ("Tesla T4", 14.6)]] \
        == ["h200", "h100", "a100-40", "a100", "l40s", "mi300x", None]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "plan.py"), "--model", "210m", "--nodes", "1",
                           "--gpus-per-node", "8"], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (f"plan.py: error: --gpu: no GPU is visible here to plan for; name the "
                                            f"cluster's: {', '.join(sorted(GPUS))}")


@pytest.mark.e2e
def test_a_refused_start_through_the_launcher_starts_no_process_group_and_leaves_nothing(tmp_path):
    """Issue 44: a mistyped data.shards through the ``deepspeed`` launcher took 13-90 s, the ranks starting the
    process group and DeepSpeed's CPU op before the config was checked, and left a run directory holding only
    ``.lock``. Each rank now checks it alone first."""
    run = tmp_path / "run"
    proc = launch_training(str(run), None, f"data.shards={tmp_path / 'shardz'}", check=False, launcher="deepspeed")
    line = one_error(proc, "config error")
    assert line.startswith(f"config error: data.shards: {tmp_path / 'shardz'} holds no shards") and proc.returncode == 2
    assert "deepspeed_shm_comm" not in proc.stdout + proc.stderr  # the CPU collectives op: the group never started
    assert not run.exists() and not (tmp_path / "shardz").exists()


@pytest.mark.e2e
def test_check_runs_through_the_real_script_and_the_deepspeed_launcher(tmp_path):
    """``--check`` as a user runs it on a login node (no launcher, the cluster named) and through the launcher (its
    ranks): one report, exit 0, and nothing written; a bad override: one line, exit 2."""
    run = tmp_path / "run"
    script = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--set", f"run_dir={run}", "--set",
              "train.steps=10", "--check"]
    env = {k: v for k, v in cpu_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    plain = subprocess.run([*script, "--gpu", "h100", "--nodes", "4"], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=600)
    assert plain.returncode == 0 and "on 32 ranks (4 nodes x 8 h100 GPUs)" in plain.stdout, plain.stderr[-3000:]
    assert "no launcher" not in plain.stderr and "GiB per GPU of 80" in plain.stdout
    bad = subprocess.run([*script, "--set", "train.micro_batch=0"], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=600)
    assert one_error(bad, "config error") == "config error: train.micro_batch: 0 is out of range; it must be >= 1"
    assert bad.returncode == 2 and bad.stdout == ""
    with training_launch(str(run), None, "train.steps=10", launcher="deepspeed") as (cmd, launch_env):
        launched = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=REPO, env=launch_env,
                                  timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("check passed") == 1 and "on 2 ranks (1 node x 2 CPU ranks)" in launched.stdout
    assert not run.exists()
