"""launch/slurm/*.sbatch on a real SLURM cluster: slurmctld and two emulated nodes (``slurmd -N n1``, ``-N n2``)
on this machine, started by tests/slurm/cluster.sh (root and the Debian packages slurmctld slurmd slurm-client
munge; the tests are skipped only when the packages are missing).

prep.sbatch runs as a 3-task array job; its shards must be byte-identical to the same 3 jobs run locally, and the
training jobs read them. train.sbatch trains on 2 nodes x 1 rank with ZeRO-3, stopped by USR1 through the batch
shell (as ``--signal=B:USR1@N`` does before the time limit), then requeued: it must resume from its checkpoint and
reproduce the losses of the same training run straight through (2 local ranks) exactly. Without a cluster: what
train.sbatch refuses before it starts a step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import launch_training
from shard_corpus import HOLDOUT, TOKENIZER, split_corpus
from slurm.cluster import Cluster, missing_packages

from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.run_dir import MARKER, RunDir, tag

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
PREP = os.path.join(REPO, "launch", "slurm", "prep.sbatch")
TRAIN = os.path.join(REPO, "launch", "slurm", "train.sbatch")
SEQ_LEN, SAMPLES_PER_SHARD, ARRAY_TASKS = 64, 128, 3
STEPS = 30
TRAIN_SETTINGS = [f"train.steps={STEPS}", "train.micro_batch=2", "train.grad_accum=2", "train.log_every=5",
                  "train.export_hf=false", "optim.warmup_steps=4", "optim.decay_steps=6", "optim.lr=0.002",
                  "checkpoint.every=1000", f"data.seq_len={SEQ_LEN}", "data.build_if_missing=false"]


def job_env(**extra: str) -> dict[str, str]:
    """What the jobs need from us: this Python (prep.sbatch runs `python`, train.sbatch `$PYTHON`), CPU DeepSpeed."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PYTHON": sys.executable,
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    missing = missing_packages()
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} not found): "
                    "`sudo tests/slurm/cluster.sh install` (apt: slurmctld slurmd slurm-client munge)")
    c = Cluster.start(str(tmp_path_factory.mktemp("slurm")))
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request):
    """A failed test's job (one that requeues itself, with steps to spare) would train on beside the rest of the
    session: every job still queued or running is cancelled after each test that used the cluster."""
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").command("scancel", "--user", str(os.getuid()))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> str:
    """4 input files for 3 array tasks: task 0 gets two."""
    directory = tmp_path_factory.mktemp("corpus")
    split_corpus(directory, 4, HOLDOUT)
    return str(directory / "part-*.jsonl.zst")


@pytest.fixture(scope="module")
def array_shards(cluster, inputs, tmp_path_factory) -> tuple[str, list[dict[str, str]]]:
    """Shards built by prep.sbatch as a real array job; returns (directory, the tasks' job records)."""
    out = tmp_path_factory.mktemp("array")
    env = job_env(INPUT=inputs, TOKENIZER=TOKENIZER, OUTPUT=str(out / "shards"), SEQ_LEN=str(SEQ_LEN),
                  EXTRA_ARGS=f"--samples-per-shard {SAMPLES_PER_SHARD}")
    job = cluster.sbatch(PREP, env=env, cwd=REPO, options=(f"--array=0-{ARRAY_TASKS - 1}", "--cpus-per-task=1",
                                                           f"--output={out}/prep-%A_%a.out"))
    tasks = cluster.wait_finished(job, timeout=300)
    logs = "\n".join(open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.endswith(".out"))
    assert all(t["JobState"] == "COMPLETED" and t["ExitCode"] == "0:0" for t in tasks), logs
    return str(out / "shards"), tasks


def files(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.mark.e2e
def test_prep_array_job_builds_the_same_shards_as_a_local_run(array_shards, inputs, tmp_path):
    directory, tasks = array_shards
    assert sorted(int(t["ArrayTaskId"]) for t in tasks) == list(range(ARRAY_TASKS))
    local = str(tmp_path / "shards")
    for k in range(ARRAY_TASKS):
        run_job(BuildConfig(inputs=(inputs,), tokenizer=TOKENIZER, output=local, seq_len=SEQ_LEN, num_jobs=ARRAY_TASKS,
                            job_index=k, samples_per_shard=SAMPLES_PER_SHARD, progress=False))
    ours, theirs = files(directory), files(local)
    assert sum(name.endswith(".tar") for name in ours) > ARRAY_TASKS  # several shards per job
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if ours[name] != theirs[name]] == []  # shards, .idx.npy, every manifest


def submit_training(cluster: Cluster, run_dir: str, shards: str, options: tuple[str, ...] = (),
                    sets: tuple[str, ...] = (), **env: str) -> int:
    items = [*TRAIN_SETTINGS, *sets, f"run_dir={run_dir}", f"data.shards={shards}"]
    args = [arg for item in items for arg in ("--set", item)]
    return cluster.sbatch(TRAIN, *args, env=job_env(GPUS_PER_NODE="1", **env), cwd=REPO,
                          options=("--nodes=2", "--ntasks-per-node=1", f"--output={run_dir}.out", *options))


def losses(run_dir: str) -> dict[int, float]:
    """Step -> loss from rank 0's metrics; a step logged twice (replayed after a resume) keeps its last value."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {rec["step"]: rec["loss/clm"] for rec in map(json.loads, f)}


def finished(cluster: Cluster, job: int, run_dir: str, timeout: float = 600) -> tuple[dict[str, str], str]:
    """The job's final record and its output; for a job that did not complete, the daemons' lines about it too."""
    (record,) = cluster.wait_finished(job, timeout)
    with open(f"{run_dir}.out") as f:
        log = f.read()
    if record["JobState"] != "COMPLETED":
        log += f"\n--- Reason={record.get('Reason')}; the SLURM daemons on job {job}:\n{cluster.daemon_log(job)}"
    return record, log


@pytest.fixture(scope="module")
def straight_losses(array_shards, tmp_path_factory) -> dict[int, float]:
    """The losses of the same training straight through, 2 ranks of ZeRO-3 on this machine (forked: the job's
    launchers are what the cluster tests): gloo's sums over two ranks are the same on one node or two."""
    run_dir = str(tmp_path_factory.mktemp("train") / "straight")
    launch_training(run_dir, None, *TRAIN_SETTINGS, f"data.shards={array_shards[0]}")
    return losses(run_dir)


@pytest.fixture(scope="module")
def stopped_then_requeued(cluster, array_shards, tmp_path_factory) -> tuple[int, str, str, int, str]:
    """A 2-node run stopped by USR1 through the batch shell after two steps (as ``--signal=B:USR1@N`` does before
    the time limit), then requeued by hand: (job id, run directory, the first run's output, the step it stopped
    at, the requeued run's output)."""
    run_dir = str(tmp_path_factory.mktemp("train") / "stopped")
    job = submit_training(cluster, run_dir, array_shards[0], REQUEUE_ON_STOP="0")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cluster.wait("two training steps", lambda: os.path.exists(metrics) and len(open(metrics).readlines()) >= 2, 300)
    cluster.signal(job, "USR1", batch=True)
    record, first = finished(cluster, job, run_dir)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), first[-5000:]
    (stopped,) = RunDir(run_dir).complete_steps()
    cluster.requeue(job)
    cluster.wait("the requeued run", lambda: cluster.job(job)["Restarts"] == "1", 60)
    record, log = finished(cluster, job, run_dir)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    return job, run_dir, first, stopped, log


@pytest.mark.e2e
def test_train_sbatch_runs_one_launcher_per_node_and_both_ranks_train(stopped_then_requeued, straight_losses):
    job, run_dir, first, _, log = stopped_then_requeued
    for output in first, log:
        assert f"2 nodes x 1 ranks, master n1:{20000 + job % 10000}" in output  # first host, port from the job id
        assert "launcher on n1: node_rank 0 of 2" in output and "launcher on n2: node_rank 1 of 2" in output
    assert sorted(straight_losses) == list(range(1, STEPS + 1))
    assert straight_losses[STEPS] < straight_losses[1] - 0.5  # it learns
    # the final checkpoint is collective: both ranks wrote their ZeRO-3 partitions and RNG state at the last step
    final = RunDir(run_dir).checkpoint(STEPS)
    with open(os.path.join(final, MARKER)) as f:
        assert json.load(f)["world_size"] == 2
    for rank in (0, 1):
        assert os.path.exists(os.path.join(final, f"rng-rank{rank}.pt"))
        assert os.path.exists(os.path.join(final, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


@pytest.mark.e2e
def test_usr1_checkpoints_and_exits_cleanly_then_requeue_resumes(stopped_then_requeued, straight_losses):
    job, run_dir, first, stopped, log = stopped_then_requeued
    assert "USR1: asking the ranks to checkpoint and stop" in first
    assert 2 <= stopped < STEPS
    assert f"stopped at step {stopped} (checkpointed)" in first
    assert f"job {job} restart 1:" in log
    assert f"resumed from {tag(stopped)}" in log
    assert RunDir(run_dir).latest_complete() == STEPS
    assert losses(run_dir) == straight_losses  # the uninterrupted run's curve, bit for bit


@pytest.mark.e2e
@pytest.mark.slow
def test_time_limit_signal_checkpoints_requeues_and_resumes(cluster, array_shards, tmp_path):
    """The production path: ``--signal=B:USR1@90`` ahead of a 3-minute limit (SLURM sends it up to 60 s early,
    possibly while the ranks start up: the script repeats it every RESEND_S seconds), the ranks checkpoint and
    exit, the script requeues the job and the rerun resumes from that checkpoint."""
    run_dir = str(tmp_path / "timed")
    job = submit_training(cluster, run_dir, array_shards[0], options=("--time=3", "--signal=B:USR1@90"),
                          sets=("train.steps=100000",), RESEND_S="5")

    def resumed() -> bool:
        return os.path.exists(f"{run_dir}.out") and "resumed from" in open(f"{run_dir}.out").read()

    # no StartTime=now here: a job that requeued itself while running must wait for its old credential to
    # expire (cred_expire), else slurmd refuses it ("Job credential revoked") and the job ends FAILED
    cluster.wait("the job to stop, requeue itself and resume", resumed, 600)
    cluster.command("scancel", str(job))
    _, log = finished(cluster, job, run_dir)
    first_run = log[:log.index(f"job {job} restart 1:")]
    assert "USR1: asking the ranks to checkpoint and stop" in first_run and "TIME LIMIT" not in first_run
    stopped = int(re.search(r"stopped at step (\d+) \(checkpointed\)", first_run).group(1))
    assert "training step exited with status 0" in first_run and f"requeueing job {job}" in first_run
    assert f"resumed from {tag(stopped)}" in log


@pytest.mark.e2e
@pytest.mark.parametrize("env, message", [
    ({}, "no GPU count: submit with --gpus-per-node=N, or set GPUS_PER_NODE"),
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "1"},
     "8 ranks per node on 1 CPUs: submit with --cpus-per-task=N (e.g. 8 per GPU: --cpus-per-task=64)"),
    ({"GPUS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1", "SLURM_CPUS_ON_NODE": "4"}, "2 ranks per node on 1 CPUs"),
])
def test_train_sbatch_refuses_a_job_without_a_gpu_count_or_cpus(env, message):
    """Neither a silent single rank nor a node's ranks on one core: the job ends at once with the option to add."""
    proc = subprocess.run(["bash", TRAIN], env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_train_sbatch_checks_the_run_before_srun(tmp_path):
    """launch/train.py --check runs first on the batch node: a bad job ends with its one line and exit 2 before
    the script asks SLURM for anything (no scontrol, no srun here, so the check is the only thing that can run)."""
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu", "GPUS_PER_NODE": "2",
           "SLURM_CPUS_ON_NODE": "4", "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": REPO, "SLURM_JOB_ID": "1"}
    proc = subprocess.run(["bash", TRAIN, "--set", f"run_dir={tmp_path / 'run'}", "--set", "train.steps=0"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "config error: train.steps: 0 is out of range; it must be >= 1"], proc.stderr[-3000:]
    assert "scontrol" not in proc.stderr and not (tmp_path / "run").exists()
