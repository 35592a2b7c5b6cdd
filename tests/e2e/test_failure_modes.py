"""The crash matrix: every way a long run used to fail silently, each with the command a user would run.

Config, lock and shard cases stop before training (cheap); the cases that need training steps (divergence,
signals, a full disk during a checkpoint, a corrupt shard met in training, a resume on another world size) launch
real 2-rank ZeRO-3 runs under the ``deepspeed`` command and are marked slow. docs/training.md, "Failure modes",
describes each case from the user's side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from helpers import (
    REPO,
    cpu_env,
    join_rendezvous,
    launch_training,
    logged_steps,
    make_shard_dir,
    one_error,
    rendezvous,
    training_launch,
)

from pipeline.config import ConfigError
from pipeline.data.format.index import (
    MANIFEST,
    ShardInfo,
    check_shard_sizes,
    job_manifest_name,
    load_index,
    settings_fingerprint,
    verify_shard_hash,
)
from pipeline.data.format.tar_shard import ShardCorrupt
from pipeline.data.loading.loader import ShardLoader
from pipeline.data.loading.order import TrainOrder
from pipeline.data.prep.manifest import write_json_atomic
from pipeline.experiment import SAMPLE_DIR, ExperimentConfig, load_experiment
from pipeline.lock import DirLock
from pipeline.run_dir import RunDir
from pipeline.train import agreement
from pipeline.train.agreement import check_same_run
from pipeline.train.deepspeed_ops import arch_list_for_deepspeed, deepspeed_arch_list
from pipeline.train.distributed import (
    CPU_COMM_OP,
    built_said_only_when_built,
    say_if_building_cpu_op,
    stale_build_locks,
    warn_stale_build_locks,
)
from pipeline.train.guard import Diverged, DivergenceGuard
from pipeline.train.metrics import MetricsLogger
from pipeline.train.preflight import preflight

TOKENIZER = os.path.join(SAMPLE_DIR, "tokenizer")
INPUT = os.path.join(SAMPLE_DIR, "train", "**", "*.jsonl.zst")
TINY = ["train.steps=40", "train.micro_batch=2", "train.log_every=1", "optim.warmup_steps=0", "optim.decay_steps=0",
        "data.seq_len=64", "data.build_if_missing=false", "train.export_hf=true"]


@pytest.fixture(scope="module")
def shards(build_shards) -> str:
    """The shared shards' samples in 256-sample shards."""
    return build_shards(samples_per_shard=256)


def run_train(run_dir: str, shards: str, *overrides: str, nproc: int = 2, launcher: str = "deepspeed",
              env: dict | None = None) -> subprocess.CompletedProcess:
    return launch_training(run_dir, None, *TINY, f"data.shards={shards}", *overrides, nproc=nproc, env=env,
                           check=False, launcher=launcher)


# ---------------------------------------------------------------- config values that destroy or crash

def _numeric_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is list and inner and dataclasses.is_dataclass(inner[0]):
            yield from _numeric_fields(inner[0], f"{prefix}{f.name}[].")
        elif tp in (int, float) or (inner and set(inner) <= {int, float}):
            yield cls, f.name, f"{prefix}{f.name}"


def test_every_numeric_config_field_has_a_range():
    missing = [key for cls, name, key in _numeric_fields(ExperimentConfig) if name not in getattr(cls, "RANGES", {})]
    assert not missing


@pytest.mark.parametrize("override,message", [
    ("checkpoint.keep_last=0", "checkpoint.keep_last: 0 is out of range; it must be >= 1"),
    ("checkpoint.every=0", "checkpoint.every: 0 is out of range; it must be >= 1"),
    ("train.steps=0", "train.steps: 0 is out of range; it must be >= 1"),
    ("optim.lr=-0.001", "optim.lr: -0.001 is out of range; it must be > 0"),
    ("optim.betas=[0.9, 1.0]", r"optim.betas: \[0.9, 1.0\] is out of range; it must be in \[0, 1\)"),
    ("phases=[{objectives: [{name: mlm, ratio: 1.5}]}]", r"phases\[0\].objectives\[0\].ratio: 1.5 is out of range"),
])
def test_config_range_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(None, ["optim.warmup_steps=0", "optim.decay_steps=0", override])


def handles(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (sig - 1) & 1)


@pytest.mark.e2e
@pytest.mark.parametrize("config_error", [True, False])
def test_a_signal_before_the_config_is_read_waits_for_it(tmp_path, config_error):
    """The launcher terminates the other ranks when one exits with its config error; that SIGTERM used to reach
    rank 0 first now and then, which then reported a stop ("run the same command again") instead of the error.
    Here the SIGTERM arrives as soon as the rank handles signals, long before it has imported what reads the
    config: the error still wins; a valid config still stops cleanly."""
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--set", f"run_dir={tmp_path / 'run'}",
           *(["--set", "checkpoint.keep_last=0"] if config_error else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={k: v for k, v in cpu_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    deadline = time.time() + 60
    while not handles(proc.pid, signal.SIGTERM) and time.time() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    if config_error:
        assert proc.returncode == 2 and "config error: checkpoint.keep_last: 0 is out of range" in err, err[-3000:]
        assert "stopped during start-up" not in err
    else:
        assert proc.returncode == 0 and "stopped during start-up on SIGTERM" in err, err[-3000:]


@pytest.mark.e2e
def test_config_error_is_one_line_from_rank_0_before_deepspeed(tmp_path):
    proc = launch_training(str(tmp_path / "run"), None, "checkpoint.keep_last=0", check=False, launcher="deepspeed")
    assert one_error(proc, "config error") == "config error: checkpoint.keep_last: 0 is out of range; it must be >= 1"
    assert proc.returncode == 2


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_a_checkpoint_of_every_zero_stage_exports_the_trained_weights(shards, tmp_path, stage):
    """Stage 0 keeps no ZeRO partitions for zero_to_fp32 to gather (its export was a TypeError inside DeepSpeed);
    the offline export of the last checkpoint must equal the engine's own export at the end of training."""
    ds = json.load(open(os.path.join(REPO, "ds_configs", "zero2.json")))
    ds["zero_optimization"] = {"stage": stage}
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds))
    run = str(tmp_path / "run")
    launch_training(run, None, *TINY, f"data.shards={shards}", "train.steps=3", nproc=1, ds_config=str(config))
    out = str(tmp_path / "offline")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "export_hf.py"), "--run", run, "--output",
                           out], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert RunDir(run).checkpoint_zero_stage(3) == stage
    from safetensors.torch import load_file

    offline, engine = (load_file(os.path.join(d, "model.safetensors")) for d in (out, os.path.join(run, "hf")))
    assert offline.keys() == engine.keys()
    for name, weight in engine.items():
        assert torch.equal(offline[name], weight), name
    for d in (out, os.path.join(run, "hf")):  # the model card of a CLM run (an encoder's: tests/unit/export/test_export.py)
        meta = yaml.safe_load(open(os.path.join(d, "README.md")).read().split("---\n")[1])
        assert meta == {"library_name": "transformers", "license": "apache-2.0", "pipeline_tag": "text-generation",
                        "tags": ["decoder-encoders", "clm"]}, d


@pytest.mark.e2e
def test_a_taken_rendezvous_port_is_one_line_that_names_it(tmp_path):
    """``make demo`` while another run holds DeepSpeed's default port used to end in a traceback from every rank."""
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launch_training(str(tmp_path / "run"), None, check=False, launcher="deepspeed", port=port)
    line = one_error(proc, "config error")
    assert line.startswith(f"config error: the rendezvous port {port} (MASTER_PORT) is taken on this machine")
    assert "deepspeed --master_port PORT" in line and proc.returncode == 2
    assert not os.path.exists(tmp_path / "run" / "tensorboard")


@pytest.mark.e2e
def test_a_rank_waiting_in_the_rendezvous_stops_on_sigterm_at_once(tmp_path):
    """Rank 1 of a run whose rank 0 failed (or whose port another process holds) waits in C for a store that never
    answers; Python runs signal handlers only between bytecodes, so the launcher's SIGTERM used to change nothing
    until its SIGKILL 30 s later (the rendezvous itself waits for minutes)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy.settimeout(300)
        env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(busy.getsockname()[1])}
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "train.py"), "--set",
                                 f"run_dir={tmp_path / 'run'}"], cwd=REPO, env=cpu_env(env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        conn, _ = busy.accept()  # the rank's store client: it is in the rendezvous now
        with conn:
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=20)
            finally:
                proc.kill()  # no rank left behind to join a later test's rendezvous
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]


def _same_run_rank(rank: int, rdzv: dict, out_dir: str) -> None:
    join_rendezvous(rank, rdzv)
    world = dist.get_world_size()
    results = []
    for case in ("same", "lr", "code"):
        exp = load_experiment(None, ["optim.lr=0.01"] if case == "lr" and rank == 1 else [])
        if case == "code" and rank == 1:  # as if this node ran another checkout
            agreement.code_digest = lambda: "another checkout"
        try:
            check_same_run(exp, world)
            results.append("ok")
        except ConfigError as e:
            results.append(str(e))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_a_rank_of_another_experiment_or_checkout_is_refused_by_every_rank(tmp_path):
    """Nodes that read other files would train together on mismatched settings, without a word."""
    with rendezvous(2) as rdzv:
        mp.spawn(_same_run_rank, args=(rdzv, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert ranks[0] == ranks[1]
    same, lr, code = ranks[0]
    lr0 = load_experiment(None).optim.lr
    assert same == "ok"
    assert lr.startswith(f"rank 1 on {socket.gethostname()} runs another experiment than rank 0 on ")
    assert f"optim.lr: 0.01 there, {lr0!r} on rank 0; launch every node with the same --experiment file" in lr
    assert "runs other code than rank 0" in code and "launch every node from the same checkout" in code


@pytest.mark.e2e
def test_experiment_is_checked_before_deepspeed_and_reported_once(shards, tmp_path):
    """A missing mask token names its key and a token that exists; the run directory's lock names its holder."""
    mlm = "phases=[{share: 0.5, objectives: [{name: clm}]}, {share: 0.5, objectives: [{name: mlm, mask_token: '<mask_>'}]}]"
    proc = run_train(str(tmp_path / "run"), shards, mlm)
    line = one_error(proc, "config error")
    assert line.startswith("config error: phases[1].objectives[0].mask_token: '<mask_>' is not a single token of ")
    assert "e.g. phases[1].objectives[0].mask_token='<mask>'" in line
    assert "DeepSpeed info" not in proc.stdout and not os.path.exists(tmp_path / "run" / "tensorboard")


@pytest.mark.parametrize("objective", ["{name: simcse}", "{name: sscl}"])
def test_dropout_views_without_dropout_are_a_config_error_at_load(objective):
    """Checked with the config, before any rank reads shards or builds a model (it used to fail in attach)."""
    phases = f"phases=[{{objectives: [{objective}]}}]"
    with pytest.raises(ConfigError, match=r"phases\[0\]\.objectives\[0\] \((simcse|sscl)\): .*model.attention_dropout is 0"):
        load_experiment(None, [phases])
    assert load_experiment(None, [phases, "model.attention_dropout=0.1"]).phases[0].objectives[0].name in objective
    load_experiment(None, ["phases=[{objectives: [{name: sscl, augment: delete}]}]"])  # an edit needs no dropout


@pytest.mark.parametrize("case", ["tokenizer", "run_dir", "no shards", "other tokenizer", "built with another",
                                  "too few samples", "model.init"])
def test_preflight_names_the_file_and_the_fix(shards, tmp_path, case):
    """The checks every rank runs before DeepSpeed (in process here; the launched tests above show them reported)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    other = make_shard_dir(tmp_path, seq_len=64)
    override, message = {
        "tokenizer": (f"data.tokenizer={tmp_path}/nope", rf"tokenizer {tmp_path}/nope does not exist"),
        "run_dir": (f"run_dir={afile}/run", rf"run_dir: {afile}/run is not writable .*set run_dir to a directory"),
        "no shards": (f"data.shards={tmp_path}/none", rf"data.shards: {tmp_path}/none is not a shard directory; "
                                                      r"build it with data_prep/build_shards.py"),
        "other tokenizer": (f"data.shards={other}", rf"{other}: shards were built with tokenizer fingerprint "
                                                    r"'test-tokenizer'"),
        "built with another": (f"data.tokenizer={TOKENIZER}/tokenizer.model",  # the sentencepiece file alone
                               rf"{shards}: shards were built with tokenizer \({TOKENIZER}\) fingerprint '"),
        "too few samples": ("train.micro_batch=20000", rf"data.shards: {shards} holds \d+ samples, fewer than one "
                                                       r"global batch of 40000"),
        "model.init": (f"model.init={tmp_path}/start", rf"model.init: no such directory '{tmp_path}/start'"),
    }[case]
    exp = load_experiment(None, [*TINY, f"run_dir={tmp_path}/ok", f"data.shards={shards}", override])
    with pytest.raises((ConfigError, ValueError, FileNotFoundError), match=message), preflight(exp, rank=0, world=2):
        pass
    lock = RunDir(exp.run_dir).lock
    assert not os.path.exists(lock) or not open(lock).read()


# ---------------------------------------------------------------- one run per directory

def plain_python(run_dir: str, shards: str, *overrides: str) -> subprocess.CompletedProcess:
    """``python launch/train.py ...`` without a launcher (no RANK/WORLD_SIZE in the environment)."""
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--config",
           os.path.join(REPO, "ds_configs", "zero3.json"), "--set", f"run_dir={run_dir}",
           *[a for o in [*TINY, f"data.shards={shards}", *overrides] for a in ("--set", o)]]
    env = {k: v for k, v in cpu_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


@pytest.mark.e2e
def test_second_run_on_a_run_directory_is_refused_with_the_holder(shards, tmp_path):
    """Also the plain ``python launch/train.py``: one rank, set up without a launcher (no mpi4py error)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with DirLock(RunDir(str(run_dir)).lock, "held by the test"):  # stands in for a running first run
        proc = plain_python(str(run_dir), shards)
    line = one_error(proc, "error")
    assert f"run directory {run_dir} is in use by host " in line and f"pid {os.getpid()} " in line
    assert "no launcher (RANK/WORLD_SIZE unset): training on one rank" in proc.stderr
    assert not os.path.exists(run_dir / "experiment.json")


@pytest.mark.e2e
def test_stale_lock_of_a_dead_process_is_taken_over_and_named(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = str(tmp_path / "lock")
    with open(path, "w") as f:  # what a holder killed with SIGKILL leaves: its record, no flock
        json.dump({"host": os.uname().nodename, "pid": dead.pid, "time": time.time(), "command": "train.py"}, f)
    with DirLock(path, "run directory x") as lock:
        assert lock.stale["pid"] == dead.pid
    with DirLock(path, "run directory x") as lock:
        assert lock.stale is None  # a released lock leaves no record behind


HOLD_AND_FORK = """
import os, sys, time
from pipeline.lock import DirLock
lock = DirLock(sys.argv[1], "run directory x").acquire()
if os.fork() == 0:  # a worker that outlives its killed parent, as a pool or DataLoader worker may
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.e2e
def test_forked_workers_of_a_killed_holder_do_not_keep_its_lock(tmp_path):
    path = str(tmp_path / "lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, path], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env=cpu_env())
    assert holder.stdout.readline().strip() == "held"
    workers = psutil.Process(holder.pid).children()
    assert len(workers) == 1
    deadline = time.time() + 30  # a busy machine may not have run the child's at-fork close yet
    while any(f.path == path for f in workers[0].open_files()) and time.time() < deadline:
        time.sleep(0.05)
    holder.kill()
    holder.wait()
    try:
        with DirLock(path, "run directory x") as lock:  # the orphaned worker still runs, but holds no lock
            assert workers[0].is_running() and lock.stale["pid"] == holder.pid
    finally:
        workers[0].kill()


def test_a_left_over_op_build_lock_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old, fresh = tmp_path / "fused_adam" / "lock", tmp_path / "deepspeed_shm_comm" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir()
        lock.write_text("")
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # a killed build's; the other one is building now
    assert [p for p, _ in stale_build_locks()] == [str(old)]
    warn_stale_build_locks()
    err = capsys.readouterr().err
    assert f"{old} is 60 min old" in err and "'fused_adam'" in err and f"rm {old}" in err and str(fresh) not in err


def test_arch_suffixes_are_dropped_for_deepspeeds_op_builder(monkeypatch, capsys):
    """Issue 32: FusedAdam did not build on an H200 image whose TORCH_CUDA_ARCH_LIST is "9.0a": DeepSpeed's CUDA
    op builder (its real FusedAdamBuilder, run for its arch flags only) int()s "0a". The rewritten list builds."""
    # the CUDA builder, whatever the accelerator
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    builder._jit_arch_list = "8.0 9.0a+PTX"
    with pytest.raises(ValueError, match="'0a'"):
        builder.compute_capability_args()
    assert deepspeed_arch_list("8.0 9.0a+PTX") == "8.0;9.0+PTX"
    assert deepspeed_arch_list("9.0a;9.0;10.0f") == "9.0;10.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a+PTX")
    arch_list_for_deepspeed()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX" and "'8.0;9.0+PTX'" in capsys.readouterr().err
    builder._jit_arch_list = os.environ["TORCH_CUDA_ARCH_LIST"]
    assert builder.compute_capability_args() == [] and os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    arch_list_for_deepspeed()  # already plain: left alone, silently
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"cannot read 'Hopper'; set it to the GPU's compute capability"):
        deepspeed_arch_list("8.0;Hopper")


def test_the_first_start_says_it_builds_deepspeeds_cpu_op(tmp_path, monkeypatch, capsys):
    """A machine's first CPU start was a minute of silence while DeepSpeed compiled this op."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator().create_op_builder("ShareMemCommBuilder").NAME == CPU_COMM_OP
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    say_if_building_cpu_op()
    assert capsys.readouterr().err == (f"building DeepSpeed's CPU collectives op ({CPU_COMM_OP}) once, about a minute "
                                       f"on 2 cores; later starts load it from {tmp_path}\n")
    (tmp_path / CPU_COMM_OP).mkdir()
    (tmp_path / CPU_COMM_OP / f"{CPU_COMM_OP}.so").write_bytes(b"")  # where torch's builder leaves the op
    say_if_building_cpu_op()
    assert capsys.readouterr().err == ""


def test_deepspeeds_built_successfully_is_said_only_of_a_build(tmp_path, monkeypatch, capsys):
    """Issue 51, item 6: "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" printed on every
    start, also where the op came from the cache. DeepSpeed's own loader, here from this install's built op, says
    nothing; into a folder without the op at the start (the built op appears in it: a build), it says so."""
    from deepspeed.comm.torch import build_shm_op

    from pipeline.train.deepspeed_ops import install_ops_dir

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", install_ops_dir())
    with built_said_only_when_built():
        assert build_shm_op() is not None
        print("other lines stay, as they come")
        out = capsys.readouterr().out  # not held back until the block ends (a hung rendezvous would say nothing)
    assert "other lines stay, as they come\n" in out and "built successfully" not in out
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with built_said_only_when_built():
        shutil.copytree(os.path.join(install_ops_dir(), CPU_COMM_OP), tmp_path / CPU_COMM_OP)
        build_shm_op()
    assert capsys.readouterr().out.endswith(f"{CPU_COMM_OP}_op built successfully\n")


@pytest.mark.e2e
def test_second_build_job_with_the_same_index_is_refused(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    cmd = [sys.executable, os.path.join(REPO, "data_prep", "build_shards.py"), "--input", INPUT, "--tokenizer",
           TOKENIZER, "--output", str(out), "--num-jobs", "2", "--job-index", "1", "--no-progress"]
    with DirLock(str(out / ".lock-job-00001"), "held by the test"):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1
    assert f"error: job 1 of {out} is in use by host " in proc.stderr and f"pid {os.getpid()} " in proc.stderr
    assert not [n for n in os.listdir(out) if n.startswith(".work-")]


# ---------------------------------------------------------------- corrupt shards

def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def test_flipped_byte_is_a_hash_mismatch_naming_the_shard(tmp_path):
    index = load_index(make_shard_dir(tmp_path))
    bad = index.shards[1]
    _flip_byte(bad.path, bad.bytes // 2)
    check_shard_sizes(index)  # same size: only the hash sees it
    with pytest.raises(ShardCorrupt, match=rf"{bad.path}: sha256 mismatch: the manifest records {bad.sha256}, the "
                                           r"file has [0-9a-f]{64} .*rebuild the shard directory"):
        loader = ShardLoader(index, micro_batch=37)
        loader.next_global_step()


def test_truncated_or_missing_shard_fails_the_size_check(tmp_path):
    index = load_index(make_shard_dir(tmp_path))
    with open(index.shards[0].path, "r+b") as f:
        f.truncate(index.shards[0].bytes - 512)
    with pytest.raises(ShardCorrupt, match=rf"{index.shards[0].path}: {index.shards[0].bytes - 512} bytes, the "
                                           rf"manifest records {index.shards[0].bytes}"):
        check_shard_sizes(index)
    os.remove(index.shards[0].path)
    with pytest.raises(ShardCorrupt, match="listed in the manifests of .* but missing"):
        check_shard_sizes(index)
    verify_shard_hash(index.shards[1])  # the others are fine


def test_token_id_outside_the_vocabulary_names_shard_and_sample(tmp_path):
    directory = make_shard_dir(tmp_path, vocab=64)
    manifest = json.load(open(os.path.join(directory, MANIFEST)))
    manifest["settings"]["tokenizer"]["vocab_size"] = 40  # a tokenizer smaller than the ids in the shards
    manifest["fingerprint"] = settings_fingerprint(manifest["settings"])
    write_json_atomic(os.path.join(directory, MANIFEST), manifest)
    job = json.load(open(os.path.join(directory, job_manifest_name(0))))
    write_json_atomic(os.path.join(directory, job_manifest_name(0)), job | {"fingerprint": manifest["fingerprint"]})
    with pytest.raises(ShardCorrupt, match=r"shard-00000-\d+\.tar: sample \d+ \(key \w+\) has token id \d+ in "
                                           r"input_ids, outside the tokenizer's vocabulary of 40"):
        ShardLoader(load_index(directory), micro_batch=37).next_global_step()
    assert ShardLoader(load_index(directory), micro_batch=37, verify=False).next_global_step()


# ---------------------------------------------------------------- divergence, metrics

def test_divergence_guard_counts_bad_steps_in_a_row():
    guard = DivergenceGuard(max_bad_steps=2)
    guard.count({"clm": 5.0}, 1.0, engine_skipped=0)
    assert guard.healthy
    guard.count({"clm": float("nan")}, 1.0, engine_skipped=0)
    assert not guard.healthy
    guard.check(2, {"clm": float("nan")}, 1.0, lambda: "ckpt")  # one bad step: not yet
    guard.count({"clm": 5.0}, float("inf"), engine_skipped=1)
    with pytest.raises(Diverged, match=r"2 bad steps in a row .* up to step 3: loss clm=5, grad norm inf; .* last "
                                       r"good checkpoint is ckpt"):
        guard.check(3, {"clm": 5.0}, float("inf"), lambda: "ckpt")
    guard.count({"clm": 4.0}, 1.0, engine_skipped=1)  # the counter did not move: a good step resets the streak
    assert guard.healthy


def test_resumed_metrics_drop_the_replayed_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "phase": "clm"}) + "\n" for s in range(1, 8)) + '{"step": 8, "ph')
    MetricsLogger(RunDir(str(tmp_path)), True, 10, start_step=5).trackers.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- full disk

@pytest.fixture
def small_disk(tmp_path):
    """A directory on a tmpfs of a few MB (needs root for mount; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()

    def mount_size(size: str) -> str:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        return str(mount)

    yield mount_size
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.e2e
def test_full_disk_during_shard_write_names_the_path_and_keeps_committed_shards(small_disk):
    out = os.path.join(small_disk("45m"), "shards")  # one input file of four fits (~31 MiB of shards)
    cmd = [sys.executable, os.path.join(REPO, "data_prep", "build_shards.py"), "--input", INPUT, "--tokenizer",
           TOKENIZER, "--output", out, "--seq-len", "64", "--samples-per-shard", "256", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: no space left on device: {out}/" in proc.stderr and "Traceback" not in proc.stderr
    job = json.load(open(os.path.join(out, job_manifest_name(0))))
    assert not job["complete"] and job["shards"]  # some files were committed before the disk filled up
    for entry in job["shards"]:
        path = os.path.join(out, entry["name"])
        assert os.path.getsize(path) == entry["bytes"]
        verify_shard_hash(ShardInfo(path=path, **entry))


# ---------------------------------------------------------------- training cases (real ZeRO-3 runs)

@pytest.mark.e2e
@pytest.mark.slow
def test_plain_python_trains_one_rank(shards, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = plain_python(run_dir, shards, "train.steps=2", "train.export_hf=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no launcher (RANK/WORLD_SIZE unset): training on one rank" in proc.stderr
    assert "mpi4py" not in proc.stderr
    assert sorted(logged_steps(run_dir)) == [1, 2]


@pytest.mark.e2e
@pytest.mark.slow
def test_divergence_stops_without_export_and_keeps_the_good_checkpoint(shards, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = run_train(run_dir, shards, "optim.lr=1e6", "optim.schedule=constant", "checkpoint.every=1",
                     "train.max_bad_steps=3")
    line = one_error(proc, "diverged")
    assert proc.returncode == 3
    steps = logged_steps(run_dir)
    last = max(steps)
    assert f"3 bad steps in a row (skipped updates or non-finite loss) up to step {last}" in line
    good = RunDir(run_dir).complete_steps()
    assert good and max(good) == last - 3  # nothing saved while the steps were bad
    assert f"the last good checkpoint is {RunDir(run_dir).checkpoint(max(good))}" in line
    assert steps[last]["optim/skipped_steps"] >= 1 or steps[last]["loss/clm"] != steps[last]["loss/clm"]
    assert not os.path.exists(os.path.join(run_dir, "hf"))
    assert os.path.exists(os.path.join(run_dir, "logs", "error-rank0.log"))


def _wait_for_step(run_dir: str, proc: subprocess.Popen, step: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    path = os.path.join(run_dir, "metrics.jsonl")
    while time.time() < deadline:
        assert proc.poll() is None, "training ended early"
        if os.path.exists(path) and any(json.loads(x)["step"] >= step for x in open(path) if x.strip()):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step {step} within {timeout}s")


@contextlib.contextmanager
def _started(run_dir: str, shards: str, *overrides: str):
    """(process, log path) of a 2-rank ``deepspeed`` launch, running in the block."""
    log = os.path.join(os.path.dirname(run_dir), "out.log")
    with (training_launch(run_dir, None, *TINY, f"data.shards={shards}", *overrides, launcher="deepspeed")
          as (cmd, env), open(log, "w") as out):
        yield subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                               start_new_session=True), log


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=["SIGTERM", "SIGUSR1", "Ctrl-C"])
def test_signal_to_the_deepspeed_command_checkpoints_every_rank(shards, tmp_path, sig):
    """SIGTERM/SIGUSR1 to the ``deepspeed`` process (it dies without forwarding them), Ctrl-C to the whole
    foreground group: every rank stops at one step with a checkpoint; then a resume on 1 rank is refused."""
    run_dir = str(tmp_path / "run")
    with _started(run_dir, shards, "train.steps=400", "checkpoint.every=1000") as (proc, log):
        _wait_for_step(run_dir, proc, 2)
        tree = psutil.Process(proc.pid).children(recursive=True)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        _, alive = psutil.wait_procs(tree, timeout=300)
        assert not alive
        proc.wait()
    out = open(log).read()
    (stopped,) = RunDir(run_dir).complete_steps()
    assert f"stopped at step {stopped} (checkpointed) on " in out, out[-3000:]  # the reason is named
    assert sorted(logged_steps(run_dir)) == list(range(1, stopped + 1))
    if sig == signal.SIGTERM:
        refused = run_train(run_dir, shards, "train.steps=400", "checkpoint.every=1000", nproc=1)
        line = one_error(refused, "config error")
        assert "checkpoint.allow_global_batch_change: " in line and "train.grad_accum=2 to keep it" in line


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    ranks = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if any(arg.endswith("launch/train.py") for arg in child.cmdline()):
                ranks.append(child)
        except psutil.Error:  # a helper subprocess that ended meanwhile
            pass
    return ranks


@pytest.mark.e2e
@pytest.mark.slow
def test_signal_during_start_up_stops_every_rank(shards, tmp_path):
    run_dir = str(tmp_path / "run")
    with _started(run_dir, shards) as (proc, log):
        deadline = time.time() + 120
        while len(_ranks(proc)) < 2 and time.time() < deadline:
            time.sleep(0.2)  # both ranks exist (the runner's own helper subprocesses while it imports do not count)
        time.sleep(2)
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=120)
        assert not alive
        assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl")) or not logged_steps(run_dir)
        proc.wait()
    out = open(log).read()
    assert "stopped during start-up on " in out, out[-3000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_corrupt_shard_met_in_training_is_one_message(shards, tmp_path):
    copy = str(tmp_path / "shards")
    shutil.copytree(shards, copy)
    index = load_index(copy)
    first = int(TrainOrder(index.num_samples, 0, 2, 1, 0, 2).sample_ids(0)[0])  # rank 0's first sample (seed 0)
    bad = index.shards[int(np.searchsorted(np.cumsum([s.samples for s in index.shards]), first, side="right"))]
    _flip_byte(bad.path, bad.bytes // 3)
    proc = run_train(str(tmp_path / "run"), copy)
    line = one_error(proc, "error")
    assert f"error: {bad.path}: sha256 mismatch: the manifest records {bad.sha256}" in line
    assert "(traceback: " in proc.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_full_disk_during_checkpoint_keeps_the_previous_one(shards, tmp_path, small_disk, async_save):
    """With checkpoint.async_save the writer threads meet the full disk; the next save reports it the same way."""
    run_dir = os.path.join(small_disk("20m"), "run")  # one checkpoint (~13 MiB) fits, not two
    proc = run_train(run_dir, shards, "checkpoint.every=1", "checkpoint.keep_last=1", "train.export_hf=false",
                     f"checkpoint.async_save={str(async_save).lower()}")
    line = one_error(proc, "error")
    good = RunDir(run_dir).complete_steps()
    assert f"error: no space left on device: {RunDir(run_dir).checkpoints}/step" in line
    assert good and f"the checkpoint of step {good[-1]} is intact" in line
