"""Grid expansion (pipeline/grid.py) and the sweep's run directories and job files (pipeline/sweep/,
launch/sweep.py) on small grid files; bad grids name the file, the key and what exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

from pipeline.config import ConfigError, load_yaml, to_dict
from pipeline.experiment import load_experiment
from pipeline.grid import Resources, load_grid
from pipeline.io import REPO
from pipeline.sweep.local import local_env
from pipeline.sweep.plan import SweepRequest, check_inputs, in_order, prepare, recorded, select, write_run
from pipeline.sweep.slurm import job_script
from pipeline.sweep.status import RunState, run_states, table

BASE = {"name": "base", "model": {"init": "610m"}, "optim": {"warmup_steps": 200, "decay_steps": 200},
        "train": {"steps": 1000, "micro_batch": 4}, "phases": [{"objectives": [{"name": "clm"}]}]}
AXES = {"size": {"210m": {"model.init": "210m"}, "610m": {"model.init": "610m"}},
        "share": {"clm50": {"phases": [{"share": 0.5, "objectives": [{"name": "clm"}]},
                                       {"share": 0.5, "objectives": [{"name": "mlm", "ratio": 0.4}]}]},
                  "clm90": {"phases": [{"share": 0.9, "objectives": [{"name": "clm"}]},
                                       {"share": 0.1, "objectives": [{"name": "mlm", "ratio": 0.4}]}]},
                  "clm10": {"phases": [{"share": 0.1, "objectives": [{"name": "clm"}]},
                                       {"share": 0.9, "objectives": [{"name": "mlm", "ratio": 0.4}]}]}},
        "start": {"from610m": {"model.init": "${run:pre-610m-clm50}/hf", "model.shape": "610m"},
                  "from210m": {"model.init": "${run:pre-210m-clm50}/hf", "model.shape": "610m"}}}


def write_grid(tmp_path, **changes) -> str:
    grid = {"base": "base.yaml", "global_batch": 32, "resources": {"nodes": 2, "gpus_per_node": 4},
            "switch_before_decay": True, "smoke": {"step_divisor": 100, "global_batch": 8},
            "axes": AXES, "groups": {"pre": {"axes": {"size": ["210m", "610m"], "share": ["clm50"]}},
                                     "cont": {"axes": {"start": ["from610m"]}}}}
    grid.update(changes)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    return str(tmp_path / "grid.yaml")


def test_variants_combine_axes_in_order_and_derive_grad_accum(tmp_path):
    grid = load_grid(write_grid(tmp_path))
    variants = {v.name: v for v in grid.variants(out="out")}
    assert list(variants) == ["pre-210m-clm50", "pre-610m-clm50", "cont-from610m"]
    v = variants["pre-210m-clm50"]
    assert v.experiment.model.init == "210m" and v.values == {"size": "210m", "share": "clm50"}
    assert v.experiment.phase_starts() == [0, 500] and v.experiment.run_dir == os.path.join("out", v.name)
    assert v.experiment.train.grad_accum == 32 // (4 * 8)  # global batch / (micro-batch x 2 nodes x 4)
    cont = variants["cont-from610m"]
    assert cont.experiment.model.init == os.path.join("out", "pre-610m-clm50", "hf")
    assert cont.after == ("pre-610m-clm50",)
    bigger = {v.name: v for v in grid.variants(resources=Resources(nodes=1, gpus_per_node=2))}
    assert bigger["pre-210m-clm50"].experiment.train.grad_accum == 4  # same global batch on fewer ranks


def test_twins_train_with_their_own_deepspeed_config_where_smoke_names_one(tmp_path):
    grid = load_grid(write_grid(tmp_path, ds_config="zero2.json",
                                smoke={"step_divisor": 100, "global_batch": 8, "ds_config": "zero0.json",
                                       "resources": {"nodes": 1, "gpus_per_node": 1, "gpu": False}}))
    full, twin = grid.variants()[0], grid.variants(smoke=True)[0]
    assert (full.ds_config, twin.ds_config) == (str(tmp_path / "zero2.json"), str(tmp_path / "zero0.json"))
    assert twin.experiment.train.grad_accum == 8 // (4 * 1)  # one rank carries the twins' whole global batch
    assert load_grid(write_grid(tmp_path)).variants(smoke=True)[0].ds_config.endswith("ds_configs/zero3.json")


def test_a_local_run_splits_the_cores_among_its_cpu_ranks_unless_the_user_chose():
    cores = len(os.sched_getaffinity(0))
    one, two = Resources(nodes=1, gpus_per_node=1, gpu=False), Resources(nodes=1, gpus_per_node=2, gpu=False)
    assert local_env(one, {})["OMP_NUM_THREADS"] == str(cores) and local_env(one, {})["DS_ACCELERATOR"] == "cpu"
    assert local_env(two, {})["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert local_env(one, {"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in local_env(Resources(nodes=1, gpus_per_node=8), {})


def test_smoke_twins_divide_steps_and_keep_the_switch(tmp_path):
    grid = load_grid(write_grid(tmp_path))
    twins = {v.name: v for v in grid.variants(smoke=True, out="out")}
    assert list(twins) == ["pre-210m-clm50-smoke", "pre-610m-clm50-smoke", "cont-from610m-smoke"]
    exp = twins["pre-610m-clm50-smoke"].experiment
    assert (exp.train.steps, exp.optim.warmup_steps, exp.optim.decay_steps) == (10, 2, 2)
    assert exp.phase_starts() == [0, 5] and exp.model.init == "tiny"
    assert exp.train.grad_accum == 8 // (4 * 2)  # smoke global batch over the twin's 1 node x 2 CPU ranks
    cont = twins["cont-from610m-smoke"]
    assert cont.experiment.model.init == os.path.join("out", "pre-610m-clm50-smoke", "hf")
    assert cont.experiment.model.shape == "tiny" and cont.after == ("pre-610m-clm50-smoke",)


@pytest.mark.parametrize("changes, message", [
    ({"groups": {"g": {"axes": {"size": ["620m"]}}}},
     r"groups.g.axes.size: unknown value '620m'; values of size: \['210m', '610m'\]"),
    ({"groups": {"g": {"axes": {"sizes": ["610m"]}}}}, r"groups.g.axes: unknown axis 'sizes'; axes: \['size'"),
    ({"groups": {"g": {"axes": {"size": ["610m"]}, "exclude": ["g-620m"]}}},
     r"groups.g.exclude: \['g-620m'\] name no variant of this group; its variants: \['g-610m'\]"),
    ({"groups": {"g": {"axes": {"start": ["from610m"]}}}}, r"g-from610m: \$\{run:pre-610m-clm50\} names no variant"),
    ({"groups": {"g": {"axes": {"share": ["clm90"]}}}},
     r"g-clm90: phase 'mlm' starts at step 900, inside the learning-rate decay \(steps 800-1000\)"),
    ({"groups": {"a": {"prefix": "x", "axes": {"size": ["610m"]}}, "b": {"prefix": "x", "axes": {"size": ["610m"]}}}},
     r"groups.b: variant 'x-610m' is also made by group 'a'"),
    ({"global_batch": 30}, r"pre-210m-clm50: global_batch 30 is not a multiple of train.micro_batch 4 x 8 ranks"),
    ({"groups": {"pre": {"axes": {"size": ["610m"], "share": ["clm50"]}}, "c": {"axes": {"start": ["from210m"]}}}},
     r"c-from210m: \$\{run:pre-210m-clm50\} names no variant"),
    ({"groups": {"pre": {"axes": {"size": ["210m", "610m"], "share": ["clm50"]}}, "c": {"axes": {"start": ["from210m"]}}}},
     r"c-from210m: continues pre-210m-clm50, a 210m model, but its model.shape is '610m'"),
    ({"groups": {"g": {"set": {"train.stepz": 3}, "axes": {"size": ["610m"]}}}}, r"g-610m: train.stepz: unknown key"),
    ({"groupz": {}}, r"groupz: unknown key; did you mean groups\? allowed keys"),
    ({"resources": {"nodes": 2, "gpus_per_node": 4, "cpus_per_gpu": 0}},
     r"resources: nodes, gpus_per_node and cpus_per_gpu must be >= 1, got 2, 4, 0"),
    ({"smoke": {"step_divisor": 500}, "groups": {"g": {"axes": {"share": ["clm10"]}}}},
     r"g-clm10-smoke: phase 'clm' gets no step of train.steps 2 \(share 0.1\)"),
])
def test_bad_grid_names_file_key_and_choices(tmp_path, changes, message):
    path = write_grid(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as info:
        load_grid(path).variants(smoke="smoke" in changes)
    assert str(info.value).startswith(path)


def test_only_selects_by_pattern_and_refuses_unknown_names(tmp_path):
    variants = load_grid(write_grid(tmp_path)).variants(smoke=True)
    assert [v.name for v in select(variants, ["pre-6*"])] == ["pre-610m-clm50-smoke"]  # a twin matches its variant
    with pytest.raises(ConfigError, match=r"--only \['pre-2b-\*'\]: no variant of this grid matches; its variants"):
        select(variants, ["pre-2b-*"])


def test_a_run_that_continues_another_needs_it(tmp_path):
    variants = load_grid(write_grid(tmp_path)).variants(out=str(tmp_path / "runs"))
    states = run_states(variants, {})
    cont = [v for v in variants if v.name == "cont-from610m"]
    with pytest.raises(ConfigError, match="cont-from610m starts from pre-610m-clm50, which is new and not part of "
                                          "this sweep; add it"):
        in_order(cont, variants, states)
    assert [v.name for v in in_order(cont[::-1] + variants[:2], variants, states)] == [
        "pre-610m-clm50", "cont-from610m", "pre-210m-clm50"]
    queued = run_states(variants, {"pre-610m-clm50": 17})
    assert queued["pre-610m-clm50"] == RunState("queued", 0, 17)
    assert [v.name for v in in_order(cont, variants, queued)] == ["cont-from610m"]
    assert "queued (job 17, step 0/1000)" in table(variants, queued)


def test_run_directory_holds_the_experiment_and_a_job_file_from_train_sbatch(tmp_path):
    grid = load_grid(write_grid(tmp_path))
    v = grid.variants(out=str(tmp_path / "runs"), resources=Resources(nodes=2, gpus_per_node=4, time="4:00:00"))[0]
    write_run(grid, v, RunState("new"))
    exp = load_experiment(os.path.join(v.experiment.run_dir, "experiment.yaml"))
    assert to_dict(exp) == recorded(to_dict(v.experiment))  # the sample corpus's default: inside the repository
    assert exp.data.build_inputs == [os.path.join("data", "sample", "train", "**", "*.jsonl.zst")]
    job = open(os.path.join(v.experiment.run_dir, "job.sbatch")).read()
    # 8 cores a GPU rank by default: the node's one task serves its 4 ranks
    for line in (f"#SBATCH --job-name={v.name}", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32",
                 "#SBATCH --time=4:00:00", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@300",
                 f"#SBATCH --output={v.experiment.run_dir}/slurm-%j.out", "export GPUS_PER_NODE=4",
                 f"exec bash {REPO}/launch/slurm/train.sbatch --config {REPO}/ds_configs/zero3.json "
                 f"--experiment {v.experiment.run_dir}/experiment.yaml"):
        assert line in job.splitlines(), line
    assert job.count("#SBATCH --job-name") == 1 and "DS_ACCELERATOR" not in job
    cpu = job_script(grid, grid.variants(smoke=True, out=str(tmp_path / "runs"))[0])
    assert "#SBATCH --cpus-per-task=2" in cpu and "--gpus-per-node" not in cpu and "DS_ACCELERATOR" in cpu
    wide = load_grid(write_grid(tmp_path, resources={"nodes": 1, "gpus_per_node": 8, "cpus_per_gpu": 12}))
    wide_job = job_script(wide, wide.variants(out=str(tmp_path / "runs"))[0]).splitlines()
    assert "#SBATCH --cpus-per-task=96" in wide_job and "#SBATCH --gpus-per-node=8" in wide_job


def test_a_started_run_keeps_its_experiment(tmp_path):
    out = str(tmp_path / "runs")
    grid = load_grid(write_grid(tmp_path))
    v = grid.variants(out=out)[0]
    write_run(grid, v, RunState("new"))
    started = RunState("started", 100)
    fewer = grid.variants(out=out, resources=Resources(nodes=1, gpus_per_node=4))[0]
    write_run(grid, fewer, started)  # other resources: grad_accum follows, the run resumes on the new world size
    assert load_yaml(os.path.join(v.experiment.run_dir, "experiment.yaml"))["train"]["grad_accum"] == 2
    edited = load_grid(write_grid(tmp_path, axes={**AXES, "size": {**AXES["size"], "210m": {"model.init": "210m",
                                                                                             "optim.lr": 0.01}}}))
    with pytest.raises(ConfigError, match=r"has started \(step 100\) with other settings: optim.lr 0.001 -> 0.01; "
                                          r"undo the change, or delete"):
        write_run(edited, edited.variants(out=out)[0], started)


def test_runs_under_the_repository_are_recorded_relative_to_it_and_jobs_get_absolute_paths(tmp_path):
    """The records a run writes (experiment.yaml, then experiment.json) name its directory and its start run
    relative to the repository, so committed records read the same in every clone; its job file names them
    absolute; a run started when the sweep wrote absolute paths keeps its experiment."""
    os.makedirs(os.path.join(REPO, "runs"), exist_ok=True)
    out = tempfile.mkdtemp(prefix="test-sweep-", dir=os.path.join(REPO, "runs"))
    rel = os.path.relpath(out, REPO)
    try:
        sweep = prepare(SweepRequest(write_grid(tmp_path), out=out, only=["pre-610m-*", "cont-from610m"],
                                     action="write"))
        cont = next(v for v in sweep.todo if v.name == "cont-from610m")
        written = load_yaml(os.path.join(out, "cont-from610m", "experiment.yaml"))
        assert written["run_dir"] == f"{rel}/cont-from610m" and written["model"]["init"] == f"{rel}/pre-610m-clm50/hf"
        assert f"--experiment {out}/cont-from610m/experiment.yaml" in job_script(sweep.grid, cont)
        old = {**written, "run_dir": os.path.join(out, "cont-from610m"),
               "model": {**written["model"], "init": os.path.join(out, "pre-610m-clm50", "hf")}}
        with open(os.path.join(out, "cont-from610m", "experiment.yaml"), "w") as f:
            yaml.safe_dump(old, f)
        write_run(sweep.grid, cont, RunState("started", 10))
        assert load_yaml(os.path.join(out, "cont-from610m", "experiment.yaml"))["run_dir"] == f"{rel}/cont-from610m"
    finally:
        shutil.rmtree(out)


@pytest.mark.e2e
def test_sweep_cli_prints_the_table_and_writes_the_runs(tmp_path):
    path = write_grid(tmp_path)
    out = tmp_path / "runs"
    cmd = [sys.executable, os.path.join(REPO, "launch", "sweep.py"), path, "--out", str(out), "--set",
           "data.shards=/data/x", "--only", "pre-*"]
    dry = subprocess.run(cmd, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert not out.exists() and "nothing written (--write, --submit or --local to act)" in dry.stdout
    proc = subprocess.run([*cmd, "--write"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:4] == dry.stdout.splitlines()[:4]  # the same table
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["run", "model", "steps", "tokens", "phases", "starts", "from", "state"]
    assert lines[2].split() == ["pre-210m-clm50", "210m", "1000", "4.1M", "clm", "500", "->", "mlm40", "500", "-",
                                "new"]  # 1000 steps x 32 samples x 128 tokens
    assert sorted(os.listdir(out)) == ["pre-210m-clm50", "pre-610m-clm50"]
    assert load_yaml(str(out / "pre-610m-clm50" / "experiment.yaml"))["data"]["shards"] == "/data/x"


def test_placeholder_data_paths_are_refused_before_anything_starts(tmp_path):
    grid = load_grid(write_grid(tmp_path))
    v = grid.variants(overrides={"data.shards": str(tmp_path / "none"), "data.build_if_missing": False})[0]
    with pytest.raises(ConfigError, match=r"^pre-210m-clm50: data.shards: .*/none is not a shard directory; build it"):
        check_inputs(v)
    v = grid.variants(overrides={"data.tokenizer": "/models/nowhere"})[0]
    with pytest.raises(ConfigError, match="^pre-210m-clm50: tokenizer /models/nowhere does not exist: pass an HF tokenizer directory"):
        check_inputs(v)
    check_inputs(grid.variants()[0])  # the defaults: the sample tokenizer, shards built on first use
