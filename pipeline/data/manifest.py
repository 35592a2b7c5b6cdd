"""Manifests of a shard directory.

- ``manifest.json``: written once by the first prep job; ``format``, ``fingerprint`` (sha256 of ``settings``),
  ``settings`` (everything that determines the shard bytes: tokenizer, seq_len, seed, mask and span settings,
  packing, input file list) and ``num_jobs``.
- ``job-{k:05d}.json``: each prep job's own progress: the input files it finished (with their shards, counts and
  bad-record counts), its shards with sample/token counts and sha256, and ``complete``.
- ``index.json``: the merged shard list, written (atomically, idempotently) by whichever job finishes last.

Readers call :func:`load_index`, which trusts only the job manifests, so a missing ``index.json`` costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from pipeline.data.format import FORMAT_VERSION

MANIFEST = "manifest.json"
INDEX = "index.json"


def job_manifest_name(job_index: int) -> str:
    return f"job-{job_index:05d}.json"


def settings_fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path} not found: {what}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): {what}") from e


@dataclass(frozen=True)
class ShardInfo:
    name: str
    path: str
    samples: int
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class DatasetIndex:
    directory: str
    fingerprint: str
    settings: dict
    shards: tuple[ShardInfo, ...]
    jobs: tuple[dict, ...]

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

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


def load_manifest(directory: str) -> dict:
    manifest = read_json(os.path.join(directory, MANIFEST),
                         f"{directory} is not a shard directory; build one with data_prep/build_shards.py")
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory}/{MANIFEST}: format {manifest.get('format')!r} is not {FORMAT_VERSION!r}; "
                         f"rebuild the shards with this version of data_prep/build_shards.py")
    if settings_fingerprint(manifest["settings"]) != manifest["fingerprint"]:
        raise ValueError(f"{directory}/{MANIFEST}: fingerprint does not match its settings (edited by hand?); "
                         f"rebuild the shard directory")
    return manifest


def load_index(directory: str) -> DatasetIndex:
    """All shards of a finished shard directory; raises naming the prep jobs still to (re)run."""
    directory = os.path.abspath(directory)
    manifest = load_manifest(directory)
    jobs, unfinished = [], []
    for k in range(manifest["num_jobs"]):
        path = os.path.join(directory, job_manifest_name(k))
        job = read_json(path, f"prep job {k} has not run; run build_shards.py --job-index {k}") \
            if os.path.exists(path) else None
        if job is None or not job.get("complete"):
            unfinished.append(k)
            continue
        if job["fingerprint"] != manifest["fingerprint"]:
            raise ValueError(f"{path}: fingerprint differs from {MANIFEST}; delete the directory and rebuild it")
        jobs.append(job)
    if unfinished:
        raise RuntimeError(f"{directory}: prep jobs {unfinished} of {manifest['num_jobs']} are not complete; "
                           f"run data_prep/build_shards.py with --job-index for each (re-running is safe)")
    shards = sorted((ShardInfo(path=os.path.join(directory, s["name"]), **s) for job in jobs for s in job["shards"]),
                    key=lambda s: s.name)
    return DatasetIndex(directory, manifest["fingerprint"], manifest["settings"], tuple(shards), tuple(jobs))
