"""The deterministic shard loader: a rank's micro-batches in the global order of ``order.py``, read by random
access through the shards' ``.idx.npy`` sidecars, with a world-size independent state for exact resume.

Workers split a rank's micro-batch sequence round-robin (worker w makes micro-batches w, w+W, ...), which is the
order in which torch's DataLoader collects them, so the stream does not depend on the number of workers.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data.format.index import DatasetIndex, verify_shard_hash
from pipeline.data.format.sample import UNMASKABLE, Sample
from pipeline.data.format.tar_shard import ShardCorrupt, ShardReader
from pipeline.data.loading.batch import Batch, collate
from pipeline.data.loading.holdout import Holdout
from pipeline.data.loading.mixture import MixturePlan
from pipeline.data.loading.order import BatchWarmup, EvalOrder, MixtureOrder, SameTaskOrder, TrainOrder

STATE_KEYS = ("fingerprint", "seed", "epoch", "samples_in_epoch", "samples_consumed", "global_batch")


class _SampleReader:
    """Global sample id -> Sample. Keeps at most ``max_open`` shard readers (index + file handle), least recently
    used first out, so a corpus of many thousand shards stays within file-descriptor limits. With ``verify`` each
    shard's sha256 is checked when this process first opens it, and every sample's token ids against the
    tokenizer's vocabulary; every sample is validated whatever ``verify`` says. A shard of a directory at a URL is
    read from the local cache its ``index.store`` downloads it into, where it was hashed on the way in. Batches of a
    directory with several sources carry each row's source id (its position in ``index.sources``)."""

    def __init__(self, index: DatasetIndex, max_open: int, verify: bool = True):
        self.index = index
        self.starts = np.cumsum([0] + [s.samples for s in index.shards])
        names = index.sources
        self.shard_source = np.array([names.index(s.source) for s in index.shards], dtype=np.int64) \
            if len(names) > 1 else None
        self.max_open = max_open
        self.verify = verify
        self.vocab_size = index.tokenizer.get("vocab_size")
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._hashed: set[int] = set()

    def _reader(self, shard: int) -> ShardReader:
        reader = self._open.pop(shard, None)
        if reader is None:
            info = self.index.shards[shard]
            if self.index.store is not None:
                reader = self.index.store.open(info, self.index.fingerprint, self.verify)
            else:
                if self.verify and shard not in self._hashed:
                    verify_shard_hash(info)
                    self._hashed.add(shard)
                reader = ShardReader(info.path)
            if len(reader) != info.samples:
                raise ValueError(f"{reader.path}: its index holds {len(reader)} samples, the job manifest says "
                                 f"{info.samples}; check it with data_prep/inspect_shards.py and rebuild the shard")
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)[1].close()
        self._open[shard] = reader
        return reader

    def read(self, sample_id: int) -> Sample:
        shard = int(np.searchsorted(self.starts, sample_id, side="right")) - 1
        reader = self._reader(shard)
        sample = reader[sample_id - int(self.starts[shard])]
        try:  # every sample (~5 % of its decoding): a shard's sha256 proves its bytes, not that they are samples
            sample.validate(self.index.seq_len)
        except ValueError as e:
            raise ValueError(f"{reader.path}: {e}; check it with data_prep/inspect_shards.py and rebuild "
                             f"the shard") from e
        if self.verify and self.vocab_size:
            self._check_ids(sample, reader.path, sample_id - int(self.starts[shard]))
        return sample

    def _check_ids(self, sample: Sample, path: str, i: int) -> None:
        for name in ("input_ids", "paraphrase"):
            ids = getattr(sample, name)
            if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
                raise ShardCorrupt(f"{path}: sample {i} (key {sample.key}) has token id {bad} in {name}, outside "
                                   f"the tokenizer's vocabulary of {self.vocab_size} (written with another tokenizer than its "
                                   f"manifest records?); rebuild the shards with data_prep/build_shards.py and the "
                                   f"experiment's tokenizer")

    def filler(self) -> Sample:
        """A row of pure padding (key ""): no document, never a target, attends only to itself."""
        seq_len, pad_id = self.index.seq_len, self.index.tokenizer.get("pad_id") or 0
        none = np.zeros((0, 2), np.int32)
        return Sample("", np.full(seq_len, pad_id, np.int32), none, np.full(seq_len, UNMASKABLE, np.uint16),
                      np.zeros(seq_len, np.uint32), none)

    def batch(self, sample_ids: np.ndarray) -> Batch:
        """Id -1 stands for a padding row (source id -1)."""
        batch = collate([self.read(int(i)) if i >= 0 else self.filler() for i in sample_ids])
        if self.shard_source is not None:
            shard = np.searchsorted(self.starts, sample_ids, side="right") - 1
            batch.source_ids = torch.from_numpy(np.where(np.asarray(sample_ids) >= 0, self.shard_source[shard], -1))
        return batch

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open.clear()


class _MicroBatches(IterableDataset):
    """The micro-batches of a sample order; DataLoader worker w of W makes every W-th one, starting at w."""

    def __init__(self, index: DatasetIndex, order: TrainOrder | EvalOrder, max_open_shards: int, verify: bool):
        self.index, self.order, self.max_open_shards, self.verify = index, order, max_open_shards, verify

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        total = self.order.num_batches
        js = itertools.count(worker, workers) if total is None else range(worker, total, workers)
        reader = _SampleReader(self.index, self.max_open_shards, self.verify)
        try:
            for j in js:
                yield reader.batch(self.order.sample_ids(j))
        finally:
            reader.close()


def _as_is(batch: Batch) -> Batch:
    """DataLoader's collate_fn: batches are made in the workers, and default_convert would only cost time."""
    return batch


def _data_loader(dataset: _MicroBatches, num_workers: int, pin_memory: bool, prefetch_factor: int) -> DataLoader:
    # Its own generator: without one, starting an iterator draws a seed from torch's global RNG, and a resumed run
    # starts its iterator later than the run it continues, which would shift dropout (SimCSE/SSCL) after a resume.
    return DataLoader(dataset, batch_size=None, collate_fn=_as_is, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch_factor if num_workers else None,
                      generator=torch.Generator().manual_seed(0))


class ShardLoader:
    """A rank's endless stream of micro-batches over the epochs of a shard directory.

    Iterate it for micro-batches, or call :meth:`next_global_step` for the ``grad_accum`` micro-batches of one
    optimizer step (fewer while ``warmup``, :class:`~pipeline.data.loading.order.BatchWarmup`, grows the global batch). :meth:`state_dict` counts what was handed out, not what workers prefetched, rounded down to
    whole optimizer steps (model and optimizer only change at step boundaries, so a resume replays the micro-batches
    of an unfinished step). The state is global (the next step, its epoch and position), so it loads into a
    loader with another ``dp_world``, ``micro_batch``, ``grad_accum`` or ``num_workers``; a resume inside a warmup
    needs the same warmup. ``verify`` checks each shard's sha256 when a process first opens it and every sample's token ids
    (its cost: BENCHMARKS.md). ``num_samples``: train on the first ones only (default all), the rest being held
    out for validation; a function of the index alone, so the held-out samples are the same on any world size.
    ``mixture``: target ratios of the index's sources (``pipeline.data.loading.mixture``) instead of one permutation of all
    samples; the state records it, and a resume with another mixture is refused. ``plan``: its plan when the caller
    built it already over these training samples with this seed (the trainer passes preflight's), else built here. ``holdout`` (instead of
    ``num_samples``): ``eval.holdout``'s split (``pipeline.data.loading.holdout``), training on its training samples only:
    the first ones of a directory of one source (as ``num_samples``), each source's first ones of several; the
    state then records each source's held-out count, and a resume with another split is refused. The directory
    must hold one global batch of training samples: the caller checks that once
    (:func:`~pipeline.data.format.index.check_enough_samples`, the trainer's preflight). ``same_task`` (with a
    ``mixture`` of the tasks of pairs shards, ``data.pair_batching: same_task``): every global batch from one of its
    sources (:class:`~pipeline.data.loading.order.SameTaskOrder`); the state records it, and a resume without it, or
    with another global batch (which would cut each task's rows otherwise), is refused.
    """

    def __init__(self, index: DatasetIndex, micro_batch: int, grad_accum: int = 1, dp_rank: int = 0,
                 dp_world: int = 1, seed: int = 0, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2, max_open_shards: int = 64, verify: bool = True,
                 num_samples: int | None = None, mixture: dict[str, float] | None = None,
                 holdout: Holdout | None = None, warmup: BatchWarmup | None = None, plan: MixturePlan | None = None,
                 same_task: bool = False):
        if micro_batch < 1 or grad_accum < 1 or dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ValueError(f"need micro_batch >= 1, grad_accum >= 1 and 0 <= dp_rank < dp_world, got "
                             f"micro_batch={micro_batch} grad_accum={grad_accum} dp_rank={dp_rank} dp_world={dp_world}")
        if warmup is not None and (warmup.full != grad_accum * dp_world or warmup.granule % dp_world):
            raise ValueError(f"a batch warmup of {warmup.full} global micro-batches in granules of {warmup.granule} "
                             f"does not fit grad_accum {grad_accum} x dp_world {dp_world}: it needs full = "
                             f"grad_accum x dp_world and a granule that is a multiple of dp_world")
        if same_task and not mixture:
            raise ValueError("same_task batches need a mixture of the sources (tasks) to draw each batch from")
        if seed < 0 or num_workers < 0:
            raise ValueError(f"seed and num_workers must be >= 0, got seed={seed} num_workers={num_workers}")
        self.index = index
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.prefetch_factor, self.max_open_shards, self.verify = prefetch_factor, max_open_shards, verify
        if holdout is not None and num_samples is not None:
            raise ValueError("pass num_samples or holdout, not both: a holdout says which samples train")
        limit = holdout.limit if holdout is not None else num_samples
        num_samples = (index.num_samples if num_samples is None else num_samples) if holdout is None \
            else holdout.train_count
        spread = holdout is not None and not holdout.prefix  # training samples of several sources, not a prefix
        self._held_out = dict(holdout.held_counts) if spread else None
        self.mixture = dict(sorted(mixture.items())) if mixture else None
        self.same_task = same_task
        if self.mixture:
            kind = SameTaskOrder if same_task else MixtureOrder
            self._order = kind(num_samples, seed, micro_batch, grad_accum, dp_rank, dp_world, warmup=warmup,
                               plan=plan or MixturePlan.build(index, self.mixture, seed, limit))
        else:
            self._order = TrainOrder(num_samples, seed, micro_batch, grad_accum, dp_rank, dp_world,
                                     ids=holdout.train if spread else None, warmup=warmup)
        self._samples_consumed_at_start = 0
        self._micro_consumed = 0  # micro-batches handed out since the order's first_step
        self._iterator: Iterator[Batch] | None = None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks (once a batch warmup is over)."""
        return self._order.global_batch

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches (optimizer steps) per epoch; the epoch's last ``num_samples % global_batch`` are
        dropped."""
        return self._order.steps_per_epoch

    @property
    def _next_step(self) -> int:
        """The optimizer step of the next micro-batch handed out (the first whole step not yet handed out)."""
        return self._order.locate(self._micro_consumed)[0].step

    @property
    def epoch(self) -> int:
        """The epoch of the next optimizer step."""
        return self._order.place(self._next_step).epoch

    def _next(self) -> Batch:
        if self._iterator is None:
            dataset = _MicroBatches(self.index, self._order, self.max_open_shards, self.verify)
            self._iterator = iter(_data_loader(dataset, self.num_workers, self.pin_memory, self.prefetch_factor))
        batch = next(self._iterator)
        self._micro_consumed += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self._next()

    def next_global_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step: ``grad_accum`` of them, or fewer during a warmup."""
        place, taken = self._order.locate(self._micro_consumed)
        if taken:
            raise RuntimeError(f"next_global_step() called after {taken} micro-batches of a step were taken by "
                               f"iteration; use one way of consuming")
        return [self._next() for _ in range(self._order.micro_steps(place.step))]

    def _warmup_state(self) -> dict | None:
        """The warmup as the state records it (its granule in samples), or None without one."""
        w = self._order.warmup
        return None if w is None else {"start": w.start, "steps": w.steps,
                                       "multiple": w.granule * self._order.micro_batch}

    def state_dict(self) -> dict:
        place = self._order.place(self._next_step)
        return {"fingerprint": self.index.fingerprint, "seed": self._order.seed, "step": place.step,
                "epoch": place.epoch, "samples_in_epoch": place.offset,
                "samples_consumed": self._samples_consumed_at_start + place.first_micro * self._order.micro_batch
                * self._order.dp_world,
                "global_batch": self.global_batch, "num_samples": self._order.num_samples,
                **({"batch_warmup": self._warmup_state()} if self._order.warmup else {}),
                **({"mixture": self.mixture} if self.mixture else {}),
                **({"batching": "same_task"} if self.same_task else {}),
                **({"held_out": self._held_out} if self._held_out else {})}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the global sample where ``state`` stopped; drops any running workers."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"not a ShardLoader state: missing {missing}; pass the dict ShardLoader.state_dict() made")
        if state["fingerprint"] != self.index.fingerprint:
            raise ValueError(f"the loader state is for shards with fingerprint {state['fingerprint']}, but "
                             f"{self.index.directory} has {self.index.fingerprint}; resume on the shard directory "
                             f"the run was trained on, or start a new run")
        if state["seed"] != self._order.seed:
            raise ValueError(f"the loader state was saved with seed {state['seed']}, this loader has seed "
                             f"{self._order.seed}; resume with the run's seed, or start a new run")
        trained_on = state.get("num_samples", self._order.num_samples)  # states saved before holdouts lack it
        if trained_on != self._order.num_samples:
            raise ValueError(f"the loader state was saved training on {trained_on} samples of "
                             f"{self.index.directory}, this loader trains on {self._order.num_samples} (another "
                             f"eval.holdout?); resume with the run's holdout, or start a new run")
        if state.get("held_out") != self._held_out:
            def held(counts: dict | None) -> str:
                return f"the last samples of each source ({counts})" if counts else "the directory's last samples"
            raise ValueError(f"the loader state was saved holding out {held(state.get('held_out'))} of "
                             f"{self.index.directory}, this loader holds out {held(self._held_out)} (another "
                             f"eval.holdout, or a state from before held-out samples were taken per source?); resume "
                             f"with the run's holdout, or start a new run")
        if state.get("mixture") != self.mixture:
            raise ValueError(f"the loader state was saved training on data.mixture {state.get('mixture') or '(none)'}, "
                             f"this loader has {self.mixture or '(none)'}; resume with the run's data.mixture, or "
                             f"start a new run")
        batching = "same_task" if self.same_task else "mixed"
        if state.get("batching", "mixed") != batching:
            raise ValueError(f"the loader state was saved with data.pair_batching {state.get('batching', 'mixed')}, "
                             f"this loader has {batching}; resume with the run's data.pair_batching, or start a new "
                             f"run")
        # states saved before the step was recorded come from runs without a warmup: whole saved batches
        saved = state["global_batch"]
        if self.same_task and saved != self.global_batch:
            raise ValueError(f"the loader state was saved with same-task global batches of {saved} rows, this "
                             f"loader's are {self.global_batch}: each task's rows would be cut otherwise; resume with "
                             f"the run's micro_batch x grad_accum x ranks, or start a new run")
        step = state.get("step", state["epoch"] * (self._order.epoch_length // saved) + state["samples_in_epoch"] // saved)
        warmup = self._warmup_state()
        if state.get("batch_warmup") != warmup and step < max(w["steps"] for w in (state.get("batch_warmup"), warmup)
                                                               if w):
            raise ValueError(f"the loader state was saved at step {step} of the batch warmup "
                             f"{state.get('batch_warmup') or '(none)'}, this loader warms up with {warmup or '(none)'}; "
                             f"resume with the run's train.batch_warmup (and its multiple), or start a new run")
        self.close()
        self._order = dataclasses.replace(self._order, first_step=step, first_epoch=state["epoch"],
                                          first_offset=state["samples_in_epoch"])
        self._samples_consumed_at_start = state["samples_consumed"]
        self._micro_consumed = 0

    def close(self) -> None:
        """Stop the workers (they restart on the next batch)."""
        self._iterator = None


def iter_eval(index: DatasetIndex, micro_batch: int, dp_rank: int = 0, dp_world: int = 1, num_workers: int = 0,
              max_open_shards: int = 64, verify: bool = True, first: int = 0,
              count: int | None = None, ids: np.ndarray | None = None) -> Iterator[Batch]:
    """Every sample exactly once, in stored order, split over ranks. Every rank gets the same number of
    micro-batches of ``micro_batch`` rows, so ZeRO-3's collective forward never waits on a rank that ran out; the
    last round is filled up with padding rows (key "", ``doc_ids`` all -1), which no objective takes targets from.
    The evaluated set is the same for any ``micro_batch`` and ``dp_world``: sum losses and target counts over the
    batches and reduce once at the end. ``first``, ``count``: only samples [first, first + count) (default all);
    ``ids``: only these samples (ascending; ``holdout.Holdout.scored``), instead of a range."""
    if micro_batch < 1 or dp_world < 1 or not 0 <= dp_rank < dp_world:
        raise ValueError(f"need micro_batch >= 1 and 0 <= dp_rank < dp_world, got micro_batch={micro_batch} "
                         f"dp_rank={dp_rank} dp_world={dp_world}")
    if ids is not None:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids) or ids.min() < 0 or ids.max() >= index.num_samples or (np.diff(ids) <= 0).any():
            raise ValueError(f"ids must be distinct ascending samples within the {index.num_samples} samples of "
                             f"{index.directory}")
        first, count = 0, len(ids)
    count = index.num_samples - first if count is None else count
    if first < 0 or count < 1 or first + count > index.num_samples:
        raise ValueError(f"samples [{first}, {first + count}) are not within the {index.num_samples} samples of "
                         f"{index.directory}")
    order = EvalOrder(count, micro_batch, dp_rank, dp_world, first, ids)
    yield from _data_loader(_MicroBatches(index, order, max_open_shards, verify), num_workers, False, 2)
