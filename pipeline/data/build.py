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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from pipeline.data.build_sample import PlanSettings, make_sample
from pipeline.data.format import FORMAT_VERSION, MAX_SEQ_LEN
from pipeline.data.manifest import (
    INDEX,
    MANIFEST,
    job_manifest_name,
    read_json,
    settings_fingerprint,
    write_json_atomic,
)
from pipeline.data.packing import REMAINDER_POLICIES, Packer
from pipeline.data.shards import ShardWriter
from pipeline.data.sources import RecordStats, expand_inputs, input_size, read_records
from pipeline.data.units import UNIT_MODES, split_units, unit_sample
from pipeline.lock import DirLock, LockHeld
from pipeline.tokenizer import load_tokenizer

ENCODE_BATCH_DOCS = 512
PROGRESS_INTERVAL_S = 0.5


class BuildError(RuntimeError):
    """A job that must not go on (other settings in the output directory, too many bad records, ...)."""


@dataclass(frozen=True)
class BuildConfig:
    """The options of one job (docs/data_prep.md). All but ``num_jobs``, ``job_index``, ``workers``,
    ``max_bad_fraction`` and ``progress`` determine the shard bytes and are fixed by the directory's manifest."""

    inputs: tuple[str, ...]
    tokenizer: str
    output: str
    seq_len: int = 2048
    seed: int = 0
    text_field: str = "text"
    num_jobs: int = 1
    job_index: int = 0
    workers: int = 1
    prefix: str = "shard"
    samples_per_shard: int = 4096
    bos: bool = True
    eos: bool = True
    remainder: str = "drop"
    span_min: int = 8
    span_max: int = 32
    span_fraction: float = 0.15
    max_bad_fraction: float = 0.01
    progress: bool = True
    units: str = ""  # "": pack documents; "sentence", "paragraph", "record": one unit per sample of seq_len tokens
    paraphrase_field: str = ""  # with units "record": the record field holding the text's paraphrase

    def validate(self) -> None:
        checks = [
            (1 <= self.seq_len <= MAX_SEQ_LEN, f"--seq-len must be in [1, {MAX_SEQ_LEN}], got {self.seq_len}"),
            (0 <= self.seed < 1 << 64, f"--seed must be in [0, 2**64), got {self.seed}"),
            (self.num_jobs >= 1, f"--num-jobs must be >= 1, got {self.num_jobs}"),
            (0 <= self.job_index < self.num_jobs,
             f"--job-index must be in [0, {self.num_jobs}) for --num-jobs {self.num_jobs}, got {self.job_index}"),
            (self.workers >= 1, f"--workers must be >= 1, got {self.workers}"),
            (self.samples_per_shard >= 1, f"--samples-per-shard must be >= 1, got {self.samples_per_shard}"),
            (self.remainder in REMAINDER_POLICIES, f"--remainder must be one of {REMAINDER_POLICIES}"),
            (1 <= self.span_min <= self.span_max, f"need 1 <= --span-min <= --span-max, got "
                                                  f"{self.span_min}..{self.span_max}"),
            (0.0 <= self.span_fraction < 1.0, f"--span-fraction must be in [0, 1), got {self.span_fraction}"),
            (0.0 <= self.max_bad_fraction <= 1.0,
             f"--max-bad-fraction must be in [0, 1], got {self.max_bad_fraction}"),
            (self.prefix and "/" not in self.prefix, f"--prefix must be a plain file name prefix, got {self.prefix!r}"),
            (self.units in ("", *UNIT_MODES), f"--units must be one of {', '.join(UNIT_MODES)}, got {self.units!r}"),
            (not self.paraphrase_field or self.units == "record",
             f"--paraphrase-field needs --units record (each record is one unit, its paraphrase beside it), got "
             f"--units {self.units or '(none: packed)'}"),
            (not self.units or self.seq_len >= 1 + self.bos + self.eos,
             f"--max-unit-tokens {self.seq_len} leaves no room for text between BOS and EOS"),
        ]
        for ok, message in checks:
            if not ok:
                raise BuildError(message)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to turn one input file into shards (picklable)."""

    tokenizer: str
    text_field: str
    seq_len: int
    samples_per_shard: int
    remainder: str
    bos: bool
    eos: bool
    plan: PlanSettings
    work_dir: str
    units: str = ""
    paraphrase_field: str = ""


@dataclass
class FileResult:
    file_index: int
    path: str
    stats: RecordStats
    shards: list[dict]  # ShardWriter.close() entries plus "work_path", the shard's name in the work directory
    samples: int = 0
    tokens: int = 0
    truncated_units: int = 0  # units (or paraphrases) longer than seq_len, cut to fit


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
    truncated_units: int | None = None  # unit mode only

    def lines(self) -> list[str]:
        rate = max(self.elapsed_s, 1e-9)
        bad = ", ".join(f"{k} {v}" for k, v in sorted(self.bad_by_reason.items())) or "none"
        truncated = [] if self.truncated_units is None else \
            [f"units cut to --max-unit-tokens: {self.truncated_units} of {self.samples}"]
        return [f"job {self.job_index} of {self.num_jobs}: {self.files} files, {self.documents} documents, "
                f"{self.samples} samples, {self.tokens} tokens, {self.shards} shards",
                f"bad records: {self.bad_records} ({bad})", *truncated,
                f"elapsed {self.elapsed_s:.1f} s (+ {self.tokenizer_s:.1f} s loading the tokenizer, not counted): "
                f"{self.documents / rate:.0f} docs/s, {self.tokens / rate:.0f} tokens/s"]


# ---------------------------------------------------------------- worker side

_worker: dict = {}


def _init_worker(spec: WorkerSpec, docs_counter, tokens_counter, tokenizer=None) -> None:
    """Per-process state; a forked worker gets the parent's tokenizer, a spawned one loads its own."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(spec=spec, tokenizer=tokenizer or load_tokenizer(spec.tokenizer), docs=docs_counter,
                   tokens=tokens_counter)


def _batches(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def _unit_samples(records: list[tuple[str, ...]], spec: WorkerSpec, tok, result: FileResult
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], int]:
    """(samples (input ids, segments, paraphrase ids or None), tokens read) of the units of ``records``."""
    bos, eos = tok.bos_id if spec.bos else None, tok.eos_id if spec.eos else None
    units = [u for record in records for u in split_units(record[0], spec.units)]
    encoded = tok.encode_batch(units)
    paraphrases = tok.encode_batch([r[1] for r in records]) if spec.paraphrase_field else [None] * len(encoded)
    samples = []
    for ids, paraphrase in zip(encoded, paraphrases):
        input_ids, n, cut = unit_sample(ids, spec.seq_len, _pad_id(tok), bos, eos)
        if paraphrase is not None:
            paraphrase, _, cut_paraphrase = unit_sample(paraphrase, spec.seq_len, _pad_id(tok), bos, eos)
            cut = cut or cut_paraphrase
        result.truncated_units += cut
        samples.append((input_ids, np.array([[0, n]], dtype=np.int32), paraphrase))
    return samples, sum(map(len, encoded)) + (sum(map(len, paraphrases)) if spec.paraphrase_field else 0)


def _process_file(task: tuple[int, str]) -> FileResult:
    """Pack one input file into shards of the work directory (named by file index, renamed by the main process)."""
    file_index, path = task
    spec: WorkerSpec = _worker["spec"]
    tok = _worker["tokenizer"]
    result = FileResult(file_index, path, RecordStats(), [])
    packer = Packer(spec.seq_len, _pad_id(tok), tok.bos_id if spec.bos else None,
                    tok.eos_id if spec.eos else None, spec.remainder)
    writer: ShardWriter | None = None

    def emit(samples: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> None:
        nonlocal writer
        for input_ids, segments, paraphrase in samples:
            if writer is None:
                name = f"f{file_index:06d}-{len(result.shards):06d}.tar"
                writer = ShardWriter(os.path.join(spec.work_dir, name))
            writer.write(make_sample(input_ids, segments, file_index, result.samples, spec.plan, paraphrase))
            result.samples += 1
            if writer.num_samples == spec.samples_per_shard:
                close()

    def close() -> None:
        nonlocal writer
        entry = writer.close()
        result.shards.append({**entry, "work_path": writer.path})
        result.tokens += entry["tokens"]
        writer = None

    fields = (spec.text_field, spec.paraphrase_field) if spec.paraphrase_field else (spec.text_field,)
    for records in _batches(read_records(path, fields, result.stats), ENCODE_BATCH_DOCS):
        if spec.units:
            samples, tokens = _unit_samples(records, spec, tok, result)
            emit(samples)
        else:
            encoded = tok.encode_batch([text for (text,) in records])
            for ids in encoded:
                emit((input_ids, segments, None) for input_ids, segments in packer.add(ids))
            tokens = sum(map(len, encoded))
        with _worker["docs"].get_lock():
            _worker["docs"].value += len(records)
        with _worker["tokens"].get_lock():
            _worker["tokens"].value += tokens
    emit((input_ids, segments, None) for input_ids, segments in packer.finish())
    if writer is not None:
        close()
    return result


# ---------------------------------------------------------------- directory and manifests


def _pad_id(tok) -> int:
    """The id written at padding positions: the tokenizer's PAD, else EOS (Llama has no PAD), else 0. Readers find
    padding through the segments, never through this id."""
    return next(i for i in (tok.pad_id, tok.eos_id, 0) if i is not None)


def _settings(cfg: BuildConfig, tokenizer_info: dict, pad_id: int, inputs: list[str]) -> dict:
    """Everything that determines the shard bytes (fingerprinted; a later job with other settings is refused).
    Unit shards record their mode (and paraphrase field) instead of the packing and span settings they do not use;
    packed shards have no ``units`` key, so their settings (and fingerprints) are those of earlier versions."""
    settings = {
        "tokenizer": tokenizer_info,
        "pad_id": pad_id,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "bos": cfg.bos,
        "eos": cfg.eos,
        "remainder": cfg.remainder,
        "text_field": cfg.text_field,
        "span_min": cfg.span_min,
        "span_max": cfg.span_max,
        "span_fraction": cfg.span_fraction,
        "inputs": [{"path": p, "bytes": input_size(p)} for p in inputs],
        "prefix": cfg.prefix,
        "samples_per_shard": cfg.samples_per_shard,
    }
    if cfg.units:
        for unused in ("remainder", "span_min", "span_max", "span_fraction"):
            del settings[unused]
        settings |= {"units": cfg.units, "paraphrase_field": cfg.paraphrase_field or None}
    return settings


def _describe(value) -> str:
    if isinstance(value, list) and len(value) > 3:
        return f"{len(value)} items [{value[0]!r}, ..., {value[-1]!r}]"
    return repr(value)


def _settings_diff(old: dict, new: dict) -> list[str]:
    return [f"  {key}: directory has {_describe(old.get(key))}, this run has {_describe(new.get(key))}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _ensure_manifest(cfg: BuildConfig, settings: dict, tokenizer_path: str) -> dict:
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


def _load_job(cfg: BuildConfig, fingerprint: str) -> dict:
    path = os.path.join(cfg.output, job_manifest_name(cfg.job_index))
    if not os.path.exists(path):
        return {"format": FORMAT_VERSION, "fingerprint": fingerprint, "job_index": cfg.job_index,
                "num_jobs": cfg.num_jobs, "complete": False, "files": [], "shards": []}
    job = read_json(path, f"delete it and re-run job {cfg.job_index}")
    if job.get("fingerprint") != fingerprint:
        raise BuildError(f"{path} was written with other settings than {MANIFEST}; delete {cfg.output} and rebuild")
    return job


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


def _maybe_write_index(output: str, manifest: dict) -> bool:
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
    path = os.path.join(output, INDEX)
    if not os.path.exists(path) or read_json(path, "delete it; the next prep job rewrites it") != index:
        write_json_atomic(path, index)
    return True


# ---------------------------------------------------------------- main process


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _results(tasks: list[tuple[int, str]], spec: WorkerSpec, tok, workers: int, on_wait) -> Iterator[FileResult]:
    """FileResults in file order; ``on_wait`` runs every PROGRESS_INTERVAL_S while waiting for the next one."""
    fork = sys.platform == "linux"
    ctx = mp.get_context("fork" if fork else "spawn")
    docs, tokens = ctx.Value("q", 0), ctx.Value("q", 0)
    if workers == 1 or len(tasks) <= 1:
        _init_worker(spec, docs, tokens, tok)
        for task in tasks:
            yield _process_file(task)
            on_wait(docs.value, tokens.value)
        return
    with ctx.Pool(min(workers, len(tasks)), _init_worker, (spec, docs, tokens, tok if fork else None)) as pool:
        it = pool.imap(_process_file, tasks)
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
                         "shards": names} | ({"truncated_units": result.truncated_units} if cfg.units else {}))
    write_json_atomic(os.path.join(cfg.output, job_manifest_name(cfg.job_index)), job)


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
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise BuildError(str(e)) from e
    start = time.monotonic()
    for wanted, token_id, name in ((cfg.bos, tok.bos_id, "bos"), (cfg.eos, tok.eos_id, "eos")):
        if wanted and token_id is None:
            raise BuildError(f"tokenizer {cfg.tokenizer} has no {name.upper()} token; pass --no-{name}")
    settings = _settings(cfg, tok.info.as_dict(), _pad_id(tok), inputs)
    os.makedirs(cfg.output, exist_ok=True)
    manifest = _ensure_manifest(cfg, settings, os.path.abspath(cfg.tokenizer))
    if _load_job(cfg, manifest["fingerprint"])["complete"]:
        return _already_complete(cfg, manifest, start - loading)
    lock = DirLock(os.path.join(cfg.output, f".lock-job-{cfg.job_index:05d}"), f"job {cfg.job_index} of {cfg.output}")
    try:
        lock.acquire()
    except LockHeld as e:  # a second job with this index would delete the first one's work directory
        raise BuildError(f"{e}; each --job-index runs once at a time") from e
    try:
        job = _load_job(cfg, manifest["fingerprint"])  # again: the previous holder may have finished meanwhile
        if job["complete"]:
            return _already_complete(cfg, manifest, start - loading)
        return _build(cfg, tok, inputs, manifest, job, start, start - loading)
    finally:
        lock.release()


def _already_complete(cfg: BuildConfig, manifest: dict, tokenizer_s: float) -> JobSummary:
    """A finished job run again writes nothing (but ``index.json`` when it is missing)."""
    summary = JobSummary(cfg.job_index, cfg.num_jobs, tokenizer_s=tokenizer_s)
    summary.already_complete = True
    summary.index_written = _maybe_write_index(cfg.output, manifest)
    shards = len(_load_job(cfg, manifest["fingerprint"])["shards"])
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
                                            spans), work_dir, cfg.units, cfg.paraphrase_field)
    summary.truncated_units = 0 if cfg.units else None
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
            if cfg.units:
                summary.truncated_units += result.truncated_units
            for reason, n in result.stats.bad.items():
                summary.bad_by_reason[reason] = summary.bad_by_reason.get(reason, 0) + n
            bar.file_done()
    finally:
        results.close()  # stops the worker pool at once when a file fails
        bar.close()
        shutil.rmtree(work_dir, ignore_errors=True)
    job["complete"] = True
    write_json_atomic(os.path.join(cfg.output, job_manifest_name(cfg.job_index)), job)
    summary.index_written = _maybe_write_index(cfg.output, manifest)
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
