"""Everything about an experiment that can be checked before DeepSpeed builds an engine: the run directory (writable,
not in use), the tokenizer, objectives against it, the start model, the shards (present, compatible, sizes, enough
samples), and a resume's global batch. Every rank runs it; the caller reports the first error once, from rank 0."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field

from pipeline.config import ConfigError
from pipeline.data.loader import check_compatible, check_shard_sizes, check_source
from pipeline.data.manifest import MANIFEST, DatasetIndex, load_index
from pipeline.lock import DirLock, describe
from pipeline.model.build import check_checkpoint_shape, start_checkpoint_config
from pipeline.model.presets import PRESETS
from pipeline.run_dir import RunDir
from pipeline.tokenizer import load_tokenizer
from pipeline.train import errors
from pipeline.train.experiment import ExperimentConfig
from pipeline.train.phases import WeightedObjective, build_objectives, data_sources


@dataclass
class Prepared:
    tokenizer: object
    objectives: list[list[WeightedObjective]]
    lock: DirLock | None = None  # held by rank 0 for the run's life
    notes: list[str] = field(default_factory=list)  # for rank 0 to print


def check_run_dir(run_dir: str) -> None:
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir: {run_dir} is not writable ({e.strerror}); set run_dir to a directory this "
                          f"user can write (--set run_dir=...)") from None


def lock_run_dir(run_dir: str) -> tuple[DirLock, list[str]]:
    lock = DirLock(RunDir(run_dir).lock, f"run directory {run_dir}").acquire()
    notes = []
    if lock.stale:
        notes.append(f"note: took over the lock of {run_dir} from a run that ended without releasing it: "
                     f"{describe(lock.stale)}")
    return lock, notes


def _check_shards(directory: str, setting: str, tokenizer, seq_len: int | None, source: str, readers: list[str],
                  global_batch: int) -> DatasetIndex:
    index = load_index(directory)
    check_compatible(index, tokenizer.info.fingerprint, index.seq_len if seq_len is None else seq_len)
    if readers:
        check_source(index, source, setting, readers)
    check_shard_sizes(index)
    if index.num_samples < global_batch:
        raise ConfigError(f"{setting}: {index.directory} holds {index.num_samples} samples, fewer than one global "
                          f"batch of {global_batch}; use a smaller batch or build more data")
    return index


def _check_model(exp: ExperimentConfig, tokenizer) -> None:
    """The start model: a preset, or a checkpoint directory that fits the tokenizer (and ``model.shape``)."""
    try:
        if exp.model.shape:
            check_checkpoint_shape(exp.model.init, exp.model.shape)
        if exp.model.init not in PRESETS:
            info = tokenizer.info
            start_checkpoint_config(exp.model.init, info.vocab_size, bos_token_id=info.bos_id, eos_token_id=info.eos_id)
    except ValueError as e:
        raise ConfigError(f"model.init: {e}") from None


def check_resume_batch(exp: ExperimentConfig, world: int) -> None:
    """A resume that changes the global batch changes the optimisation: refused unless asked for."""
    run = RunDir(exp.run_dir)
    step = run.latest_complete() if exp.checkpoint.resume else None
    if step is None or exp.checkpoint.allow_global_batch_change:
        return
    path = run.checkpoint(step)
    saved_train = run.checkpoint_experiment(step).train
    saved_world = run.checkpoint_world_size(step)
    saved = saved_train.micro_batch * saved_train.grad_accum * saved_world
    t = exp.train
    now = t.micro_batch * t.grad_accum * world
    if saved != now:
        keep = saved // (t.micro_batch * world) if saved % (t.micro_batch * world) == 0 else None
        fix = f"set train.grad_accum={keep} to keep it, or " if keep else ""
        raise ConfigError(f"checkpoint.allow_global_batch_change: {path} was trained with a global batch of {saved} "
                          f"(micro_batch {saved_train.micro_batch} x grad_accum {saved_train.grad_accum} x "
                          f"{saved_world} ranks), this run has {now} (micro_batch {t.micro_batch} x grad_accum "
                          f"{t.grad_accum} x {world} ranks); {fix}set checkpoint.allow_global_batch_change=true "
                          f"to resume with the new batch")


def preflight(exp: ExperimentConfig, rank: int, world: int) -> Prepared:
    check_run_dir(exp.run_dir)
    lock, notes = lock_run_dir(exp.run_dir) if rank == 0 else (None, [])
    try:
        tokenizer = load_tokenizer(exp.data.tokenizer)
        objectives = [build_objectives(p, tokenizer, f"phases[{i}]") for i, p in enumerate(exp.phases)]
        _check_model(exp, tokenizer)
        readers = data_sources(objectives)
        t, d = exp.train, exp.data
        if os.path.exists(os.path.join(d.shards, MANIFEST)):
            _check_shards(d.shards, "data.shards", tokenizer, d.seq_len, "packed", readers["packed"],
                          t.micro_batch * t.grad_accum * world)
        elif not d.build_if_missing:
            raise ConfigError(f"data.shards: {d.shards} is not a shard directory; build it with "
                              f"data_prep/build_shards.py or set data.build_if_missing=true with data.build_inputs")
        if readers["units"]:
            if not d.unit_shards:
                raise ConfigError("data.unit_shards: an objective reads sentence units (e.g. simcse, sscl) but "
                                  "data.unit_shards is empty; build them with data_prep/build_shards.py --units and "
                                  "set data.unit_shards")
            _check_shards(d.unit_shards, "data.unit_shards", tokenizer, None, "units", readers["units"],
                          (d.unit_micro_batch or t.micro_batch) * t.grad_accum * world)
        check_resume_batch(exp, world)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Prepared(tokenizer, objectives, lock, notes)


def agreed_preflight(exp: ExperimentConfig, rank: int, world: int) -> Prepared | None:
    """Run :func:`preflight` on every rank; when any rank fails, rank 0 prints the first failure once and every
    rank returns None."""
    import torch.distributed as dist

    prepared, failure = None, None
    try:
        prepared = preflight(exp, rank, world)
    except Exception as e:  # noqa: BLE001 - reported below, once
        kind = "config error" if isinstance(e, ConfigError) else "error"
        failure = (kind, errors.one_line(e))
    failures: list = [None] * world
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return prepared
    if rank == 0:
        print(f"{first[0]}: {first[1]}", file=sys.stderr, flush=True)
    if prepared is not None and prepared.lock is not None:
        prepared.lock.release()
    return None
