"""The fast shard writer (direct ustar headers, cached npy headers) gives exactly what tarfile and np.save give."""

import io
import tarfile

import numpy as np
import pytest

from pipeline.data.format import FIELDS, TAR_MTIME, Sample, member_bytes, sample_members, tar_end
from pipeline.data.shards import ShardReader, ShardWriter, sha256_file


def tarfile_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o444
            info.uname = info.gname = "data"
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def random_sample(rng, i: int, seq_len: int = 96) -> Sample:
    k, m = int(rng.integers(1, 5)), int(rng.integers(0, 4))
    return Sample(f"f{i:06d}s{i * 7:08d}", rng.integers(0, 50000, seq_len).astype(np.int32),
                  np.sort(rng.integers(0, seq_len, (k, 2)).astype(np.int32), axis=None).reshape(k, 2),
                  rng.integers(0, 1 << 16, seq_len).astype(np.uint16),
                  rng.integers(0, 1 << 32, seq_len, dtype=np.uint32), np.zeros((m, 2), np.int32) + i)


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 10_000])
def test_member_bytes_equal_tarfile(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    members = [("f000001s00000002.input_ids.npy", data)]
    blob = member_bytes(*members[0])
    assert blob + tar_end(len(blob)) == tarfile_bytes(members)


def test_npy_members_equal_np_save():
    sample = random_sample(np.random.default_rng(0), 3)
    for (name, data), field in zip(sample_members(sample), FIELDS):
        buf = io.BytesIO()
        np.save(buf, getattr(sample, field), allow_pickle=False)
        assert name == f"{sample.key}.{field}.npy" and data == buf.getvalue()


def test_shard_equals_tarfile_and_reads_back(tmp_path):
    rng = np.random.default_rng(1)
    samples = [random_sample(rng, i) for i in range(20)]
    writer = ShardWriter(str(tmp_path / "s.tar"))
    for s in samples:
        writer.write(s)
    entry = writer.close()
    written = (tmp_path / "s.tar").read_bytes()
    assert written == tarfile_bytes([m for s in samples for m in sample_members(s)])
    assert entry["bytes"] == len(written) and entry["sha256"] == sha256_file(str(tmp_path / "s.tar"))
    for s, back in zip(samples, ShardReader(str(tmp_path / "s.tar"))):
        assert back.key == s.key and all(np.array_equal(getattr(back, f), getattr(s, f)) for f in FIELDS)
