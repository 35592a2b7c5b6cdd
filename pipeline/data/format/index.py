"""A shard directory's index as training reads it: :func:`load_index` trusts only the job manifests
(``prep/manifest.py`` writes them, and explains each file), so a missing ``index.json`` costs nothing."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from pipeline.data.format.remote import ShardStore, is_url
from pipeline.data.format.sample import FORMAT_VERSION
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
        if job["fingerprint"] != manifest["fingerprint"]:
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
