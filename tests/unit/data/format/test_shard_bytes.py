"""The fast shard writer (direct ustar headers, cached npy headers, one buffer per sample) gives exactly what
tarfile and np.save give."""

import io
import tarfile

import numpy as np
import pytest

from pipeline.data.format.sample import TAR_MTIME, Sample, tar_end
from pipeline.data.format.tar_shard import ShardReader, ShardWriter, sha256_file


def npy_members(sample: Sample) -> list[tuple[str, bytes]]:
    """The reference: one ``np.save`` file per field, in the sample's member order."""
    members = []
    for field in sample.fields():
        buf = io.BytesIO()
        np.save(buf, getattr(sample, field), allow_pickle=False)
        members.append((f"{sample.key}.{field}.npy", buf.getvalue()))
    return members


def tarfile_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o444
            info.uname = info.gname = "data"
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def random_sample(rng, i: int, seq_len: int, paraphrase: bool = False) -> Sample:
    k, m = int(rng.integers(1, 5)), int(rng.integers(0, 4))
    return Sample(f"f{i:06d}s{i * 7:08d}", rng.integers(0, 50000, seq_len).astype(np.int32),
                  np.sort(rng.integers(0, seq_len, (k, 2)).astype(np.int32), axis=None).reshape(k, 2),
                  rng.integers(0, 1 << 16, seq_len).astype(np.uint16),
                  rng.integers(0, 1 << 32, seq_len, dtype=np.uint32), np.zeros((m, 2), np.int32) + i,
                  rng.integers(0, 50000, seq_len).astype(np.int32) if paraphrase else None)


# .npy data of 128 + 4 * seq_len bytes: 96 fills 512-byte blocks exactly, the others end inside a block
@pytest.mark.parametrize("seq_len,paraphrase", [(1, False), (95, False), (96, False), (97, True), (1000, True)])
def test_shard_equals_tarfile_and_reads_back(tmp_path, seq_len, paraphrase):
    rng = np.random.default_rng(seq_len)
    samples = [random_sample(rng, i, seq_len, paraphrase) for i in range(20)]
    writer = ShardWriter(str(tmp_path / "s.tar"))
    for s in samples:
        writer.write(s)
    entry = writer.close()
    written = (tmp_path / "s.tar").read_bytes()
    assert written == tarfile_bytes([m for s in samples for m in npy_members(s)])
    assert entry["bytes"] == len(written) and entry["sha256"] == sha256_file(str(tmp_path / "s.tar"))
    for s, back in zip(samples, ShardReader(str(tmp_path / "s.tar"))):
        assert back.key == s.key and back.fields() == s.fields()
        assert all(np.array_equal(getattr(back, f), getattr(s, f)) for f in s.fields())


def test_empty_shard_is_an_empty_tar(tmp_path):
    entry = ShardWriter(str(tmp_path / "s.tar")).close()
    assert (tmp_path / "s.tar").read_bytes() == tar_end(0) == tarfile_bytes([])
    assert entry["samples"] == 0 and len(ShardReader(str(tmp_path / "s.tar"))) == 0
