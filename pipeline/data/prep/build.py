"""One shard-building job: tokenize, pack, plan masks and spans, and write the shards of the input files it owns.

The sorted input list is split over K independent jobs (file i belongs to job i % K) and each file is packed on its
own, so a sample depends only on (file_index, sample_index): K jobs and one job write the same samples. Inside a
job, worker processes each take whole files and write them into a private work directory; the main process takes
the results in file order, renames the shards to their final names and rewrites the job manifest after every
file. A killed job therefore restarts after the last committed file and ends byte-identical to an uninterrupted
run; a finished job does nothing when run again.

With ``units`` set, a job writes sentence units instead of packed documents (``units.py``): every sample is one
sentence, paragraph or record of ``seq_len`` (= ``--max-unit-tokens``) tokens, padded, without MAGNET spans, and
with the record's paraphrase as well when ``paraphrase_field`` is given (records are then the units). The
manifest's settings record the mode (``units``), so the trainer can tell unit shards from packed ones.

This module runs the job (the work directory, the worker pool, committing files, the summary); its parts are
``build_config.py`` (the options and the settings they fingerprint), ``build_file.py`` (one input file, in a
worker), ``build_sample.py`` (one sample's masking plan and spans) and ``manifest.py`` (the manifests it writes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.data.format.index import INDEX, job_manifest_name, settings_fingerprint
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.data.prep.build_file import FileResult, WorkerSpec, init_worker, pad_id, process_file
from pipeline.data.prep.build_sample import PlanSettings
from pipeline.data.prep.manifest import (
    add_source_counts,
    ensure_manifest,
    load_job,
    maybe_write_index,
    write_job,
)
from pipeline.data.prep.sources import JSONL_SUFFIXES, InputError, expand_inputs
from pipeline.lock import DirLock, LockHeld
from pipeline.tokenizer import load_tokenizer

PROGRESS_INTERVAL_S = 0.5


@dataclass
class JobSummary:
    job_index: int
    num_jobs: int
    files: int = 0
    documents: int = 0
    samples: int = 0
    tokens: int = 0
    bad_records: int = 0
    shards: int = 0
    elapsed_s: float = 0.0  # after the tokenizer is loaded: what the throughput divides by
    tokenizer_s: float = 0.0  # loading the tokenizer (seconds for a large one), left out of the throughput
    already_complete: bool = False
    index_written: bool = False
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    truncated_units: int | None = None  # unit mode only (pairs mode: texts cut)
    tasks: dict[str, int] | None = None  # pairs mode only: rows per task
    sources: dict[str, dict[str, int]] | None = None  # with sources: {"documents", "samples", "tokens"} of each

    def lines(self) -> list[str]:
        rate = max(self.elapsed_s, 1e-9)
        bad = ", ".join(f"{k} {v}" for k, v in sorted(self.bad_by_reason.items())) or "none"
        truncated = [] if self.truncated_units is None else \
            [f"units cut to --max-unit-tokens: {self.truncated_units} of {self.samples}"]
        if self.tasks is not None:
            tasks = ", ".join(f"{k} {v}" for k, v in sorted(self.tasks.items()))
            truncated = [f"rows per task: {tasks or 'none'}",
                         f"texts cut to --max-text-tokens: {self.truncated_units} of {self.samples} rows' texts"]
        sources = [] if self.sources is None else [
            "sources: " + ", ".join(f"{name} {c['documents']} documents, {c['samples']} samples, {c['tokens']} tokens"
                                    for name, c in sorted(self.sources.items()))]
        return [f"job {self.job_index} of {self.num_jobs}: {self.files} files, {self.documents} documents, "
                f"{self.samples} samples, {self.tokens} tokens, {self.shards} shards",
                f"bad records: {self.bad_records} ({bad})", *truncated, *sources,
                f"elapsed {self.elapsed_s:.1f} s (+ {self.tokenizer_s:.1f} s loading the tokenizer, not counted): "
                f"{self.documents / rate:.0f} docs/s, {self.tokens / rate:.0f} tokens/s"]


# ---------------------------------------------------------------- the job directory


def _work_dir_prefix(cfg: BuildConfig) -> str:
    return f".work-{cfg.job_index:05d}-"


def _remove_stale(cfg: BuildConfig, job: dict) -> None:
    """Remove what a killed run of this job left behind: its work directories, temporary files, and shards renamed
    but not yet recorded (they are rewritten, identically, from the first unrecorded file on)."""
    recorded = {s["name"] for s in job["shards"]}
    recorded |= {n[: -len(".tar")] + ".idx.npy" for n in recorded}
    shard_stem = f"{cfg.prefix}-{cfg.job_index:05d}-"
    job_tmp = job_manifest_name(cfg.job_index) + ".tmp"
    for name in os.listdir(cfg.output):
        path = os.path.join(cfg.output, name)
        if name.startswith(_work_dir_prefix(cfg)):
            shutil.rmtree(path, ignore_errors=True)
        elif (name.startswith(shard_stem) and name not in recorded) or name.startswith(job_tmp):
            os.remove(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- main process


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _pool_worker(parent: int, *state) -> None:
    """A pool worker's start: it ends with the build. A build killed by SIGKILL, which its pool cannot pass on, left
    its workers writing into the killed run's work directory, where a rerun's clean-up (``_remove_stale``) could
    find a file it had not listed, and kept it; on Linux the kernel now kills a worker when the build that started
    it dies (``PR_SET_PDEATHSIG``), and a worker whose build died before that exits at once."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    init_worker(*state)


def _results(tasks: list[tuple[int, str]], spec: WorkerSpec, tok, workers: int, on_wait) -> Iterator[FileResult]:
    """FileResults in file order; ``on_wait`` runs every PROGRESS_INTERVAL_S while waiting for the next one."""
    fork = sys.platform == "linux"
    ctx = mp.get_context("fork" if fork else "spawn")
    docs, tokens = ctx.Value("q", 0), ctx.Value("q", 0)
    if workers == 1 or len(tasks) <= 1:
        init_worker(spec, docs, tokens, tok)
        for task in tasks:
            yield process_file(task)
            on_wait(docs.value, tokens.value)
        return
    with ctx.Pool(min(workers, len(tasks)), _pool_worker, (os.getpid(), spec, docs, tokens, tok if fork else None)
                  ) as pool:
        it = pool.imap(process_file, tasks)
        while True:
            try:
                result = it.next(timeout=PROGRESS_INTERVAL_S)
            except mp.TimeoutError:
                on_wait(docs.value, tokens.value)
                continue
            except StopIteration:
                return
            on_wait(docs.value, tokens.value)
            yield result


def _commit(cfg: BuildConfig, job: dict, result: FileResult) -> None:
    """Give the file's shards their final names and record the file in the job manifest (atomically)."""
    names = []
    for entry in result.shards:
        name = f"{cfg.prefix}-{cfg.job_index:05d}-{len(job['shards']):06d}.tar"
        final = os.path.join(cfg.output, name)
        os.replace(entry["work_path"][: -len(".tar")] + ".idx.npy", final[: -len(".tar")] + ".idx.npy")
        os.replace(entry["work_path"], final)
        job["shards"].append({k: v for k, v in entry.items() if k != "work_path"} | {"name": name})
        names.append(name)
    _fsync_dir(cfg.output)
    job["files"].append({"file_index": result.file_index, "path": result.path, "documents": result.stats.documents,
                         "samples": result.samples, "tokens": result.tokens, "bad_records": result.stats.bad,
                         "shards": names} | ({"truncated_units": result.truncated_units} if cfg.units else {})
                        | ({"truncated_texts": result.truncated_units, "tasks": result.tasks} if cfg.pairs else {})
                        | ({"sources": result.sources} if result.sources is not None else {}))
    write_job(cfg, job)


def _check_bad(cfg: BuildConfig, result: FileResult, committed: int) -> None:
    stats = result.stats
    for example in stats.examples:
        _log(f"warning: {example}")
    if stats.num_bad and stats.bad_fraction > cfg.max_bad_fraction:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(stats.bad.items()))
        raise BuildError(
            f"{result.path}: {stats.num_bad} bad records of {stats.num_bad + stats.documents} "
            f"({stats.bad_fraction:.2%}: {counts}) exceed --max-bad-fraction {cfg.max_bad_fraction}; the "
            f"{committed} files before it are committed. Fix the input (see the warnings above) or raise "
            f"--max-bad-fraction, then re-run this job: it continues with this file")


def run_job(cfg: BuildConfig) -> JobSummary:
    """Build (or finish building) job ``cfg.job_index`` of ``cfg.num_jobs`` into ``cfg.output``."""
    loading = time.monotonic()
    cfg.validate()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the tokenizer exists, so forked workers are safe
    inputs = expand_inputs(cfg.inputs)
    if cfg.pairs and any(not p.endswith(JSONL_SUFFIXES) for p in inputs):
        raise InputError(f"--pairs reads jsonl rows ({', '.join(JSONL_SUFFIXES)}), got "
                         f"{[p for p in inputs if not p.endswith(JSONL_SUFFIXES)][:3]}")
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise BuildError(str(e)) from e
    start = time.monotonic()
    for wanted, token_id, name in ((cfg.bos, tok.bos_id, "bos"), (cfg.eos, tok.eos_id, "eos")):
        if wanted and token_id is None:
            raise BuildError(f"tokenizer {cfg.tokenizer} has no {name.upper()} token; pass --no-{name}")
    settings = _settings(cfg, tok, inputs)
    os.makedirs(cfg.output, exist_ok=True)
    manifest = ensure_manifest(cfg, settings, os.path.abspath(cfg.tokenizer), inputs)
    if load_job(cfg, manifest["fingerprint"])["complete"]:
        return _already_complete(cfg, manifest, start - loading)
    lock = DirLock(os.path.join(cfg.output, f".lock-job-{cfg.job_index:05d}"), f"job {cfg.job_index} of {cfg.output}")
    try:
        lock.acquire()
    except LockHeld as e:  # a second job with this index would delete the first one's work directory
        raise BuildError(f"{e}; each --job-index runs once at a time") from e
    try:
        job = load_job(cfg, manifest["fingerprint"])  # again: the previous holder may have finished meanwhile
        summary = (_already_complete(cfg, manifest, start - loading) if job["complete"] else
                   _build(cfg, tok, inputs, manifest, job, start, start - loading))
    except BaseException:
        lock.release()
        raise
    lock.release(remove=True)  # the job is complete for good: a finished directory holds only shards and manifests
    return summary


def _settings(cfg: BuildConfig, tok, inputs: list[str]) -> dict:
    return cfg.shard_settings(tok.info.as_dict(), pad_id(tok), inputs)


def shard_fingerprint(cfg: BuildConfig, tok) -> str:
    """The fingerprint of the directory :func:`run_job` builds from ``cfg`` (``tok``: its tokenizer, loaded): a
    function of the settings alone, so known before the build (a resume's check of the shards it will read)."""
    return settings_fingerprint(_settings(cfg, tok, expand_inputs(cfg.inputs)))


def _already_complete(cfg: BuildConfig, manifest: dict, tokenizer_s: float) -> JobSummary:
    """A finished job run again writes nothing (but ``index.json`` when it is missing)."""
    summary = JobSummary(cfg.job_index, cfg.num_jobs, tokenizer_s=tokenizer_s)
    summary.already_complete = True
    summary.index_written = maybe_write_index(cfg.output, manifest)
    shards = len(load_job(cfg, manifest["fingerprint"])["shards"])
    _log(f"job {cfg.job_index} of {cfg.num_jobs} is already complete ({shards} shards in {cfg.output}); nothing to do")
    return summary


def _build(cfg: BuildConfig, tok, inputs: list[str], manifest: dict, job: dict, start: float,
           tokenizer_s: float) -> JobSummary:
    """The job, under its lock."""
    summary = JobSummary(cfg.job_index, cfg.num_jobs, tokenizer_s=tokenizer_s)
    _remove_stale(cfg, job)
    # Unique per run: workers orphaned by a killed run may still finish a file, into their own (deleted) directory.
    work_dir = os.path.join(cfg.output, f"{_work_dir_prefix(cfg)}{os.getpid()}")
    os.makedirs(work_dir)
    done = {f["file_index"] for f in job["files"]}
    tasks = [(i, p) for i, p in enumerate(inputs) if i % cfg.num_jobs == cfg.job_index and i not in done]
    _log(f"job {cfg.job_index} of {cfg.num_jobs}: {len(tasks)} files to do"
         + (f" ({len(done)} already done)" if done else ""))
    spans = 0.0 if cfg.units else cfg.span_fraction  # units have no MAGNET spans
    spec = WorkerSpec(cfg.tokenizer, cfg.text_field, cfg.seq_len, cfg.samples_per_shard, cfg.remainder, cfg.bos,
                      cfg.eos, PlanSettings(cfg.seed, np.asarray(tok.special_ids), cfg.span_min, cfg.span_max,
                                            spans), work_dir, cfg.units, cfg.paraphrase_field, cfg.source,
                      cfg.pairs_settings() if cfg.pairs else None)
    summary.truncated_units = 0 if cfg.units or cfg.pairs else None
    summary.tasks = {} if cfg.pairs else None
    summary.sources = {} if cfg.source else None
    bar = _ProgressBar(cfg.progress, len(tasks))
    results = _results(tasks, spec, tok, cfg.workers, bar.show)
    try:
        for result in results:
            _check_bad(cfg, result, len(job["files"]))
            _commit(cfg, job, result)
            summary.files += 1
            summary.documents += result.stats.documents
            summary.samples += result.samples
            summary.tokens += result.tokens
            summary.shards += len(result.shards)
            summary.bad_records += result.stats.num_bad
            if cfg.units or cfg.pairs:
                summary.truncated_units += result.truncated_units
            for name, n in result.tasks.items():
                summary.tasks[name] = summary.tasks.get(name, 0) + n
            if summary.sources is not None:  # pairs record their tasks as sources, and print them as tasks
                add_source_counts(summary.sources, result.sources)
            for reason, n in result.stats.bad.items():
                summary.bad_by_reason[reason] = summary.bad_by_reason.get(reason, 0) + n
            bar.file_done()
    finally:
        results.close()  # stops the worker pool at once when a file fails
        bar.close()
        shutil.rmtree(work_dir, ignore_errors=True)
    job["complete"] = True
    write_job(cfg, job)
    summary.index_written = maybe_write_index(cfg.output, manifest)
    summary.elapsed_s = time.monotonic() - start
    for line in summary.lines():
        _log(line)
    if summary.index_written:
        _log(f"all {cfg.num_jobs} jobs complete: wrote {os.path.join(cfg.output, INDEX)}")
    return summary


class _ProgressBar:
    """tqdm bar over documents with tokens/s and finished files; silent when disabled."""

    def __init__(self, enabled: bool, num_files: int):
        from tqdm import tqdm

        self._bar = tqdm(unit="doc", unit_scale=True, disable=not enabled, file=sys.stderr, dynamic_ncols=True)
        self._start, self._files, self._num_files = time.monotonic(), 0, num_files
        self._docs = self._tokens = 0

    def show(self, docs: int, tokens: int) -> None:
        self._bar.update(docs - self._docs)
        self._docs, self._tokens = docs, tokens
        rate = tokens / max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{rate:,.0f} tok/s, files {self._files}/{self._num_files}", refresh=False)

    def file_done(self) -> None:
        self._files += 1
        self.show(self._docs, self._tokens)

    def close(self) -> None:
        self._bar.close()
