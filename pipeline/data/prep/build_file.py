"""One input file -> its shards, in a worker process of a shard-building job (``build.py`` runs the job).

A worker packs (or splits into units) the file's records, gives every sample its masking plan and spans
(``build_sample.py``) and writes the shards into the job's private work directory, named by file index; the main
process renames them to their final names when it commits the file.

With sources (``WorkerSpec.source``), each source of the file is packed in its own stream into its own shards, so
every sample, and every document piece in it, has one source: its shard's, which the shard's manifest entry
records. Samples are numbered in the order the streams emit them (one count over the file's sources), so the keys
of one file stay 0..n-1, each source's shards holding an increasing subsequence of them. Pairs mode
(``WorkerSpec.pairs``) writes each row's sample in the stream of its task: a pairs shard's source is its rows' task.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from pipeline.data.format.sample import Sample
from pipeline.data.format.tar_shard import ShardWriter
from pipeline.data.format.units import split_units
from pipeline.data.prep.build_sample import PlanSettings, make_sample
from pipeline.data.prep.packing import Packer
from pipeline.data.prep.pairs import PairsSettings, default_task, pair_samples, parse_row
from pipeline.data.prep.sources import RecordStats, SourceField, read_objects, read_records
from pipeline.data.prep.units import unit_sample
from pipeline.tokenizer import load_tokenizer

ENCODE_BATCH_DOCS = 512


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
    source: SourceField | None = None  # where records name their source; None: one stream, no sources recorded
    pairs: PairsSettings | None = None  # pairs mode (a stream per task: BuildConfig refuses sources with it)


@dataclass
class FileResult:
    file_index: int
    path: str
    stats: RecordStats
    shards: list[dict]  # ShardWriter.close() entries plus "work_path", the shard's name in the work directory
    samples: int = 0
    tokens: int = 0
    truncated_units: int = 0  # units (or paraphrases; pairs: texts) longer than seq_len, cut to fit
    tasks: dict = field(default_factory=dict)  # pairs mode: rows per task
    # with sources: per source name, its {"documents", "samples", "tokens"} in this file
    sources: dict[str, dict[str, int]] | None = None


def pad_id(tok) -> int:
    """The id written at padding positions: the tokenizer's PAD, else EOS (Llama has no PAD), else 0. Readers find
    padding through the segments, never through this id."""
    return next(i for i in (tok.pad_id, tok.eos_id, 0) if i is not None)


_worker: dict = {}


def init_worker(spec: WorkerSpec, docs_counter, tokens_counter, tokenizer=None) -> None:
    """Per-process state; a forked worker gets the parent's tokenizer, a spawned one loads its own."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(spec=spec, tokenizer=tokenizer or load_tokenizer(spec.tokenizer), docs=docs_counter,
                   tokens=tokens_counter)


def _batches(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def _unit_samples(records: list[tuple[str, ...]], spec: WorkerSpec, tok, result: FileResult
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], list[int], int]:
    """(samples (input ids, segments, paraphrase ids or None), the record each came from, tokens read) of the
    units of ``records``."""
    bos, eos = tok.bos_id if spec.bos else None, tok.eos_id if spec.eos else None
    owners = [i for i, record in enumerate(records) for _ in split_units(record[0], spec.units)]
    units = [u for record in records for u in split_units(record[0], spec.units)]
    encoded = tok.encode_batch(units)
    paraphrases = tok.encode_batch([r[1] for r in records]) if spec.paraphrase_field else [None] * len(encoded)
    samples = []
    for ids, paraphrase in zip(encoded, paraphrases):
        input_ids, n, cut = unit_sample(ids, spec.seq_len, pad_id(tok), bos, eos)
        if paraphrase is not None:
            paraphrase, _, cut_paraphrase = unit_sample(paraphrase, spec.seq_len, pad_id(tok), bos, eos)
            cut = cut or cut_paraphrase
        result.truncated_units += cut
        samples.append((input_ids, np.array([[0, n]], dtype=np.int32), paraphrase))
    return samples, owners, sum(map(len, encoded)) + (sum(map(len, paraphrases)) if spec.paraphrase_field else 0)


@dataclass
class _Stream:
    """One source's packer and its open shard (None between shards)."""

    packer: Packer
    writer: ShardWriter | None = None


def _count(records: int, tokens: int) -> None:
    """Progress for the main process's bar."""
    with _worker["docs"].get_lock():
        _worker["docs"].value += records
    with _worker["tokens"].get_lock():
        _worker["tokens"].value += tokens


def _pairs_file(path: str, spec: WorkerSpec, tok, result: FileResult, emit) -> None:
    """The (query, positive, negatives) rows of one jsonl file as pairs samples (``pairs.py``), each emitted to
    its task's stream."""
    task = default_task(path)
    objects = enumerate(read_objects(path, result.stats))
    for chunk in _batches(objects, ENCODE_BATCH_DOCS):
        rows = [parse_row(where, record, i, task, spec.pairs, result.stats) for i, (where, _, record) in chunk]
        rows = [r for r in rows if r is not None]
        samples, tokens, cut, tasks = pair_samples(rows, spec.pairs, tok, spec.bos, spec.eos, pad_id(tok),
                                                   result.file_index, result.samples, result.stats)
        for sample, name in zip(samples, tasks):
            emit(name, [sample])
            result.sources[name]["documents"] += 1
            result.tasks[name] = result.tasks.get(name, 0) + 1
        result.truncated_units += cut
        _count(len(chunk), tokens)


def process_file(task: tuple[int, str]) -> FileResult:
    """Pack one input file into shards of the work directory (named by file index, renamed by the main process):
    one stream of samples, or one per source with ``spec.source``."""
    file_index, path = task
    spec: WorkerSpec = _worker["spec"]
    tok = _worker["tokenizer"]
    result = FileResult(file_index, path, RecordStats(), [], sources={} if spec.source or spec.pairs else None)
    streams: dict[str, _Stream] = {}  # by source name ("" without sources)
    opened = 0  # shards opened so far: their names in the work directory

    def stream(source: str) -> _Stream:
        if source not in streams:
            streams[source] = _Stream(Packer(spec.seq_len, pad_id(tok), tok.bos_id if spec.bos else None,
                                             tok.eos_id if spec.eos else None, spec.remainder))
            if result.sources is not None:
                result.sources[source] = {"documents": 0, "samples": 0, "tokens": 0}
        return streams[source]

    def emit(source: str, samples: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None] | Sample]) -> None:
        """Write ``samples`` (packed or unit: (input ids, segments, paraphrase ids or None); pairs: whole Samples)
        to the open shard of ``source``'s stream."""
        nonlocal opened
        s = stream(source)
        for sample in samples:
            if s.writer is None:
                s.writer = ShardWriter(os.path.join(spec.work_dir, f"f{file_index:06d}-{opened:06d}.tar"))
                opened += 1
            s.writer.write(sample if isinstance(sample, Sample) else
                           make_sample(*sample[:2], file_index, result.samples, spec.plan, sample[2]))
            result.samples += 1
            if s.writer.num_samples == spec.samples_per_shard:
                close(source)

    def close(source: str) -> None:
        s = streams[source]
        entry = s.writer.close() | ({"source": source} if result.sources is not None else {})
        result.shards.append({**entry, "work_path": s.writer.path})
        result.tokens += entry["tokens"]
        if result.sources is not None:
            result.sources[source]["samples"] += entry["samples"]
            result.sources[source]["tokens"] += entry["tokens"]
        s.writer = None

    def finish() -> FileResult:
        for source in sorted(streams):  # the remainders, then the open shards, in a fixed order
            emit(source, ((input_ids, segments, None) for input_ids, segments in streams[source].packer.finish()))
        for source in sorted(streams):
            if streams[source].writer is not None:
                close(source)
        return result

    if spec.pairs is not None:  # a stream per task: a pairs shard's source is its rows' task
        _pairs_file(path, spec, tok, result, emit)
        return finish()
    fields = (spec.text_field, spec.paraphrase_field) if spec.paraphrase_field else (spec.text_field,)
    for records in _batches(read_records(path, fields, result.stats, spec.source), ENCODE_BATCH_DOCS):
        sources = [r[-1] for r in records] if spec.source else [""] * len(records)
        for source in sources:
            stream(source)
            if result.sources is not None:
                result.sources[source]["documents"] += 1
        if spec.units:
            samples, owners, tokens = _unit_samples(records, spec, tok, result)
            for sample, owner in zip(samples, owners):
                emit(sources[owner], [sample])
        else:
            encoded = tok.encode_batch([r[0] for r in records])
            for ids, source in zip(encoded, sources):
                emit(source, ((input_ids, segments, None) for input_ids, segments in stream(source).packer.add(ids)))
            tokens = sum(map(len, encoded))
        _count(len(records), tokens)
    return finish()
