"""One input file -> its shards, in a worker process of a shard-building job (``build.py`` runs the job).

A worker packs (or splits into units) the file's records, gives every sample its masking plan and spans
(``build_sample.py``) and writes the shards into the job's private work directory, named by file index; the main
process renames them to their final names when it commits the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from pipeline.data.build_sample import PlanSettings, make_sample
from pipeline.data.format import Sample
from pipeline.data.packing import Packer
from pipeline.data.pairs import PairsSettings, default_task, pair_samples, parse_row
from pipeline.data.sources import RecordStats, read_objects, read_records
from pipeline.data.tar_shard import ShardWriter
from pipeline.data.units import split_units, unit_sample
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
    pairs: PairsSettings | None = None


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
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], int]:
    """(samples (input ids, segments, paraphrase ids or None), tokens read) of the units of ``records``."""
    bos, eos = tok.bos_id if spec.bos else None, tok.eos_id if spec.eos else None
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
    return samples, sum(map(len, encoded)) + (sum(map(len, paraphrases)) if spec.paraphrase_field else 0)


def _count(records: int, tokens: int) -> None:
    """Progress for the main process's bar."""
    with _worker["docs"].get_lock():
        _worker["docs"].value += records
    with _worker["tokens"].get_lock():
        _worker["tokens"].value += tokens


def _pairs_file(path: str, spec: WorkerSpec, tok, result: FileResult, emit) -> None:
    """The (query, positive, negatives) rows of one jsonl file as pairs samples (``pairs.py``)."""
    task = default_task(path)
    objects = enumerate(read_objects(path, result.stats))
    for chunk in _batches(objects, ENCODE_BATCH_DOCS):
        rows = [parse_row(where, record, i, task, spec.pairs, result.stats) for i, (where, _, record) in chunk]
        rows = [r for r in rows if r is not None]
        samples, tokens, cut, tasks = pair_samples(rows, spec.pairs, tok, spec.bos, spec.eos, pad_id(tok),
                                                   result.file_index, result.samples, result.stats)
        emit(samples)
        result.truncated_units += cut
        for name, n in tasks.items():
            result.tasks[name] = result.tasks.get(name, 0) + n
        _count(len(chunk), tokens)


def process_file(task: tuple[int, str]) -> FileResult:
    """Pack one input file into shards of the work directory (named by file index, renamed by the main process)."""
    file_index, path = task
    spec: WorkerSpec = _worker["spec"]
    tok = _worker["tokenizer"]
    result = FileResult(file_index, path, RecordStats(), [])
    packer = Packer(spec.seq_len, pad_id(tok), tok.bos_id if spec.bos else None,
                    tok.eos_id if spec.eos else None, spec.remainder)
    writer: ShardWriter | None = None

    def emit(samples: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None] | Sample]) -> None:
        nonlocal writer
        for sample in samples:
            if writer is None:
                name = f"f{file_index:06d}-{len(result.shards):06d}.tar"
                writer = ShardWriter(os.path.join(spec.work_dir, name))
            writer.write(sample if isinstance(sample, Sample) else
                         make_sample(*sample[:2], file_index, result.samples, spec.plan, sample[2]))
            result.samples += 1
            if writer.num_samples == spec.samples_per_shard:
                close()

    def close() -> None:
        nonlocal writer
        entry = writer.close()
        result.shards.append({**entry, "work_path": writer.path})
        result.tokens += entry["tokens"]
        writer = None

    if spec.pairs is not None:
        _pairs_file(path, spec, tok, result, emit)
        if writer is not None:
            close()
        return result
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
        _count(len(records), tokens)
    emit((input_ids, segments, None) for input_ids, segments in packer.finish())
    if writer is not None:
        close()
    return result
