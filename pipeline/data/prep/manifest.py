"""Manifests of a shard directory.

- ``manifest.json``: written once by the first prep job; ``format``, ``fingerprint`` (sha256 of ``settings``),
  ``settings`` (everything that determines the shard bytes: tokenizer, seq_len, seed, mask and span settings,
  packing, input file list) and ``num_jobs``; outside the settings, ``tokenizer_path`` and ``input_files``
  (each input's absolute path, bytes and modification time when the directory was made), which
  :func:`built_otherwise` holds a run's named inputs to.
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
from pipeline.data.prep.sources import input_record, input_size
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


def ensure_manifest(cfg: BuildConfig, settings: dict, tokenizer_path: str, inputs: list[str]) -> dict:
    """Create ``manifest.json`` if this is the first job, else check that it was made with the same settings."""
    path = os.path.join(cfg.output, MANIFEST)
    manifest = {"format": FORMAT_VERSION, "fingerprint": settings_fingerprint(settings), "settings": settings,
                "num_jobs": cfg.num_jobs, "tokenizer_path": tokenizer_path,
                "input_files": [input_record(p) for p in inputs]}
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


def _recorded_inputs(manifest: dict) -> list[dict] | None:
    """The inputs a directory was built from, as :func:`~pipeline.data.prep.sources.input_record` gives them (no
    modification time in directories made before it was recorded; their relative paths taken from here); None
    when the manifest names none (not written by data prep)."""
    if "input_files" in manifest:
        return manifest["input_files"]
    inputs = manifest["settings"].get("inputs")
    return None if inputs is None else [{**i, "path": os.path.abspath(i["path"])} for i in inputs]


def _real(path: str) -> str:
    """``path`` with its links resolved: one input reached through a linked directory (a checkout's ``runs`` linked
    elsewhere, a cluster's ``/home`` on ``/gpfs``) is the same input, so its shards are not refused as another's."""
    return os.path.realpath(path)


def _shown(paths: list[str]) -> str:
    """Paths for a one-line message: relative to here when under it, at most three named."""
    rel = [os.path.relpath(p) if p.startswith(os.getcwd() + os.sep) else p for p in paths]
    return f"[{', '.join(rel)}]" if len(rel) <= 3 else f"[{', '.join(rel[:2])}, ... {len(rel) - 2} more]"


def built_otherwise(manifest: dict, inputs: list[str], tokenizer: str | None, seq_len: int,
                    source: tuple[str, str]) -> list[str]:
    """How the directory of ``manifest`` differs from the shards that ``inputs`` (expanded input paths) build with
    the tokenizer of fingerprint ``tokenizer`` (None: not loaded yet, not compared) at ``seq_len`` with ``source``
    (field, default), each a phrase that follows "was built": another input list, an input changed since (size or
    modification time), another tokenizer, sequence length or source setting. Empty when they match (or the
    manifest names no inputs)."""
    settings, out = manifest["settings"], []
    recorded = _recorded_inputs(manifest)
    now = [input_record(p) for p in inputs]
    if recorded is not None and [_real(r["path"]) for r in recorded] != [_real(n["path"]) for n in now]:
        out.append(f"from {_shown([r['path'] for r in recorded])}, not {_shown([n['path'] for n in now])}")
    elif recorded is not None:
        changed = [n["path"] for r, n in zip(recorded, now) if r["bytes"] != n["bytes"]
                   or r.get("mtime_ns", n["mtime_ns"]) != n["mtime_ns"]]
        if changed:
            out.append(f"from {_shown(changed)} before {'they' if len(changed) > 1 else 'it'} changed (size or "
                       f"modification time)")
    if tokenizer is not None and settings["tokenizer"].get("fingerprint") != tokenizer:
        out.append(f"with another tokenizer ({manifest.get('tokenizer_path') or 'fingerprint'} "
                   f"{settings['tokenizer'].get('fingerprint')!r}, data.tokenizer has {tokenizer!r})")
    if settings["seq_len"] != seq_len:
        out.append(f"at seq_len {settings['seq_len']}, not {seq_len}")
    built_source = (settings.get("source_field", ""), settings.get("source_default", ""))
    if built_source != source:
        out.append(f"with sources from field/default {built_source}, not data.build_source_field/default {source}")
    return out


def fingerprinted_otherwise(manifest: dict, inputs: list[str], seq_len: int) -> bool:
    """Whether every build from ``inputs`` (expanded) at ``seq_len`` has another fingerprint than the directory of
    ``manifest``, whatever its tokenizer: the settings a fingerprint hashes differ in the inputs (their paths as
    given, their sizes) or the sequence length. Told without the tokenizer, unlike the fingerprint itself."""
    hashed = manifest["settings"].get("inputs")
    now = [{"path": p, "bytes": input_size(p)} for p in inputs]
    return manifest["settings"]["seq_len"] != seq_len or (hashed is not None and hashed != now)
