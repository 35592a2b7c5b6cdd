"""experiments/mlm_vs_clm/grid.yaml: every variant and -smoke twin validates with the paper's settings; the
two-phase twin switches objective and attention at the right step and resumes across the switch; every twin trains
(2 CPU ranks, ZeRO-3) through launch/sweep.py --local, and --submit on a real SLURM cluster (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import launch_training

from pipeline.experiment import SAMPLE_DIR, phase_at
from pipeline.grid import load_grid
from pipeline.io import REPO
from pipeline.run_dir import RunDir
from pipeline.sweep.status import is_finished
from pipeline.tokenizer import load_tokenizer
from pipeline.train.phases import build_objectives

GRID = os.path.join(REPO, "experiments", "mlm_vs_clm", "grid.yaml")
SWEEP = os.path.join(REPO, "launch", "sweep.py")
SWITCH = "switch-610m-12k-clm25"  # 12 steps in the twin: CLM for steps 1-3, MLM 40% from step 4
CPU = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def metrics(run_dir: str) -> dict[int, dict]:
    """Step -> logged record; a step logged twice (replayed after a resume) keeps its last record."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


@pytest.mark.e2e
def test_every_variant_and_twin_validates_with_the_papers_settings():
    grid = load_grid(GRID)
    variants = {v.name: v for v in grid.variants()}
    assert len(variants) == 36  # 15 from scratch, 13 + 2 switch runs, 6 CPT
    assert sum(n.startswith("scratch-") for n in variants) == 15 and sum(n.startswith("cpt-") for n in variants) == 6
    for v in variants.values():
        exp, r = v.experiment, v.resources
        assert exp.train.micro_batch * exp.train.grad_accum * r.world_size == 1152, v.name
        assert exp.data.seq_len == 2048 and exp.model.dtype == "bf16"
        o = exp.optim
        assert (o.lr, o.betas, o.eps, o.weight_decay, o.grad_clip, o.schedule) == (5e-4, (0.9, 0.95), 1e-5, 0.1, 1.0,
                                                                                   "wsd")
        assert all(s <= exp.train.steps - o.decay_steps for s in exp.phase_starts())  # switch before the decay
        masked = [ob for p in exp.phases for ob in p.objectives if ob.name == "mlm"]
        assert all(ob.policy == "mask" for ob in masked)
    assert variants["scratch-1b-mlm30"].experiment.phases[0].objectives[0].ratio == 0.3
    switch = variants["switch-610m-42k-clm25"].experiment
    assert [p.name for p in switch.phases] == ["clm", "mlm"] and switch.phase_starts() == [0, 10500]
    assert (switch.optim.warmup_steps, switch.optim.decay_steps) == (2000, 2000)
    cpt = variants["cpt-610m-mlm40-2k"]
    assert cpt.after == ("scratch-610m-mlm40",) and cpt.experiment.model.shape == "610m"
    assert cpt.experiment.model.init == os.path.join("runs", "scratch-610m-mlm40", "hf")
    assert (cpt.experiment.train.steps, cpt.experiment.optim.warmup_steps, cpt.experiment.optim.decay_steps) == (
        2000, 200, 1800)


@pytest.mark.e2e
def test_every_twin_builds_its_objectives_on_the_sample_tokenizer():
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    twins = load_grid(GRID).variants(smoke=True)
    assert len(twins) == 36 and all(v.name.endswith("-smoke") for v in twins)
    for v in twins:
        exp = v.experiment
        assert exp.model.init == "tiny" or exp.model.shape == "tiny", v.name
        assert exp.train.micro_batch * exp.train.grad_accum * v.resources.world_size == 8
        for phase in exp.phases:
            build_objectives(phase, tokenizer)


@pytest.fixture(scope="module")
def shards(build_shards) -> str:
    """The shared shards' samples in data prep's default shard size."""
    return build_shards()


def sweep(out: str, shards: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SWEEP, GRID, "--smoke", "--out", out, "--set", f"data.shards={shards}",
           "--set", "data.build_if_missing=false", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=7200,
                          env={**os.environ, **CPU, **(env or {})})
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.e2e
def test_two_phase_twin_switches_at_the_right_step_and_resumes_across_the_switch(shards, tmp_path):
    out = str(tmp_path / "runs")
    sweep(out, shards, "--only", SWITCH, "--local")
    straight = os.path.join(out, SWITCH + "-smoke")
    exp_file = os.path.join(straight, "experiment.yaml")
    ours = metrics(straight)
    assert [ours[s]["phase"] for s in range(1, 13)] == ["clm"] * 3 + ["mlm"] * 9
    assert all("loss/clm" in ours[s] for s in (1, 2, 3)) and all("loss/mlm" in ours[s] for s in range(4, 13))
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    twin = {v.name: v for v in load_grid(GRID).variants(smoke=True)}[SWITCH + "-smoke"].experiment
    modes = [build_objectives(p, tokenizer)[0].objective.attention_mode for p in twin.phases]
    assert modes == ["causal", "bidirectional"]

    resumed = str(tmp_path / "resumed")
    first = launch_training(resumed, exp_file, "train.stop_at_step=3")  # the last CLM step
    assert "stopped at step 3" in first.stdout
    assert RunDir(resumed).complete_steps() == [3]
    second = launch_training(resumed, exp_file)
    assert "resumed from step00000003" in second.stdout
    again = metrics(resumed)
    assert [again[s]["phase"] for s in range(1, 13)] == [ours[s]["phase"] for s in range(1, 13)]
    for step in range(4, 13):  # the MLM phase after the resume: bit-identical to the straight run
        assert again[step]["loss/mlm"] == ours[step]["loss/mlm"], step


# One twin of each kind (the twins differ only in objective, phases and steps; all 36 validate and build their
# objectives in the fast tests above): from scratch with CLM and MLM, the CLM -> MLM switch, CPT from either.
KINDS = ("scratch-610m-clm", "scratch-610m-mlm40", "switch-610m-12k-clm25", "cpt-610m-clm-2k", "cpt-610m-mlm40-2k")


@pytest.mark.e2e
@pytest.mark.slow  # 5 two-rank runs (~35 s each on 2 cores)
@pytest.mark.extended  # the two-phase twin trains through the sweep in make test; the rest validate and build there
def test_a_twin_of_each_kind_trains_through_the_sweep_and_a_second_sweep_has_nothing_to_do(shards, tmp_path):
    out = str(tmp_path / "runs")
    only = [arg for name in KINDS for arg in ("--only", name)]
    sweep(out, shards, *only, "--local")
    twins = [v for v in load_grid(GRID).variants(smoke=True, out=out) if v.name.removesuffix("-smoke") in KINDS]
    assert len(twins) == len(KINDS)
    for v in twins:
        assert is_finished(v), v.name
        exp, logged = v.experiment, metrics(v.experiment.run_dir)
        assert sorted(logged) == list(range(1, exp.train.steps + 1)), v.name
        for step, rec in logged.items():
            phase = exp.phases[phase_at(exp.phase_starts(), step - 1)]
            assert rec["phase"] == phase.name and f"loss/{phase.objectives[0].name}" in rec, (v.name, step)
    switch = metrics(f"{out}/switch-610m-12k-clm25-smoke")
    assert {rec["phase"] for rec in switch.values()} == {"clm", "mlm"}
    first = {v.name: metrics(v.experiment.run_dir)[1] for v in twins}
    for start in ("clm", "mlm40"):  # continued pretraining starts from the trained model, not from scratch
        assert first[f"cpt-610m-{start}-2k-smoke"]["loss/mlm"] < first["scratch-610m-mlm40-smoke"]["loss/mlm"] - 0.3
    again = sweep(out, shards, *only, "--local")
    assert f"{len(KINDS)} runs: {len(KINDS)} finished, 0 to do" in again.stdout
    assert "torch.distributed.run" not in again.stdout


@pytest.mark.e2e
@pytest.mark.slow  # two SLURM jobs of 2 CPU ranks (~2 min)
def test_sweep_submits_to_slurm_in_dependency_order_and_skips_finished_runs(shards, tmp_path):
    from slurm.cluster import Cluster, missing_packages

    missing = missing_packages()
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} not found): `sudo tests/slurm/cluster.sh install`")
    cluster = Cluster.start(str(tmp_path / "slurm"))
    try:
        out = str(tmp_path / "runs")
        env = {**cluster.env, "PYTHON": sys.executable}
        only = ("--only", "scratch-610m-clm", "--only", "cpt-610m-clm-2k")
        submitted = sweep(out, shards, *only, "--submit", env=env).stdout
        scratch = int(re.search(r"scratch-610m-clm-smoke: submitted job (\d+)\n", submitted).group(1))
        cpt = int(re.search(rf"cpt-610m-clm-2k-smoke: submitted job (\d+) \(after job {scratch}\)", submitted).group(1))
        assert cluster.job(cpt)["Dependency"].startswith(f"afterok:{scratch}")
        for job in (scratch, cpt):
            (record,) = cluster.wait_finished(job, timeout=900)
            assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
        twins = {v.name: v for v in load_grid(GRID).variants(smoke=True, out=out)}
        assert is_finished(twins["scratch-610m-clm-smoke"]) and is_finished(twins["cpt-610m-clm-2k-smoke"])
        again = sweep(out, shards, *only, "--submit", env=env).stdout
        assert "2 runs: 2 finished, 0 to do" in again and "submitted" not in again
    finally:
        cluster.stop()
