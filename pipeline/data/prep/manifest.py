"""Manifests of a shard directory.

- ``manifest.json``: written once by the first prep job; ``format``, ``fingerprint`` (sha256 of ``settings``),
  ``settings`` (everything that determines the shard bytes: tokenizer, seq_len, seed, mask and span settings,
  packing, input file list) and ``num_jobs``.
- ``job-{k:05d}.json``: each prep job's own progress: the input files it finished (with their shards, counts and
  bad-record counts), its shards with sample/token counts and sha256, and ``complete``. Shards built with sources
  (``--source-field`` / ``--source-default``) name theirs (``"source"``: each shard holds one source), and each
  file counts documents, samples and tokens per source (``"sources"``).
- ``index.json``: the merged shard list, written (atomically, idempotently) by whichever job finishes last; with
  sources, also ``sources``: documents, samples and tokens of each.

A directory whose shards name no source (built without ``--source-field``, or before sources existed) is one
source, :data:`UNNAMED_SOURCE`.

Prep jobs (``build.py``) write them through :func:`ensure_manifest`, :func:`load_job`, :func:`write_job` and
:func:`maybe_write_index`; readers call :func:`load_index`, which trusts only the job manifests, so a missing
``index.json`` costs nothing.
"""

from __future__ import annotations

import os

from pipeline.data.format.index import INDEX, MANIFEST, job_manifest_name, settings_fingerprint
from pipeline.data.format.sample import FORMAT_VERSION
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.io import read_json, write_json_atomic


def add_source_counts(total: dict[str, dict[str, int]], counts: dict[str, dict[str, int]]) -> None:
    """Add per-source counts ({name: {"documents", "samples", "tokens"}}) into ``total``."""
    for name, c in counts.items():
        into = total.setdefault(name, {k: 0 for k in c})
        for k, v in c.items():
            into[k] = into.get(k, 0) + v


def _describe(value) -> str:
    if isinstance(value, list) and len(value) > 3:
        return f"{len(value)} items [{value[0]!r}, ..., {value[-1]!r}]"
    return repr(value)


def _settings_diff(old: dict, new: dict) -> list[str]:
    return [f"  {key}: directory has {_describe(old.get(key))}, this run has {_describe(new.get(key))}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def ensure_manifest(cfg: BuildConfig, settings: dict, tokenizer_path: str) -> dict:
    """Create ``manifest.json`` if this is the first job, else check that it was made with the same settings."""
    path = os.path.join(cfg.output, MANIFEST)
    manifest = {"format": FORMAT_VERSION, "fingerprint": settings_fingerprint(settings), "settings": settings,
                "num_jobs": cfg.num_jobs, "tokenizer_path": tokenizer_path}
    if not os.path.exists(path):
        tmp = f"{path}.tmp{os.getpid()}"
        write_json_atomic(tmp, manifest)
        try:
            os.link(tmp, path)  # atomic create-if-absent: of two jobs starting together, one wins
        except FileExistsError:
            pass
        finally:
            os.remove(tmp)
    existing = read_json(path, "delete the directory and rebuild it")
    fix = f"use a new --output directory, or delete {cfg.output} to rebuild it with these settings"
    if existing.get("format") != FORMAT_VERSION:
        raise BuildError(f"{path}: made by shard format {existing.get('format')!r}, this is {FORMAT_VERSION!r}; {fix}")
    diff = _settings_diff(existing["settings"], settings)
    if diff:
        raise BuildError(f"{path}: the shard directory was built with other settings:\n" + "\n".join(diff) +
                         f"\n{fix}")
    if existing["num_jobs"] != cfg.num_jobs:
        raise BuildError(f"{path}: the shard directory was built with --num-jobs {existing['num_jobs']}, this run "
                         f"has --num-jobs {cfg.num_jobs}; run with --num-jobs {existing['num_jobs']} or {fix}")
    return existing


def load_job(cfg: BuildConfig, fingerprint: str) -> dict:
    """The job's manifest so far (a new, empty one before its first file)."""
    path = os.path.join(cfg.output, job_manifest_name(cfg.job_index))
    if not os.path.exists(path):
        return {"format": FORMAT_VERSION, "fingerprint": fingerprint, "job_index": cfg.job_index,
                "num_jobs": cfg.num_jobs, "complete": False, "files": [], "shards": []}
    job = read_json(path, f"delete it and re-run job {cfg.job_index}")
    if job.get("fingerprint") != fingerprint:
        raise BuildError(f"{path} was written with other settings than {MANIFEST}; delete {cfg.output} and rebuild")
    return job


def write_job(cfg: BuildConfig, job: dict) -> None:
    """Record the job's progress (atomically: a killed job restarts after its last recorded file)."""
    write_json_atomic(os.path.join(cfg.output, job_manifest_name(cfg.job_index)), job)


def maybe_write_index(output: str, manifest: dict) -> bool:
    """Write ``index.json`` once every job is complete (any job may do it; the content is deterministic)."""
    shards = []
    for k in range(manifest["num_jobs"]):
        path = os.path.join(output, job_manifest_name(k))
        if not os.path.exists(path):
            return False
        job = read_json(path, f"delete it and re-run job {k}")
        if not job.get("complete"):
            return False
        shards += job["shards"]
    shards.sort(key=lambda s: s["name"])
    index = {"format": FORMAT_VERSION, "fingerprint": manifest["fingerprint"], "num_jobs": manifest["num_jobs"],
             "num_samples": sum(s["samples"] for s in shards), "num_tokens": sum(s["tokens"] for s in shards),
             "shards": shards}
    if any("source" in s for s in shards):
        sources: dict[str, dict[str, int]] = {}
        for k in range(manifest["num_jobs"]):
            for f in read_json(os.path.join(output, job_manifest_name(k)), "")["files"]:
                add_source_counts(sources, f.get("sources", {}))
        index["sources"] = dict(sorted(sources.items()))
    path = os.path.join(output, INDEX)
    if not os.path.exists(path) or read_json(path, "delete it; the next prep job rewrites it") != index:
        write_json_atomic(path, index)
    return True
