"""Writing and random-access reading of one tar shard and its ``.idx.npy`` sidecar."""

from __future__ import annotations

import hashlib
import os
import tarfile

import numpy as np

from pipeline.data.format.sample import Sample, append_sample_tar, index_path, read_sample, tar_end
from pipeline.io import fsync_replace

SHARD_FIX = ("copy the shard again from where it was built, or rebuild the shard directory with "
             "data_prep/build_shards.py; data_prep/inspect_shards.py DIR checks every shard")


class ShardCorrupt(ValueError):
    pass


def sha256_mismatch(where: str, expected: str, found: str) -> str:
    return (f"{where}: sha256 mismatch: the manifest records {expected}, the file has {found} (changed after it was "
            f"written: a disk or copy error); {SHARD_FIX}")


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Writes one shard under a temporary name; ``close()`` fsyncs and renames it, so a killed job never leaves a
    file with the final name that is incomplete. The tar is plain POSIX ustar with fixed metadata (byte-reproducible),
    readable by ``webdataset.WebDataset``, and hashed as it is written. Samples are gathered into ~1 MB blocks
    before they are hashed and written: per-sample writes cost data prep a few percent more."""

    FLUSH_BYTES = 1 << 20

    def __init__(self, path: str):
        self.path = path
        self.tmp = path + ".tmp"
        self._f = open(self.tmp, "wb")
        self._sha = hashlib.sha256()
        self._buf = bytearray()
        self._size = 0
        self._offsets: list[tuple[int, int]] = []
        self.num_tokens = 0

    def _flush(self) -> None:
        try:
            self._f.write(self._buf)
        except OSError as e:  # a write error has no file name: a full disk would not say which one
            raise OSError(e.errno, e.strerror, self.tmp) from e
        self._sha.update(self._buf)
        self._buf.clear()

    def write(self, sample: Sample) -> None:
        start = len(self._buf)
        append_sample_tar(sample, self._buf)
        length = len(self._buf) - start
        self._offsets.append((self._size, length))
        self._size += length
        self.num_tokens += sum(e - s for s, e in sample.segments.tolist())
        if len(self._buf) >= self.FLUSH_BYTES:
            self._flush()

    @property
    def num_samples(self) -> int:
        return len(self._offsets)

    def close(self) -> dict:
        """Finish the shard; returns its manifest entry (name, samples, tokens, bytes, sha256)."""
        end = tar_end(self._size)
        self._buf += end
        self._size += len(end)
        self._flush()
        self._f.close()
        idx_tmp = index_path(self.path) + ".tmp"
        with open(idx_tmp, "wb") as f:
            np.save(f, np.asarray(self._offsets, dtype=np.int64).reshape(-1, 2), allow_pickle=False)
        fsync_replace(idx_tmp, index_path(self.path))
        fsync_replace(self.tmp, self.path)
        return {"name": os.path.basename(self.path), "samples": self.num_samples, "tokens": self.num_tokens,
                "bytes": self._size, "sha256": self._sha.hexdigest()}

    def abort(self) -> None:
        self._f.close()
        for p in (self.tmp, index_path(self.path) + ".tmp"):
            if os.path.exists(p):
                os.remove(p)


def load_sidecar(path: str) -> np.ndarray:
    """The ``.idx.npy`` of the shard ``path``, checked against the tar (the manifest's sha256 covers only the
    tar): an integer [n, 2] array of (offset, length) rows that tile the tar from byte 0, as the writer lays samples
    back to back, and end before its two closing zero blocks. So every row locates the sample it was written for."""
    sidecar = index_path(path)
    try:
        index = np.load(sidecar, allow_pickle=False)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{sidecar} is missing: the shard {path} has no index; "
                                f"rebuild it with data_prep/build_shards.py") from e
    except Exception as e:  # noqa: BLE001 - a damaged .npy fails in many ways (ValueError, EOFError, SyntaxError)
        raise ShardCorrupt(f"{sidecar}: not a readable sample index ({type(e).__name__}: "
                           f"{' '.join(str(e).split())}); {SHARD_FIX}") from None
    if index.dtype.kind not in "iu" or index.ndim != 2 or index.shape[1] != 2:
        raise ShardCorrupt(f"{sidecar}: a sample index is an integer [n, 2] array, this is {index.dtype} "
                           f"{list(index.shape)}; {SHARD_FIX}")
    index = index.astype(np.int64)
    ends = np.cumsum(index[:, 1])
    if len(index) and ((index[:, 1] <= 0).any() or (index[:, 0] != ends - index[:, 1]).any()
                       or ends[-1] > os.path.getsize(path) - 2 * tarfile.BLOCKSIZE):
        raise ShardCorrupt(f"{sidecar}: its (offset, length) rows do not tile the samples of {path} (damaged, or "
                           f"the sidecar of another shard); {SHARD_FIX}")
    return index


class ShardReader:
    """Random access to the samples of one shard through its index sidecar."""

    def __init__(self, path: str):
        self.path = path
        self.index = load_sidecar(path)
        self._f = None

    def __len__(self) -> int:
        return len(self.index)

    def open(self) -> ShardReader:
        """Open the tar now rather than at the first read (a cached remote shard may be evicted once it is open)."""
        if self._f is None:
            self._f = open(self.path, "rb")
        return self

    def __getitem__(self, i: int) -> Sample:
        self.open()  # lazily by default, so readers survive fork into dataloader workers
        off, length = self.index[i]
        try:
            return read_sample(self._f, int(off), int(length))
        except (ValueError, tarfile.TarError, EOFError) as e:
            raise ValueError(f"{self.path}: sample {i} at byte {off} is corrupt ({e}); "
                             f"check it with data_prep/inspect_shards.py and rebuild the shard") from e

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
