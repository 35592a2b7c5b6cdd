"""A shard directory's index as training reads it, and the contract it must meet before anything reads it.

:func:`load_index` trusts only the job manifests (``prep/manifest.py`` writes them, and explains each file), so a
missing ``index.json`` costs nothing. The ``check_*`` functions hold an index to what the experiment needs (its
tokenizer and sequence length, the shard kind its objectives read, one global batch of samples, every shard at the
size its manifest records), once, at preflight; :func:`verify_shard_hash` holds a shard to its manifest's sha256
when a reader first opens it."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

from pipeline.data.format.remote import ShardStore, is_url
from pipeline.data.format.sample import FORMAT_VERSION
from pipeline.data.format.tar_shard import SHARD_FIX, ShardCorrupt, sha256_file, sha256_mismatch
from pipeline.io import read_json

MANIFEST = "manifest.json"
INDEX = "index.json"
UNNAMED_SOURCE = "default"  # the one source of shards that record none


def job_manifest_name(job_index: int) -> str:
    return f"job-{job_index:05d}.json"


def settings_fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    name: str
    path: str  # a URL when the directory is one
    samples: int
    tokens: int
    bytes: int
    sha256: str
    source: str = UNNAMED_SOURCE  # the source of all its samples


@dataclass(frozen=True)
class DatasetIndex:
    directory: str
    fingerprint: str
    settings: dict
    shards: tuple[ShardInfo, ...]
    jobs: tuple[dict, ...]
    store: ShardStore | None = None  # how to fetch the shards of a directory at a URL; None for a local one
    tokenizer_path: str = ""  # where the build read its tokenizer (manifest.json), to name it when another is given

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def sources(self) -> tuple[str, ...]:
        """The names of the directory's sources, sorted: a sample's source id is its position here."""
        return tuple(sorted({s.source for s in self.shards}))

    def source_counts(self) -> dict[str, dict[str, int]]:
        """Documents, samples and tokens of each source (documents from the job manifests: counted per file)."""
        counts = {name: {"documents": 0, "samples": 0, "tokens": 0} for name in self.sources}
        for s in self.shards:
            counts[s.source]["samples"] += s.samples
            counts[s.source]["tokens"] += s.tokens
        for job in self.jobs:
            for f in job["files"]:
                for name, c in f.get("sources", {UNNAMED_SOURCE: {"documents": f["documents"]}}).items():
                    counts.setdefault(name, {"documents": 0, "samples": 0, "tokens": 0})["documents"] += c["documents"]
        return counts

    @property
    def seq_len(self) -> int:
        return int(self.settings["seq_len"])

    @property
    def tokenizer(self) -> dict:
        return self.settings["tokenizer"]

    @property
    def units(self) -> str | None:
        """The unit mode of sentence-unit shards (``build_shards.py --units``); None for packed shards."""
        return self.settings.get("units")

    @property
    def pairs(self) -> dict | None:
        """The layout of pairs shards (``build_shards.py --pairs``: slots, width, instruction format, ...); None
        for other shards."""
        return self.settings.get("pairs")


def _read(directory: str, name: str, fix: str, store: ShardStore | None) -> dict:
    if store is None:
        return read_json(os.path.join(directory, name), fix)
    return store.read_json(f"{directory}/{name}", fix)


def load_manifest(directory: str, store: ShardStore | None = None) -> dict:
    manifest = _read(directory, MANIFEST, f"{directory} is not a shard directory; build one with "
                                          f"data_prep/build_shards.py", store)
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory}/{MANIFEST}: format {manifest.get('format')!r} is not {FORMAT_VERSION!r}; "
                         f"rebuild the shards with this version of data_prep/build_shards.py")
    if settings_fingerprint(manifest["settings"]) != manifest["fingerprint"]:
        raise ValueError(f"{directory}/{MANIFEST}: fingerprint does not match its settings (edited by hand?); "
                         f"rebuild the shard directory")
    return manifest


def load_index(directory: str, store: ShardStore | None = None) -> DatasetIndex:
    """All shards of a finished shard directory (local, or at a URL: fetched through ``store``, by default a
    :class:`ShardStore` with its defaults); raises naming the prep jobs still to (re)run."""
    if is_url(directory):
        directory, store = directory.rstrip("/"), store or ShardStore()
    else:
        directory, store = os.path.abspath(directory), None
    manifest = load_manifest(directory, store)
    jobs, unfinished = [], []
    for k in range(manifest["num_jobs"]):
        try:
            job = _read(directory, job_manifest_name(k),
                        f"prep job {k} has not run; run build_shards.py --job-index {k}", store)
        except FileNotFoundError:
            job = None
        if job is None or not job.get("complete"):
            unfinished.append(k)
            continue
        if job.get("format") != FORMAT_VERSION:
            raise ValueError(f"{directory}/{job_manifest_name(k)}: format {job.get('format')!r} is not "
                             f"{FORMAT_VERSION!r}; rebuild the shards with this version of data_prep/build_shards.py")
        if job.get("fingerprint") != manifest["fingerprint"]:
            raise ValueError(f"{directory}/{job_manifest_name(k)}: fingerprint differs from {MANIFEST}; delete the "
                             f"directory and rebuild it")
        jobs.append(job)
    if unfinished:
        raise RuntimeError(f"{directory}: prep jobs {unfinished} of {manifest['num_jobs']} are not complete; "
                           f"run data_prep/build_shards.py with --job-index for each (re-running is safe)")
    join = (lambda name: f"{directory}/{name}") if store else (lambda name: os.path.join(directory, name))
    shards = sorted((ShardInfo(path=join(s["name"]), **s) for job in jobs for s in job["shards"]),
                    key=lambda s: s.name)
    return DatasetIndex(directory, manifest["fingerprint"], manifest["settings"], tuple(shards), tuple(jobs), store,
                        manifest.get("tokenizer_path", ""))


def check_compatible(index: DatasetIndex, tokenizer_fingerprint: str, seq_len: int) -> None:
    """Refuse shards built with another tokenizer or sequence length than the experiment's."""
    fix = ("rebuild the shards with data_prep/build_shards.py using the experiment's tokenizer and seq-len, "
           "or point the experiment at a shard directory built with them")
    built_with = index.tokenizer.get("fingerprint")
    if built_with != tokenizer_fingerprint:
        where = f" ({index.tokenizer_path})" if index.tokenizer_path else ""
        raise ValueError(f"{index.directory}: shards were built with tokenizer{where} fingerprint {built_with!r}, the "
                         f"experiment's tokenizer has {tokenizer_fingerprint!r}; {fix}")
    if index.seq_len != seq_len:
        raise ValueError(f"{index.directory}: shards have seq_len {index.seq_len}, the experiment uses {seq_len}; {fix}")


class ShardKind(str, Enum):
    """What a shard directory's samples are, and so which objectives read it (``Objective.shard_kind``): packed
    token sequences (several documents a sample), sentence units (``--units``, one a sample) or (query, positive,
    negatives) rows (``--pairs``). A ``str`` that formats as its value, so keys, JSON and messages read
    "packed", "units", "pairs" as before."""

    PACKED = "packed"
    UNITS = "units"
    PAIRS = "pairs"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def check_shard_kind(index: DatasetIndex, kind: ShardKind, setting: str, readers: list[str]) -> None:
    """Refuse shards of another kind than the objectives ``readers`` read (``Objective.shard_kind``):
    ``setting`` names the config key that chose the directory."""
    if kind == ShardKind.PAIRS and index.pairs is None:
        raise ValueError(f"{setting} {index.directory} holds {'units' if index.units else 'packed samples'}, but "
                         f"{', '.join(readers)} reads (query, positive, negatives) rows; build pairs shards with "
                         f"data_prep/build_shards.py --pairs and set {setting} to them")
    if kind != ShardKind.PAIRS and index.pairs is not None:
        raise ValueError(f"{setting} {index.directory} holds (query, positive, negatives) rows (built with --pairs), "
                         f"but {', '.join(readers)} reads {kind}; point {setting} at shards built without --pairs")
    if kind == ShardKind.UNITS and index.units is None:
        raise ValueError(f"{setting} {index.directory} holds packed samples (several documents a sample), but "
                         f"{', '.join(readers)} reads sentence units, one a sample; build unit shards with "
                         f"data_prep/build_shards.py --units sentence and set {setting} to them")
    if kind == ShardKind.PACKED and index.units is not None:
        raise ValueError(f"{setting} {index.directory} holds {index.units} units (built with --units), but "
                         f"{', '.join(readers)} reads packed samples; point {setting} at shards built without --units")


def check_enough_samples(index: DatasetIndex, global_batch: int, num_samples: int | None = None) -> None:
    """A loader yields whole global batches: a directory with fewer samples than one would yield nothing. Checked
    once, before any loader is built (the trainer's preflight); :class:`ShardLoader` does not repeat it.
    ``num_samples``: the samples training reads, when some are held out (default: all)."""
    n = index.num_samples if num_samples is None else num_samples
    if n < global_batch:
        held = f", {n} of them for training ({index.num_samples - n} held out)" if n != index.num_samples else ""
        raise ValueError(f"{index.directory} holds {index.num_samples} samples{held}, fewer than one global batch of "
                         f"{global_batch}; use a smaller batch or build more data")


def _shard_size(index: DatasetIndex, info: ShardInfo) -> int:
    try:
        return os.path.getsize(info.path) if index.store is None else index.store.size(info.path)
    except FileNotFoundError:
        raise ShardCorrupt(f"{info.path}: listed in the manifests of {index.directory} but missing; "
                           f"{SHARD_FIX}") from None


def check_shard_sizes(index: DatasetIndex) -> None:
    """Every shard of ``index`` exists with the size its manifest records: one stat each (a HEAD request each at a
    URL, 16 at a time), so it runs at start-up (a truncated copy or a missing file stops the run before training,
    not hours into it)."""
    with ThreadPoolExecutor(16 if index.store else 1) as pool:
        sizes = list(pool.map(lambda info: _shard_size(index, info), index.shards))
    for info, size in zip(index.shards, sizes):
        if size != info.bytes:
            raise ShardCorrupt(f"{info.path}: {size} bytes, the manifest records {info.bytes} (truncated or "
                               f"overwritten); {SHARD_FIX}")


def verify_shard_hash(info: ShardInfo) -> None:
    """The shard's sha256 against its manifest: a flipped byte would otherwise train on changed data."""
    found = sha256_file(info.path)
    if found != info.sha256:
        raise ShardCorrupt(sha256_mismatch(info.path, info.sha256, found))
