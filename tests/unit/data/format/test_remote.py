"""Shard directories at a URL (``pipeline/data/format/remote.py``): real shards served by a loopback HTTP server (and
fsspec's in-memory filesystem for the other schemes) give the loader, preflight and a 2-rank ZeRO-3 run exactly what
the local directory gives, through a dropped connection, a bounded cache and a server that never answers."""

from __future__ import annotations

import contextlib
import os
import socket

import fsspec
import numpy as np
import pytest
from helpers import http_server, launch_training, logged_steps, make_shard_dir, one_error

from pipeline.config import ConfigError
from pipeline.data.format.index import check_shard_sizes, load_index
from pipeline.data.format.remote import RemoteError, ShardStore
from pipeline.data.format.tar_shard import ShardCorrupt
from pipeline.data.loading.batch import Batch
from pipeline.data.loading.loader import ShardLoader, iter_eval
from pipeline.data.prep import inspection
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import SAMPLE_DIR, load_experiment
from pipeline.train.preflight import check_setup


def _arrays(batch: Batch) -> dict:
    return {"keys": batch.keys, **{name: getattr(batch, name).numpy() for name in
                                   ("input_ids", "doc_ids", "mask_rank", "mask_draw", "span_ids")}}


def _stream(index, steps: int = 4, dp_world: int = 2) -> list[dict]:
    """Every rank's micro-batches of ``steps`` optimizer steps, then the evaluation pass."""
    out = []
    for rank in range(dp_world):
        loader = ShardLoader(index, micro_batch=3, grad_accum=2, dp_rank=rank, dp_world=dp_world, seed=1)
        out += [_arrays(b) for _ in range(steps) for b in loader.next_global_step()]
        out += [_arrays(b) for b in iter_eval(index, 4, rank, dp_world)]
    return out


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])


@pytest.fixture
def served(tmp_path):
    """(local shard directory, the loopback server of its parent)."""
    directory = make_shard_dir(tmp_path / "data")
    with http_server(str(tmp_path / "data")) as server:
        yield directory, server


def test_loader_over_http_gives_the_local_batches_and_downloads_each_shard_once(served, tmp_path):
    directory, server = served
    remote = load_index(f"{server.url}/shards/", ShardStore(cache_dir=str(tmp_path / "cache")))
    assert remote.fingerprint == load_index(directory).fingerprint
    check_shard_sizes(remote)
    _assert_same(_stream(remote), _stream(load_index(directory)))
    tars = {p: n for p, n in server.gets.items() if p.endswith(".tar")}
    assert sorted(tars) == [f"/shards/{s.name}" for s in remote.shards]
    assert set(tars.values()) == {1}  # two ranks, a loader each, several epochs: one download per shard


@pytest.mark.parametrize("dropped, warning", [
    ("shard-00000-000001.tar", "IncompleteTransfer: the connection ended after 35840 of 71680 bytes"),
    ("shard-00000-000001.idx.npy", "ValueError: "),  # np.load of half an array
])
def test_dropped_connection_mid_shard_is_retried_with_the_same_batches(served, tmp_path, capsys, dropped, warning):
    directory, server = served
    server.drop = f"/shards/{dropped}"
    remote = load_index(f"{server.url}/shards", ShardStore(cache_dir=str(tmp_path / "cache"), backoff_s=0.01))
    _assert_same(_stream(remote), _stream(load_index(directory)))
    assert server.drop is None and server.gets[f"/shards/{dropped}"] == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {server.url}/shards/shard-00000-000001.tar: {warning}"), line
    assert line.endswith("; retrying in 0.01 s (attempt 2 of 5)"), line
    assert not [n for n in os.listdir(tmp_path / "cache" / remote.fingerprint[:16]) if ".part" in n]


def test_workers_sharing_a_cache_download_each_shard_once_and_clear_a_killed_download(served, tmp_path):
    directory, server = served
    local = load_index(directory)
    stale = tmp_path / "cache" / local.fingerprint[:16] / f"{local.shards[0].name}.part99999999"
    os.makedirs(stale.parent)
    stale.write_bytes(b"half a shard")
    remote = load_index(f"{server.url}/shards", ShardStore(cache_dir=str(tmp_path / "cache")))
    loaders = [ShardLoader(index, micro_batch=3, grad_accum=2, seed=1, num_workers=workers)
               for index, workers in ((remote, 2), (local, 0))]
    streams = [[_arrays(b) for _ in range(6) for b in loader.next_global_step()] for loader in loaders]
    _assert_same(*streams)
    assert {server.gets[f"/shards/{s.name}"] for s in local.shards} == {1}  # two processes, one download each
    assert not stale.exists()


def test_cache_beyond_its_bound_evicts_whole_shards(served, tmp_path):
    directory, server = served
    local = load_index(directory)
    cache = tmp_path / "cache"
    remote = load_index(f"{server.url}/shards", ShardStore(cache_dir=str(cache), max_bytes=local.shards[0].bytes))
    _assert_same(_stream(remote), _stream(local))
    left = sorted(os.listdir(cache / remote.fingerprint[:16]))
    assert len([n for n in left if n.endswith(".tar")]) == 1
    assert len([n for n in left if n.endswith(".idx.npy")]) == 1
    assert max(server.gets[f"/shards/{s.name}"] for s in local.shards) > 1  # evicted shards came back


def test_changed_byte_on_the_server_is_a_hash_mismatch_naming_the_url(tmp_path):
    directory = make_shard_dir(tmp_path / "data")
    bad = load_index(directory).shards[1]
    with open(bad.path, "r+b") as f:
        f.seek(bad.bytes // 2)
        byte = f.read(1)[0]
        f.seek(bad.bytes // 2)
        f.write(bytes([byte ^ 1]))
    with http_server(str(tmp_path / "data")) as server:
        remote = load_index(f"{server.url}/shards", ShardStore(cache_dir=str(tmp_path / "cache")))
        check_shard_sizes(remote)  # same size: only the hash sees it
        with pytest.raises(ShardCorrupt, match=rf"{server.url}/shards/{bad.name}: sha256 mismatch"):
            ShardLoader(remote, micro_batch=37).next_global_step()
    assert bad.name not in os.listdir(tmp_path / "cache" / remote.fingerprint[:16])


def test_fsspec_url_gives_the_local_batches(tmp_path):
    directory = make_shard_dir(tmp_path / "data")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            fs.pipe_file(f"/remote-test/{name}", f.read())
    try:
        remote = load_index("memory://remote-test", ShardStore(cache_dir=str(tmp_path / "cache")))
        check_shard_sizes(remote)
        _assert_same(_stream(remote, steps=2), _stream(load_index(directory), steps=2))
    finally:
        fs.rm("/remote-test", recursive=True)


@contextlib.contextmanager
def _silent_url():
    """The URL of a loopback server that takes connections into its backlog and never answers them."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/shards"


def test_url_that_never_answers_is_one_line_naming_it(tmp_path):
    with _silent_url() as url, pytest.raises(RemoteError) as err:
        load_index(url, ShardStore(attempts=2, timeout_s=0.2, backoff_s=0.01))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{url}/manifest.json: failed 2 times, the last with TimeoutError")
    assert "data.fetch_timeout_s" in message


@pytest.mark.e2e
def test_training_on_a_url_that_never_answers_stops_with_one_line(tmp_path):
    with _silent_url() as url:
        proc = launch_training(str(tmp_path / "run"), None, f"data.shards={url}", "data.fetch_attempts=2",
                               "data.fetch_timeout_s=1", check=False, launcher="deepspeed")
    line = one_error(proc, "error")
    assert line.startswith(f"error: {url}/manifest.json: failed 2 times, the last with TimeoutError"), line
    assert proc.returncode == 2
    assert not os.path.exists(os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../..")), "http:"))


def test_url_without_shards_is_a_config_error_and_nothing_is_built(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "empty")
    monkeypatch.chdir(tmp_path)
    with http_server(str(tmp_path / "empty")) as server:
        exp = load_experiment(None, [f"run_dir={tmp_path / 'run'}", f"data.shards={server.url}/s"])
        with pytest.raises(ConfigError, match=rf"^data.shards: {server.url}/s has no manifest.json, and shards are "
                                              r"never built at a URL"):
            check_setup(exp, 0, 1, False)
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # no "http:" directory, and no run directory


@pytest.mark.e2e
@pytest.mark.slow  # several launches: the slow suite
def test_two_rank_zero3_run_over_http_has_the_local_losses(tmp_path):
    data = tmp_path / "data"
    run_job(BuildConfig(inputs=(os.path.join(SAMPLE_DIR, "train", "**", "*.jsonl.zst"),),
                        tokenizer=os.path.join(SAMPLE_DIR, "tokenizer"), output=str(data / "shards"), seq_len=64,
                        samples_per_shard=8192, progress=False))  # 3 shards: the 24 samples read hit each
    dropped = f"/shards/{load_index(str(data / 'shards')).shards[1].name}"
    common = ["train.steps=6", "train.micro_batch=2", "train.log_every=1", "optim.warmup_steps=1",
              "optim.decay_steps=2", "checkpoint.every=100", "train.export_hf=false", "data.seq_len=64",
              "data.build_if_missing=false"]
    launch_training(str(tmp_path / "local"), None, *common, f"data.shards={data / 'shards'}")
    with http_server(str(data), drop=dropped) as server:
        proc = launch_training(str(tmp_path / "http"), None, *common, f"data.shards={server.url}/shards",
                               f"data.cache_dir={tmp_path / 'cache'}")
    assert server.gets[dropped] == 2, server.gets  # dropped once, then fetched whole
    assert "retrying in" in proc.stderr
    local, remote = logged_steps(str(tmp_path / "local")), logged_steps(str(tmp_path / "http"))
    assert sorted(local) == sorted(remote) == list(range(1, 7))
    assert [local[s]["loss/clm"] for s in local] == [remote[s]["loss/clm"] for s in local]


def test_inspect_shards_refuses_a_url_in_one_line(capsys):
    assert inspection.main(["https://example.invalid/shards"]) == 1
    assert capsys.readouterr().err == ("error: https://example.invalid/shards: inspect_shards reads a local shard "
                                       "directory; copy it here first\n")


def test_resume_moves_between_the_url_and_the_local_directory(served, tmp_path):
    directory, server = served
    local = load_index(directory)
    remote = load_index(f"{server.url}/shards", ShardStore(cache_dir=str(tmp_path / "cache")))
    straight = ShardLoader(local, micro_batch=3, grad_accum=2, seed=1)
    expected = [_arrays(b) for _ in range(5) for b in straight.next_global_step()]
    first = ShardLoader(remote, micro_batch=3, grad_accum=2, seed=1)
    got = [_arrays(b) for _ in range(2) for b in first.next_global_step()]
    resumed = ShardLoader(local, micro_batch=3, grad_accum=2, seed=1)
    resumed.load_state_dict(first.state_dict())
    got += [_arrays(b) for _ in range(3) for b in resumed.next_global_step()]
    _assert_same(got, expected)


def test_shard_missing_at_the_url_fails_the_size_check(served, tmp_path):
    directory, server = served
    missing = load_index(directory).shards[2]
    os.remove(missing.path)
    remote = load_index(f"{server.url}/shards", ShardStore(cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ShardCorrupt, match=rf"^{server.url}/shards/{missing.name}: listed in the manifests of "
                                           rf"{server.url}/shards but missing"):
        check_shard_sizes(remote)


@pytest.fixture
def s3_bucket(monkeypatch):
    """(s3fs filesystem, bucket) of moto's S3-compatible server on a free loopback port, reached through the
    environment alone (AWS_ENDPOINT_URL and dummy credentials), as a run on real object storage is."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (the dev extra has it)")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (the dev extra has it)")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()  # port 0: the OS picked a free one in the bind
        for name, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()  # a cached client would keep another test's endpoint
        fs = s3fs.S3FileSystem()
        fs.mkdir("shards-bucket")
        yield fs, "shards-bucket"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_s3_bucket_on_loopback_gives_the_local_batches_and_refuses_a_changed_object(s3_bucket, tmp_path):
    """A real shard directory uploaded to an S3-compatible server (moto): the manifest comes from the bucket, the
    loader yields exactly the local samples, and an object changed in the bucket is refused by its sha256."""
    fs, bucket = s3_bucket
    directory = make_shard_dir(tmp_path / "data")
    fs.put(directory + "/", f"{bucket}/corpus/shards/", recursive=True)
    local = load_index(directory)
    remote = load_index(f"s3://{bucket}/corpus/shards", ShardStore(cache_dir=str(tmp_path / "cache")))
    assert (remote.fingerprint, remote.num_samples) == (local.fingerprint, local.num_samples)
    assert remote.shards[0].path == f"s3://{bucket}/corpus/shards/{local.shards[0].name}"
    check_shard_sizes(remote)
    _assert_same(_stream(remote, steps=2), _stream(local, steps=2))

    bad = local.shards[1]
    with open(bad.path, "rb") as f:
        data = bytearray(f.read())
    data[bad.bytes // 2] ^= 1
    fs.pipe_file(f"{bucket}/corpus/shards/{bad.name}", bytes(data))  # same size: only the hash sees it
    changed = load_index(f"s3://{bucket}/corpus/shards", ShardStore(cache_dir=str(tmp_path / "cache2")))
    check_shard_sizes(changed)
    with pytest.raises(ShardCorrupt, match=rf"^s3://{bucket}/corpus/shards/{bad.name}: sha256 mismatch"):
        ShardLoader(changed, micro_batch=local.num_samples - 1).next_global_step()
