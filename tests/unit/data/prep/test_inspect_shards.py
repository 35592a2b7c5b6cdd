import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from shard_corpus import TOKENIZER, split_corpus

from pipeline.data.format.index import job_manifest_name, load_index
from pipeline.data.format.masking import mask_targets
from pipeline.data.format.sample import UNMASKABLE, Sample
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.prep import inspection
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("inspect")
    inputs = split_corpus(root, 2)
    out = str(root / "shards")
    run_job(BuildConfig(inputs=tuple(inputs), tokenizer=TOKENIZER, output=out, seq_len=128, samples_per_shard=64,
                        remainder="pad", progress=False))
    return out


@pytest.fixture
def copy(shard_dir, tmp_path) -> str:
    shutil.copytree(shard_dir, tmp_path / "copy")
    return str(tmp_path / "copy")


def run(capsys, *args) -> tuple[int, str, str]:
    rc = inspection.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_verifies_and_shows_a_sample(shard_dir, capsys):
    rc, out, err = run(capsys, shard_dir, "--sample", 5, "--ratio", 0.3, "--policy", "mask")
    assert rc == 0, err
    index = load_index(shard_dir)
    sample = ShardReader(index.shards[0].path)[5]
    targets = int(mask_targets(torch.from_numpy(sample.mask_rank.astype(np.int32)), 0.3).sum())
    assert "OK: every shard matches the manifests" in out
    assert f"{index.num_samples} samples of 128 tokens" in out
    masked = float(re.search(r"masked at ratio 0.3: ([0-9.]+)% of maskable tokens", out).group(1))
    assert abs(masked - 30) < 1
    assert f"sample 5 = {sample.key}" in out
    shown = out.split(f"sample 5 = {sample.key}")[1].split("\n", 1)[1]  # after the legend
    assert shown.count("[MASK:") == targets and "[RAND:" not in shown  # policy "mask": every target is the mask
    assert shown.count("<<") == shown.count(">>") == len(sample.spans)
    assert shown.count("--- document piece") == len(sample.segments)


def test_80_10_10_policy_shows_random_and_kept_targets(shard_dir, capsys):
    rc, out, _ = run(capsys, shard_dir, "--no-verify", "--sample", 0, "--ratio", 0.8)
    assert rc == 0
    shown = out.split("<<...>> MAGNET span\n")[1]
    assert "[MASK:" in shown and ("[RAND:" in shown or "[KEEP:" in shown)
    assert "OK:" not in out


def test_corrupt_shard_is_reported(copy, capsys):
    shard = sorted(n for n in os.listdir(copy) if n.endswith(".tar"))[1]
    with open(os.path.join(copy, shard), "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, _, err = run(capsys, copy)
    assert rc == 1
    assert f"{shard}: size or sha256 differs from the job manifest" in err


def test_missing_shard_is_reported(copy, capsys):
    shard = sorted(n for n in os.listdir(copy) if n.endswith(".tar"))[0]
    os.remove(os.path.join(copy, shard))
    rc, _, err = run(capsys, copy)
    assert rc == 1 and f"{shard} is missing" in err


def test_incomplete_directory_is_reported(copy, capsys):
    path = os.path.join(copy, job_manifest_name(0))
    job = json.load(open(path))
    job["complete"] = False
    json.dump(job, open(path, "w"))
    rc, _, err = run(capsys, copy)
    assert rc == 1 and "prep jobs [0] of 1 are not complete" in err


def test_shard_missing_from_the_job_manifest_is_reported(copy, capsys):
    path = os.path.join(copy, job_manifest_name(0))
    job = json.load(open(path))
    dropped = job["shards"].pop()
    json.dump(job, open(path, "w"))
    rc, _, err = run(capsys, copy)
    assert rc == 1 and "index.json lists other shards than the job manifests" in err
    os.remove(os.path.join(copy, "index.json"))
    rc, _, err = run(capsys, copy)
    last = job["files"][-1]
    assert rc == 1
    assert (f"the shards hold {last['samples'] - dropped['samples']} samples, the job manifest says "
            f"{last['samples']}") in err


def test_sample_out_of_range(shard_dir, capsys):
    rc, _, err = run(capsys, shard_dir, "--no-verify", "--sample", 10**6)
    assert rc == 1 and "--sample 1000000 is out of range" in err


def test_another_tokenizer_is_refused_naming_the_one_the_shards_were_built_with(shard_dir, capsys):
    """The sentencepiece file alone is another tokenizer than its directory (other fingerprint); the message said
    "pass --tokenizer" when it had been passed."""
    bare = os.path.join(TOKENIZER, "tokenizer.model")
    rc, _, err = run(capsys, shard_dir, "--no-verify", "--tokenizer", bare)
    (line,) = err.strip().splitlines()
    assert rc != 0 and line.startswith(f"error: tokenizer {bare} is not the one the shards were built with "
                                       f"({os.path.abspath(TOKENIZER)}; fingerprint ")
    assert line.endswith("; pass the tokenizer the shards were built with")


def test_check_plan_rejects_maskable_special_token():
    ids = np.array([1, 50, 51, 2], dtype=np.int32)
    rank = np.array([UNMASKABLE, 0, 1, UNMASKABLE], dtype=np.uint16)
    segments = np.array([[0, 4]], dtype=np.int32)
    good = Sample("f000000s00000000", ids, segments, rank, np.zeros(4, np.uint32), np.zeros((0, 2), np.int32))
    inspection.check_plan(good, np.array([1, 2]))
    bad = Sample(good.key, ids, segments, np.array([2, 0, 1, UNMASKABLE], dtype=np.uint16), good.mask_draw,
                 good.spans)
    with pytest.raises(inspection.ShardProblem, match="a special token is maskable"):
        inspection.check_plan(bad, np.array([1, 2]))
