import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zstandard
from helpers import gone
from shard_corpus import HOLDOUT, ROOT, TOKENIZER, TRAIN, documents, split_corpus

from pipeline.data.format.index import INDEX, MANIFEST, job_manifest_name, load_index
from pipeline.data.format.masking import mask_targets
from pipeline.data.format.sample import UNMASKABLE, parse_key
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.prep import build_cli
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.data.prep.sources import RecordStats, read_texts
from pipeline.tokenizer import load_tokenizer

SEQ_LEN = 128


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """The held-out Shakespeare split dealt into five files: documents from a few lines to ~6k tokens, so samples
    hold several documents and long documents run over many samples."""
    return split_corpus(tmp_path_factory.mktemp("corpus"), 5)


def config(inputs, out, **kw) -> BuildConfig:
    kw = {"seq_len": SEQ_LEN, "samples_per_shard": 8, "progress": False, "remainder": "pad", **kw}
    return BuildConfig(inputs=tuple(inputs), tokenizer=TOKENIZER, output=str(out), **kw)


def read_samples(directory) -> dict:
    index = load_index(str(directory))
    samples = {}
    for shard in index.shards:
        for sample in ShardReader(shard.path):
            assert sample.key not in samples
            samples[sample.key] = sample
    return samples


def dir_bytes(directory) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "shards"
    summary = run_job(config(corpus, out))
    return out, summary


def test_token_stream_roundtrip(built, corpus, tokenizer):
    out, summary = built
    samples = read_samples(out)
    assert summary.samples == len(samples) and summary.files == len(corpus)
    for file_index, path in enumerate(corpus):
        docs = list(read_texts(path, "text", RecordStats()))
        expected = [t for ids in tokenizer.encode_batch(docs) for t in [tokenizer.bos_id, *ids, tokenizer.eos_id]]
        keys = sorted(k for k in samples if parse_key(k)[0] == file_index)
        assert [parse_key(k)[1] for k in keys] == list(range(len(keys)))
        got = [int(t) for k in keys for s, e in samples[k].segments for t in samples[k].input_ids[s:e]]
        assert got == expected
        last = samples[keys[-1]]
        assert (last.input_ids[last.segments[-1, 1]:] == tokenizer.pad_id).all()  # the padded remainder
    assert not [n for n in os.listdir(out) if ".tmp" in n or n.startswith(".work")]
    assert summary.tokens == sum(int((s.segments[:, 1] - s.segments[:, 0]).sum()) for s in samples.values())


def test_throughput_leaves_out_tokenizer_loading(corpus, tmp_path, monkeypatch, capsys):
    """A slow tokenizer load (here 1 s) is reported apart and not divided into the docs/s and tokens/s."""
    import time

    from pipeline.data.prep import build

    def slow_load(path):
        time.sleep(1.0)
        return load_tokenizer(path)

    monkeypatch.setattr(build, "load_tokenizer", slow_load)
    start = time.monotonic()
    summary = run_job(config(corpus, tmp_path / "shards"))
    wall = time.monotonic() - start
    assert summary.tokenizer_s >= 1.0 and summary.elapsed_s <= wall - 1.0
    assert f"{summary.tokens / summary.elapsed_s:.0f} tokens/s" in summary.lines()[-1]
    assert "s loading the tokenizer, not counted)" in capsys.readouterr().err


def test_no_bos_and_dropped_remainder(corpus, tokenizer, tmp_path):
    run_job(config(corpus[:1], tmp_path / "out", bos=False, remainder="drop"))
    expected = [t for ids in tokenizer.encode_batch(list(read_texts(corpus[0], "text", RecordStats())))
                for t in [*ids, tokenizer.eos_id]]
    samples = read_samples(tmp_path / "out")
    got = [int(t) for k in sorted(samples) for s, e in samples[k].segments for t in samples[k].input_ids[s:e]]
    assert got == expected[: len(expected) // SEQ_LEN * SEQ_LEN]


def test_two_runs_give_identical_bytes(built, corpus, tmp_path):
    out, _ = built
    run_job(config(corpus, tmp_path / "again"))
    assert dir_bytes(out) == dir_bytes(tmp_path / "again")


def test_three_jobs_equal_one_job(built, corpus, tmp_path):
    out, _ = built
    summaries = [run_job(config(corpus, tmp_path / "k3", num_jobs=3, job_index=k, workers=2))
                 for k in range(3)]
    assert [s.index_written for s in summaries] == [False, False, True]
    assert [s.files for s in summaries] == [2, 2, 1]
    one, three = read_samples(out), read_samples(tmp_path / "k3")
    assert one.keys() == three.keys()
    for key, a in one.items():
        b = three[key]
        for name in ("input_ids", "segments", "mask_rank", "mask_draw", "spans"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{key}.{name}")
    index = json.load(open(tmp_path / "k3" / INDEX))
    assert index["num_samples"] == len(one)
    assert {s["name"][:11] for s in index["shards"]} == {"shard-00000", "shard-00001", "shard-00002"}
    assert not [n for n in os.listdir(tmp_path / "k3") if n.startswith(".lock")]  # uploaded with the shards, they were


def test_mask_plan(built, tokenizer):
    out, _ = built
    special = np.asarray(tokenizer.special_ids)
    eligible = masked = 0
    for sample in read_samples(out).values():
        rank = torch.from_numpy(sample.mask_rank.astype(np.int32))
        low, high = mask_targets(rank, 0.2).numpy(), mask_targets(rank, 0.4).numpy()
        n = int((sample.mask_rank != UNMASKABLE).sum())
        assert abs(high.sum() - 0.4 * n) <= 0.5
        assert not (low & ~high).any(), "the 20% mask must be a subset of the 40% mask"
        assert not np.isin(sample.input_ids[high], special).any()
        assert (sample.mask_rank[np.isin(sample.input_ids, special)] == UNMASKABLE).all()
        eligible += n
        masked += int(high.sum())
    assert abs(masked / eligible - 0.4) <= 0.01


def test_spans_in_bounds_and_inside_one_document(built):
    out, _ = built
    span_tokens = doc_tokens = 0
    for sample in read_samples(out).values():
        sample.validate(SEQ_LEN)
        for s, e in sample.spans:
            assert 8 <= e - s <= 32
            assert ((sample.segments[:, 0] < s) & (e <= sample.segments[:, 1])).any()
        span_tokens += int((sample.spans[:, 1] - sample.spans[:, 0]).sum())
        doc_tokens += int((sample.segments[:, 1] - sample.segments[:, 0]).sum())
    assert 0.08 < span_tokens / doc_tokens < 0.2


def test_rerun_of_finished_job_does_nothing(built, corpus, capsys):
    out, _ = built
    before = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    summary = run_job(config(corpus, out))
    assert summary.already_complete and summary.samples == 0
    assert "already complete" in capsys.readouterr().err
    assert before == {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}


def test_other_settings_are_refused(built, corpus):
    out, _ = built
    with pytest.raises(BuildError) as e:
        run_job(config(corpus, out, seq_len=64, seed=3))
    message = str(e.value)
    assert "seq_len: directory has 128, this run has 64" in message
    assert "seed: directory has 0, this run has 3" in message
    assert "new --output" in message
    with pytest.raises(BuildError, match="built with --num-jobs 1, this run has --num-jobs 2"):
        run_job(config(corpus, out, num_jobs=2))


def test_same_samples_from_parquet_and_hf_dataset(corpus, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = list(read_texts(corpus[0], "text", RecordStats()))
    pq.write_table(pa.table({"body": docs}), tmp_path / "in.parquet")
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "in_ds"))
    runs = {}
    for name, src, field in [("zst", corpus[0], "text"), ("parquet", str(tmp_path / "in.parquet"), "body"),
                             ("hf", str(tmp_path / "in_ds"), "body")]:
        run_job(config([src], tmp_path / name, text_field=field))
        runs[name] = read_samples(tmp_path / name)
    for name in ("parquet", "hf"):
        assert runs[name].keys() == runs["zst"].keys()
        for key, sample in runs["zst"].items():
            np.testing.assert_array_equal(runs[name][key].input_ids, sample.input_ids)
            np.testing.assert_array_equal(runs[name][key].mask_rank, sample.mask_rank)


def bad_file(path, kind: str) -> str:
    """300 good records with one bad one in the middle (line 151), or a .zst of 3000 good records cut short."""
    good = [json.dumps({"text": line}).encode() for line in "\n".join(documents(HOLDOUT)).split("\n") if line.strip()]
    lines = {"not_json": good[:150] + [b"{oops"] + good[150:300],
             "missing_field": good[:150] + [json.dumps({"txt": "x"}).encode()] + good[150:300],
             "not_string": good[:150] + [json.dumps({"text": ["x"]}).encode()] + good[150:300],
             "empty": good[:150] + [json.dumps({"text": " \t"}).encode()] + good[150:300],
             "invalid_utf8": good[:150] + [b'{"text": "\xff\xfe"}'] + good[150:300]}
    if kind == "corrupt_file":
        cobj = zstandard.ZstdCompressor().compressobj()  # one frame of many blocks, like a streamed .zst
        data = b"".join(cobj.compress(b"\n".join(good[i:i + 200]) + b"\n") + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
                        for i in range(0, 3000, 200))
        with open(path, "wb") as f:
            f.write(data[: len(data) * 3 // 4])
    else:
        with open(path, "wb") as f:
            f.write(b"\n".join(lines[kind]) + b"\n")
    return str(path)


@pytest.mark.parametrize("kind,message", [
    ("not_json", "bad.jsonl:151: invalid JSON"),
    ("missing_field", "bad.jsonl:151: field 'text' is missing or null"),
    ("not_string", "bad.jsonl:151: field 'text' is list"),
    ("empty", "bad.jsonl:151: empty document"),
    ("invalid_utf8", "bad.jsonl:151: byte 10 is not UTF-8"),
    ("corrupt_file", "bad.jsonl.zst:"),
])
def test_bad_records_are_counted_and_reported(tmp_path, capsys, kind, message):
    path = bad_file(tmp_path / ("bad.jsonl.zst" if kind == "corrupt_file" else "bad.jsonl"), kind)
    out = tmp_path / "out"
    run_job(config([path], out))
    err = capsys.readouterr().err
    assert message in err and "warning:" in err
    files = json.load(open(out / job_manifest_name(0)))["files"]
    assert files[0]["bad_records"] == {kind: 1}


def test_too_many_bad_records_fail_after_committing_earlier_files(corpus, tmp_path):
    bad = tmp_path / "z-bad.jsonl"  # sorts after the corpus files
    bad.write_bytes(b"\n".join([json.dumps({"text": "fine"}).encode()] * 10 + [b"not json"] * 2) + b"\n")
    out = tmp_path / "out"
    inputs = [*corpus[:2], str(bad)]
    with pytest.raises(BuildError) as e:
        run_job(config(inputs, out))
    assert f"{bad}: 2 bad records of 12 (16.67%: not_json 2) exceed --max-bad-fraction 0.01" in str(e.value)
    assert "the 2 files before it are committed" in str(e.value)
    job = json.load(open(out / job_manifest_name(0)))
    assert not job["complete"] and [f["file_index"] for f in job["files"]] == [0, 1]
    assert not [n for n in os.listdir(out) if n.startswith(".work")]
    assert (out / ".lock-job-00000").exists()  # an unfinished job keeps its lock file; a finished one removes it
    # max_bad_fraction is not a shard setting: a re-run with a higher limit continues with the bad file
    summary = run_job(config(inputs, out, max_bad_fraction=0.2))
    assert summary.files == 1 and summary.bad_records == 2 and not (out / ".lock-job-00000").exists()
    reference = tmp_path / "ref"
    run_job(config(inputs, reference, max_bad_fraction=0.2))
    assert dir_bytes(out) == dir_bytes(reference)


@pytest.mark.parametrize("option,message", [
    ({"seed": -1}, "--seed must be in [0, 2**64), got -1"),
    ({"seq_len": 0}, "--seq-len must be in [1, "),
    ({"span_min": 9, "span_max": 8}, "need 1 <= --span-min <= --span-max, got 9..8"),
    ({"job_index": 2, "num_jobs": 2}, "--job-index must be in [0, 2) for --num-jobs 2, got 2"),
])
def test_bad_options_are_refused_before_any_work(corpus, tmp_path, option, message):
    with pytest.raises(BuildError) as e:
        run_job(config(corpus, tmp_path / "out", **option))
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer(corpus, tmp_path, capsys):
    rc = build_cli.main(["--input", corpus[0], "--tokenizer", str(tmp_path / "nope"), "--output",
                            str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(f"error: tokenizer {tmp_path / 'nope'} does not exist")


def test_slurm_array_defaults():
    assert build_cli.slurm_array_defaults({}) == (0, 1)
    assert build_cli.slurm_array_defaults({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "4",
                                              "SLURM_ARRAY_TASK_COUNT": "8"}) == (3, 8)


# a build (this process) forks one pool worker as its pool starts them, writes the worker's pid to argv[1], and waits;
# the build's pid is taken before the fork, as the pool's initargs take it: read in the worker, it is the reaper's
# once the build has been killed, and a worker that had not reached its prctl yet then passed the parent check
BUILD_WITH_A_WORKER = """
import os, sys, time
from pipeline.data.prep import build
parent = os.getpid()
worker = os.fork()
if worker == 0:
    build._pool_worker(parent, None, None, None, "a tokenizer")
    time.sleep(600)  # a file being tokenized
    os._exit(0)
with open(sys.argv[1], "w") as f:
    f.write(str(worker))
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_worker_dies_with_its_build_when_that_is_killed(tmp_path):
    """SIGKILL reaches the build alone, and its pool workers went on writing into the killed run's work directory,
    beside a rerun that had cleaned it up (test_sigkill_midway_then_rerun_is_identical, now and then under load:
    a .work directory left in the output): a worker now dies with the build."""
    pid_file = tmp_path / "worker"
    build = subprocess.Popen([sys.executable, "-c", BUILD_WITH_A_WORKER, str(pid_file)], env={**os.environ,
                             "PYTHONPATH": ROOT})
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    build.kill()
    build.wait()
    try:
        while time.monotonic() < deadline and not gone(worker):
            time.sleep(0.05)
        assert gone(worker), "the worker outlived its killed build"
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.e2e
def test_sigkill_midway_then_rerun_is_identical(tmp_path):
    inputs = split_corpus(tmp_path, 12, TRAIN, max_chars=3000)
    cmd = [sys.executable, os.path.join(ROOT, "data_prep/build_shards.py"), "--input", *inputs, "--tokenizer",
           TOKENIZER, "--seq-len", str(SEQ_LEN), "--samples-per-shard", "50", "--no-progress", "--workers", "2"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run_job(config(inputs, reference, remainder="drop", samples_per_shard=50, workers=2))

    proc = subprocess.Popen([*cmd, "--output", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job_json = killed / job_manifest_name(0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if job_json.exists() and json.load(open(job_json))["files"]:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job finished before it could be killed: give it more data"
    job = json.load(open(job_json))
    assert not job["complete"] and 0 < len(job["files"]) < len(inputs)

    run_job(config(inputs, killed, remainder="drop", samples_per_shard=50, workers=2))
    assert dir_bytes(killed) == dir_bytes(reference)
    assert os.path.exists(killed / INDEX) and os.path.exists(killed / MANIFEST)
