"""Shard directories in object storage: ``data.shards`` as a URL (``https://``, ``s3://``, ``gs://``, any fsspec URL).

The loader reads a sample by random access through its shard's ``.idx.npy`` offsets, so a :class:`ShardStore`
downloads whole shards (and their sidecars) into a bounded local cache and the ordinary local reader reads them
there. A download streams into a temporary name, is checked against the manifest's size and (with ``verify``) its
sha256, and is then renamed, so the cache only ever holds shards that passed; a killed download leaves no file under
the final name. Ranks and workers of one node may share a cache: a download holds an flock on the shard, so the
others wait for it instead of fetching the same bytes. The cache is bounded by evicting whole shards, least
recently used first. A dropped connection, a timeout or a server error is retried with exponential backoff; after
the last attempt the error names the URL. ``http(s)://`` goes through the standard library (its timeout is a plain
number); every other scheme through fsspec and the scheme's own package (s3fs, gcsfs, ...).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import fsspec
import numpy as np

from pipeline.data.format.sample import index_path
from pipeline.data.format.tar_shard import ShardCorrupt, ShardReader, sha256_mismatch

CHUNK = 1 << 20
DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), "decoder-encoders-shards")


def is_url(path: str) -> bool:
    return "://" in path


class RemoteError(OSError):
    """A URL that still fails after every attempt (a missing or forbidden one raises FileNotFoundError or
    PermissionError at once: no retry changes it)."""


class IncompleteTransfer(OSError):
    """The connection ended before the size the manifest records: dropped mid-transfer."""


def _http(request: str | urllib.request.Request, timeout_s: float):
    """The response to ``request``; a missing (404) or forbidden (401, 403) object raises FileNotFoundError or
    PermissionError (not worth a retry), any other HTTP error stays an OSError to retry."""
    try:
        return urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise (FileNotFoundError if e.code == 404 else PermissionError)(f"HTTP {e.code} {e.reason}") from e
        raise


def _is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _open(url: str, timeout_s: float):
    """A binary stream of the object at ``url``."""
    return _http(url, timeout_s) if _is_http(url) else fsspec.open(url, "rb").open()


def _size(url: str, timeout_s: float) -> int:
    if _is_http(url):
        with _http(urllib.request.Request(url, method="HEAD"), timeout_s) as response:
            return int(response.headers["Content-Length"])
    fs, path = fsspec.core.url_to_fs(url)
    return int(fs.size(path))


@dataclass(frozen=True)
class ShardStore:
    """How to reach a remote shard directory and where to keep its shards: picklable, so DataLoader workers get it
    with the index."""

    cache_dir: str = ""  # "": DEFAULT_CACHE
    max_bytes: int = 64 << 30
    attempts: int = 5
    timeout_s: float = 60.0
    backoff_s: float = 0.5  # the wait before the second attempt; doubled before each further one

    def _retry(self, url: str, action):
        """``action()`` with up to ``attempts`` tries; only a missing or forbidden object fails at once."""
        for attempt in range(1, self.attempts + 1):
            try:
                return action()
            except (FileNotFoundError, PermissionError) as e:
                raise type(e)(f"{url}: {e}") from None
            except Exception as e:  # noqa: BLE001 - each backend raises its own errors for a dropped connection
                if attempt == self.attempts:
                    raise RemoteError(f"{url}: failed {self.attempts} times, the last with {type(e).__name__}: {e}; "
                                      f"check the URL and the network (data.fetch_attempts, "
                                      f"data.fetch_timeout_s)") from None
                wait = self.backoff_s * 2 ** (attempt - 1)
                print(f"warning: {url}: {type(e).__name__}: {e}; retrying in {wait:g} s "
                      f"(attempt {attempt + 1} of {self.attempts})", file=sys.stderr, flush=True)
                time.sleep(wait)

    def read_bytes(self, url: str) -> bytes:
        def read() -> bytes:
            with _open(url, self.timeout_s) as f:
                return f.read()
        return self._retry(url, read)

    def read_json(self, url: str, fix: str) -> dict:
        """A manifest; a missing one raises FileNotFoundError naming the URL and ``fix``."""
        try:
            data = json.loads(self.read_bytes(url))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}; {fix}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{url}: not valid JSON ({e}); {fix}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{url}: the file's top level must be a mapping, got {type(data).__name__}; {fix}")
        return data

    def size(self, url: str) -> int:
        return self._retry(url, lambda: _size(url, self.timeout_s))

    def _download(self, url: str, dest: str, size: int | None) -> str:
        """Stream ``url`` into ``dest``; returns its sha256. A transfer shorter than ``size`` is a dropped one."""
        h, got = hashlib.sha256(), 0
        with _open(url, self.timeout_s) as src, open(dest, "wb") as out:
            while block := src.read(CHUNK):
                h.update(block)
                out.write(block)
                got += len(block)
        if size is not None and got != size:
            raise IncompleteTransfer(f"the connection ended after {got} of {size} bytes")
        return h.hexdigest()

    def _download_index(self, url: str, dest: str, samples: int) -> None:
        """The ``.idx.npy`` sidecar, whose size no manifest records: a cut transfer shows as an unreadable array or
        one of other than ``samples`` rows."""
        self._download(url, dest, None)
        if np.load(dest, allow_pickle=False).shape != (samples, 2):
            raise IncompleteTransfer(f"the index has not the {samples} rows of its shard")

    def open(self, info, fingerprint: str, verify: bool) -> ShardReader:
        """A reader of the shard ``info`` (a ``manifest.ShardInfo`` whose path is a URL), downloaded unless cached,
        and opened while the shard's lock is held: no eviction removes it in between, and once open it stays
        readable."""
        directory = os.path.join(self.cache_dir or DEFAULT_CACHE, fingerprint[:16])
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, info.name)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per shard and node; the others wait and find it cached
            if _cached(path, info.bytes):
                os.utime(path)  # its mtime is its last use, for the eviction
                return ShardReader(path).open()
            for stale in (p for f in (path, index_path(path)) for p in glob.glob(glob.escape(f) + ".part*")):
                os.remove(stale)  # left by a killed download: none but ours runs now
            parts = (f"{path}.part{os.getpid()}", f"{index_path(path)}.part{os.getpid()}")
            try:
                found = self._retry(info.path, lambda: self._download(info.path, parts[0], info.bytes))
                if verify and found != info.sha256:
                    raise ShardCorrupt(sha256_mismatch(info.path, info.sha256, found))
                self._retry(info.path, lambda: self._download_index(index_path(info.path), parts[1], info.samples))
                os.replace(parts[1], index_path(path))
                os.replace(parts[0], path)  # last: a shard under its final name is complete, its sidecar beside it
            finally:
                for part in parts:
                    if os.path.exists(part):
                        os.remove(part)
            reader = ShardReader(path).open()
        self._evict(keep=path)
        return reader

    def _evict(self, keep: str) -> None:
        """Remove the least recently used shards (whole, with their sidecars) until the cache fits ``max_bytes``,
        skipping a shard whose lock another process holds (it is being opened). A shard that a process has open
        stays readable there until it closes it."""
        root = self.cache_dir or DEFAULT_CACHE
        shards = []
        for sub in os.scandir(root):
            if sub.is_dir():
                shards += [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(sub.path)
                           if e.name.endswith(".tar")]
        total = sum(size for _, size, _ in shards)
        for _, size, path in sorted(shards):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            with open(path + ".lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                for p in (path, index_path(path)):
                    try:
                        os.remove(p)
                    except FileNotFoundError:  # evicted by another process just before
                        pass
            total -= size


def _cached(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size and os.path.exists(index_path(path))
    except FileNotFoundError:
        return False
