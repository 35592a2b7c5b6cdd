"""``launch/train.py ... --check`` (issue 43): the run's checks without a process group or an engine, for the GPUs
named or none, on a good config and on each kind of bad one: exit 0 with a report, or 2 with one line. It builds
no shards, takes no lock and leaves no file. In process (``entry.main``); the real script and the ``deepspeed``
launcher: tests/e2e/test_user_errors.py."""

from __future__ import annotations

import glob
import os

import pytest
from conftest import TOKENIZER
from helpers import in_process_entry, make_shard_dir

from pipeline.config import to_dict
from pipeline.experiment import load_experiment
from pipeline.io import write_json_atomic
from pipeline.lock import DirLock
from pipeline.run_dir import EXPERIMENT, MARKER, RunDir

ZERO1 = os.path.join(os.path.dirname(TOKENIZER), "..", "..", "ds_configs", "zero1.json")


def snapshot(*roots: str) -> dict[str, float]:
    """Every path under ``roots`` with its modification time: what a check must leave as it found it."""
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for root in roots
            for d, _, files in os.walk(root) for f in files}


def check(capsys, tmp_path, shards: str, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``launch/train.py --check`` on ``shards`` with ``args``."""
    base = [f"run_dir={tmp_path / 'run'}", f"data.shards={shards}", "data.seq_len=64", "data.build_if_missing=false",
            "train.steps=10"]
    with in_process_entry() as main:
        rc = main(["--check", *[a for o in base for a in ("--set", o)], *args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc: int, err: str, prefix: str = "config error") -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"{prefix}: "), err
    return lines[0]


def test_a_good_config_is_reported_for_the_gpus_named_and_nothing_is_written(shards, tmp_path, capsys):
    before = snapshot(shards, str(tmp_path))
    rc, out, err = check(capsys, tmp_path, shards, "--gpu", "h100", "--nodes", "4")
    assert rc == 0 and err == "", err
    assert "on 32 ranks (4 nodes x 8 h100 GPUs)" in out
    assert f"shards {shards} (packed): " in out and "built for this tokenizer" in out
    assert f"resume: no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}: starts at step 0" in out
    assert "budget: 10 steps, global batch 128 (micro_batch 4 x grad_accum 1 x 32 ranks): 1,280 samples, 81,920 " \
           "tokens" in out
    assert "memory: " in out and "GiB per GPU of 80 (ZeRO-3" in out and out.rstrip().endswith(
        "check passed: no engine built, no shards built, nothing written")
    assert snapshot(shards, str(tmp_path)) == before and not (tmp_path / "run").exists()


def test_shards_to_build_are_named_not_built(tmp_path, capsys):
    out_dir, inputs = tmp_path / "new-shards", f"{os.path.dirname(TOKENIZER)}/train/**/*.jsonl.zst"
    rc, out, err = check(capsys, tmp_path, str(out_dir), "--set", "data.build_if_missing=true", "--set",
                         f"data.build_inputs=[{inputs}]")
    assert rc == 0, err
    files = len(glob.glob(inputs, recursive=True))
    assert f"shards {out_dir}: none yet; rank 0 builds them from {files} input file(s) when the run starts" in out
    assert "memory: not estimated for CPU ranks" in out and not out_dir.exists()


KEEP_BEST = ("eval.every=2", "eval.holdout=0.01", "eval.samples=8", "checkpoint.every=2")


def test_keep_best_on_a_metric_one_phase_does_not_log_is_named_once_by_preflight(shards, tmp_path, capsys):
    """A CLM -> MLM run keeping the best eval/loss/clm (issue 55, item 2) used to stop at phase 2's first
    validation, and every resume there again: preflight names the phase, and the best is phase 1's."""
    phases = "phases=[{objectives: [{name: clm}], share: 0.5}, {objectives: [{name: mlm}], share: 0.5}]"
    rc, out, err = check(capsys, tmp_path, shards, *[a for o in (*KEEP_BEST, phases, "checkpoint.keep_best=eval/loss/clm")
                                                     for a in ("--set", o)])
    assert rc == 0, err
    assert ("  note: checkpoint.keep_best: eval/loss/clm is not logged in phases[1] (mlm); the best checkpoint is "
            "chosen among the steps of phases[0]\n") in out


@pytest.mark.parametrize("case", ["bad field", "unknown key", "missing shards", "missing inputs", "wrong tokenizer",
                                  "tokenizer", "too few samples", "resume mismatch", "does not fit", "gpu",
                                  "ds config", "keep best nobody logs"])
def test_each_kind_of_bad_config_is_one_line_and_exit_2(shards, tmp_path, capsys, case):
    run = tmp_path / "run"
    step = RunDir(str(run)).checkpoint(5)
    if case == "resume mismatch":  # the run files of a complete step-5 checkpoint trained at another global batch
        os.makedirs(step)
        old = load_experiment(None, [f"run_dir={run}", f"data.shards={shards}", "data.seq_len=64", "train.steps=10",
                                     "train.micro_batch=2"])
        write_json_atomic(os.path.join(step, EXPERIMENT), to_dict(old))
        write_json_atomic(os.path.join(step, MARKER), {"world_size": 1})
    args, expected = {
        "bad field": (["--set", "train.steps=0"], "config error: train.steps: 0 is out of range; it must be >= 1"),
        "unknown key": (["--set", "train.step=5"], "config error: train.step: unknown key; did you mean train.steps?"),
        "missing shards": (["--set", f"data.shards={tmp_path}/shardz"],
                           f"config error: data.shards: {tmp_path}/shardz is not a shard directory; build it with "),
        "missing inputs": (["--set", f"data.shards={tmp_path}/new", "--set", "data.build_if_missing=true", "--set",
                            f"data.build_inputs=[{tmp_path}/corpus/*.jsonl]"],
                           f"config error: data.build_inputs: '{tmp_path}/corpus/*.jsonl' matches no file"),
        "wrong tokenizer": (["--set", f"data.tokenizer={TOKENIZER}/tokenizer.model"],
                            f"config error: data.shards: {shards}: shards were built with tokenizer ({TOKENIZER}) "),
        "tokenizer": (["--set", f"data.tokenizer={tmp_path}/tok"],
                      f"config error: data.tokenizer: tokenizer {tmp_path}/tok does not exist: pass an HF "),
        "too few samples": (["--set", "train.micro_batch=100000"], f"config error: data.shards: {shards} holds "),
        "resume mismatch": ([], f"config error: checkpoint.allow_global_batch_change: {step} was trained with a "
                                f"global batch of 2 "),
        "does not fit": (["--config", ZERO1, "--set", "model.init=7b", "--gpu", "h100", "--gpus-per-node", "1"],
                         "config error: memory: "),
        "gpu": (["--gpu", "h1000"], "config error: --gpu 'h1000': not a GPU the planner knows; choose one of "),
        "ds config": (["--config", str(tmp_path / "ds.json")], f"config error: {tmp_path}/ds.json: DeepSpeed config not found"),
        "keep best nobody logs": ([a for o in (*KEEP_BEST, "checkpoint.keep_best=eval/loss/mlm") for a in ("--set", o)],
                                  "config error: checkpoint.keep_best: no phase's validation logs eval/loss/mlm; name "
                                  "one they log, e.g. eval/acc/clm, eval/loss/clm, eval/probe/clm, "),
    }[case]
    before = snapshot(shards, str(tmp_path))
    rc, out, err = check(capsys, tmp_path, shards, *args)
    line = one_line(rc, err)
    assert expected in line and out == "", line
    if case == "resume mismatch":
        assert "set train.grad_accum=" not in line and "set checkpoint.allow_global_batch_change=true" in line
    if case == "does not fit":
        assert "GiB per GPU of 80 (ZeRO-1" in line and "does not fit one h100; lower train.micro_batch" in line
    assert snapshot(shards, str(tmp_path)) == before
    assert case == "resume mismatch" or not run.exists()


def test_a_run_directory_in_use_is_named_and_its_lock_left_as_it_was(shards, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with DirLock(RunDir(str(run)).lock, "held by the test"):  # stands in for a running first run
        record = open(RunDir(str(run)).lock).read()
        rc, _, err = check(capsys, tmp_path, shards)
        assert open(RunDir(str(run)).lock).read() == record
    assert f"run directory {run} is in use by host " in one_line(rc, err, "error")
    rc, out, _ = check(capsys, tmp_path, shards)  # released: the check passes and takes nothing over
    assert rc == 0 and "note: took over the lock" not in out


def test_a_check_of_another_shard_directory_needs_no_run(tmp_path, capsys):
    """Shards of another tokenizer are refused by the check, naming the directory and the fingerprints."""
    other = make_shard_dir(tmp_path, seq_len=64)
    rc, _, err = check(capsys, tmp_path, other)
    assert f"config error: data.shards: {other}: shards were built with tokenizer fingerprint 'test-tokenizer'" in one_line(rc, err)
