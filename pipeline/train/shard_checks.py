"""The shards a run reads, checked once before any loader is built: their named inputs present and what they were
built from (:func:`check_packed_sources`), built when missing or, with data.rebuild, rebuilt when built from other
inputs (rank 0, :func:`build_missing_shards`, from what :func:`build_input_files` finds), then present, built with
the tokenizer and sequence length, of the kind their objectives read, every shard of its size, enough samples for
a global batch; data.shards' held-out split and validation samples (:func:`check_held_out`), data.mixture against the
budget (:func:`check_mixture`), data.pair_mixture and data.pair_batching against the pair shards' tasks and the
supervised objectives (:func:`check_pairs`), and each loader's spec (:class:`LoaderSpec`: micro-batch, holdout,
mixture plan, same-task batches, batch warmup)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from pipeline.config import ConfigError
from pipeline.data.format.index import (
    DatasetIndex,
    ShardKind,
    check_compatible,
    check_enough_samples,
    check_shard_kind,
    check_shard_sizes,
    load_index,
)
from pipeline.data.format.teacher import TeacherError, check_teacher
from pipeline.data.loading.holdout import Holdout, ValidationSamples, split
from pipeline.data.loading.mixture import Budget, MixtureError, MixturePlan, check_budget
from pipeline.data.loading.order import BatchWarmup
from pipeline.data.prep.build_config import BuildConfig
from pipeline.data.prep.sources import InputError, expand_inputs
from pipeline.experiment import DataConfig, ExperimentConfig, PhaseData, SourceMixture
from pipeline.inputs import (
    built_from_others,
    check_buildable,
    check_named_inputs,
    has_shards,
    shard_store,
    shards_fingerprint,
)

if TYPE_CHECKING:  # the build, the tokenizer and the objectives import torch: first_checks' part imports none
    from pipeline.tokenizer import Tokenizer
    from pipeline.train.phases import WeightedObjective


@dataclass(frozen=True)
class LoaderSpec:
    """One loader of the run as preflight decided it: its shards, micro-batch, held-out samples, mixture, same-task
    batches, batch warmup, and how the run reads (seed, workers, verification). The trainer opens it
    (``ShardLoader``) on its rank."""

    index: DatasetIndex
    micro_batch: int
    grad_accum: int  # train.grad_accum: micro-batches per optimizer step
    seed: int  # train.seed
    workers: int  # data.num_workers
    verify: bool  # data.verify_shards
    holdout: Holdout | None = None  # the samples it stops short of (data.shards' eval.holdout)
    mixture: Mapping[str, float] | None = None  # data.mixture's ratios (data.shards'), data.pair_mixture's (pairs')
    plan: MixturePlan | None = None  # their plan over the samples training reads
    warmup: BatchWarmup | None = None  # train.batch_warmup, for the loaders the first phase reads
    same_task: bool = False  # data.pair_batching: same_task, every global batch of one task (the pairs loader)


@dataclass(frozen=True)
class Shards:
    """What :func:`check_shards` found: the index of each shard kind (and each phase's own shards), the loader over
    each, data.shards' held-out split and the validation samples; the mixture's lines for rank 0 to print."""

    indexes: Mapping[str, DatasetIndex]
    loaders: Mapping[str, LoaderSpec]
    holdout: Holdout
    validation: ValidationSamples | None
    notes: tuple[str, ...]


def own_phase_data(exp: ExperimentConfig) -> list[tuple[int, PhaseData]]:
    """(phase index, its data) of the first phase reading each shard directory other than data.shards."""
    return [(i, pd) for i, pd in enumerate(exp.phases_data) if pd.loader == f"phases[{i}]"]


@dataclass(frozen=True)
class PackedDir:
    """A packed shard directory the run reads (data.shards or a phase's own), with what preflight builds it from."""

    setting: str  # the config key that names it
    inputs_setting: str  # the key that names its inputs
    directory: str
    seq_len: int
    inputs: tuple[str, ...]


def packed_dirs(exp: ExperimentConfig) -> list[PackedDir]:
    """data.shards built from ``data.build_inputs``, and each phase's own at its sequence length."""
    d = exp.data
    return [PackedDir("data.shards", "data.build_inputs", d.shards, d.seq_len, tuple(d.build_inputs)),
            *(PackedDir(f"phases[{i}].shards", f"data.build_inputs (for phases[{i}])", pd.shards, pd.seq_len,
                        pd.build_inputs) for i, pd in own_phase_data(exp))]


def check_packed_sources(exp: ExperimentConfig, tokenizer: Tokenizer | None) -> list[PackedDir]:
    """Each of :func:`packed_dirs` holds shards or can be built, and its named inputs exist and are what it was
    built from (``pipeline.inputs``; with ``tokenizer`` None, before it is loaded, all but the tokenizer); returns
    :func:`shards_to_build`."""
    d = exp.data
    for p in packed_dirs(exp):
        check_buildable(p.directory, p.setting, p.inputs_setting, list(p.inputs), p.seq_len, d)
        check_named_inputs(p.directory, p.setting, p.inputs_setting, p.inputs, p.seq_len, d, _fingerprint(tokenizer))
    return shards_to_build(exp, tokenizer)


def _fingerprint(tokenizer: Tokenizer | None) -> str | None:
    return None if tokenizer is None else tokenizer.info.fingerprint


def shards_to_build(exp: ExperimentConfig, tokenizer: Tokenizer | None) -> list[PackedDir]:
    """The packed directories rank 0 builds: those without shards, and with data.rebuild those built otherwise
    than their named inputs build them (``tokenizer`` None: other than by the tokenizer)."""
    d = exp.data
    return [p for p in packed_dirs(exp) if not has_shards(p.directory, d) or
            (d.rebuild and built_from_others(p.directory, p.inputs, p.seq_len, d, _fingerprint(tokenizer)))]


def build_input_files(exp: ExperimentConfig, tokenizer: Tokenizer) -> list[tuple[PackedDir, list[str]]]:
    """(directory, the input files it is built from) of each of :func:`shards_to_build`: every input pattern
    matches a file of a kind data prep reads, checked before anything starts."""
    try:
        return [(p, expand_inputs(p.inputs)) for p in shards_to_build(exp, tokenizer)]
    except InputError as e:
        raise ConfigError(f"data.build_inputs: {str(e).replace('--input ', '', 1)}") from None


def build_missing_shards(exp: ExperimentConfig, tokenizer: Tokenizer) -> None:
    """Rank 0's job: the directories of :func:`shards_to_build`, built; one that holds other shards is rebuilt
    beside itself and swapped in once complete, so a failed rebuild leaves the old shards as they were."""
    from pipeline.data.prep.build import run_job

    d = exp.data
    sources = f", sources from {d.build_source_field or d.build_source_default!r}" if d.build_source_field or \
        d.build_source_default else ""
    for p in shards_to_build(exp, tokenizer):
        rebuild = has_shards(p.directory, d)
        output = f"{p.directory.rstrip(os.sep)}.rebuild" if rebuild else p.directory
        print(f"{'rebuilding' if rebuild else 'building'} shards of {list(p.inputs)} into {p.directory} (seq_len "
              f"{p.seq_len}{sources}{', data.rebuild: built from other inputs' if rebuild else ''})", flush=True)
        if rebuild:
            shutil.rmtree(output, ignore_errors=True)  # a killed rebuild's half, perhaps of other inputs
        run_job(_build_config(p, d, tokenizer, output))
        if rebuild:
            _swap_in(output, p.directory)


def _build_config(p: PackedDir, d: DataConfig, tokenizer: Tokenizer, output: str) -> BuildConfig:
    """How rank 0 builds ``p`` into ``output``: data prep's defaults at its sequence length, with
    data.build_source_*."""
    return BuildConfig(inputs=p.inputs, tokenizer=tokenizer.path, output=output, seq_len=p.seq_len, workers=1,
                       progress=False, source_field=d.build_source_field, source_default=d.build_source_default)


def packed_fingerprints(exp: ExperimentConfig, tokenizer: Tokenizer | None, to_build: list[PackedDir]
                        ) -> dict[str, tuple[str, str | None]]:
    """(directory, fingerprint) of each of :func:`packed_dirs` when the run starts, by its loader's name (data.shards:
    ``packed``, a phase's own: ``phases[i]``): its manifest's, or that of the build in ``to_build``
    (:func:`shards_to_build`) rank 0 is to make, which its settings alone fix. With ``tokenizer`` None (not loaded
    yet) a build's is not known (None), nor, with data.rebuild, any: another tokenizer may rebuild a directory."""
    d = exp.data

    def fingerprint(p: PackedDir) -> str | None:
        if p not in to_build and not (tokenizer is None and d.rebuild):
            return shards_fingerprint(p.directory, d)
        if tokenizer is None:
            return None
        from pipeline.data.prep.build import shard_fingerprint  # imports torch (the masking plan's module)

        return shard_fingerprint(_build_config(p, d, tokenizer, p.directory), tokenizer)

    names = [ShardKind.PACKED.value, *(pd.loader for _, pd in own_phase_data(exp))]
    return {name: (p.directory, fingerprint(p)) for name, p in zip(names, packed_dirs(exp), strict=True)}


def _swap_in(new: str, directory: str) -> None:
    """``new`` renamed to ``directory``, whose old contents are removed after the swap (two renames)."""
    old = f"{directory.rstrip(os.sep)}.replaced"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(directory, old)
    os.rename(new, directory)
    shutil.rmtree(old)


def _load_index(directory: str, setting: str, d: DataConfig, tokenizer: Tokenizer, seq_len: int | None,
                kind: ShardKind, readers: list[str]) -> DatasetIndex:
    """The index of ``directory``: present, built with the tokenizer and sequence length, of the kind its
    ``readers`` read, every shard of its recorded size."""
    if not has_shards(directory, d):
        raise ConfigError(f"{setting}: {directory} is not a shard directory; build it with data_prep/build_shards.py"
                          + {ShardKind.UNITS: " --units", ShardKind.PAIRS: " --pairs"}.get(kind, ""))
    index = load_index(directory, shard_store(d))
    try:  # the shards fit the experiment's settings, or the setting is wrong: a config error naming it
        check_compatible(index, tokenizer.info.fingerprint, index.seq_len if seq_len is None else seq_len)
        if readers:
            check_shard_kind(index, kind, setting, readers)
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith(setting) else f"{setting}: {e}") from None
    check_shard_sizes(index)
    return index


def _check_enough(setting: str, index: DatasetIndex, global_batch: int, holdout: Holdout | None = None) -> None:
    """The one check that the samples training reads of ``index`` (short of ``holdout``'s) fill a global batch:
    the loaders built from it do not repeat it."""
    try:
        check_enough_samples(index, global_batch, None if holdout is None else holdout.train_count)
    except ValueError as e:
        raise ConfigError(f"{setting}: {e}") from None


def _check_index(directory: str, setting: str, d: DataConfig, tokenizer: Tokenizer, seq_len: int | None,
                 kind: ShardKind, readers: list[str], global_batch: int) -> DatasetIndex:
    """:func:`_load_index`, all of whose samples are read in batches of ``global_batch``."""
    index = _load_index(directory, setting, d, tokenizer, seq_len, kind, readers)
    _check_enough(setting, index, global_batch)
    return index


def check_mixture(exp: ExperimentConfig, index: DatasetIndex, train_samples: int | dict[str, int],
                  world: int) -> tuple[MixturePlan, list[str]]:
    """``data.mixture`` against the sources of ``index`` and the run's budget (the steps of the phases reading
    data.shards x global batch):
    every source named exists and can supply its share within its maximum repetition. Returns the plan (the packed
    loader's) and its lines for rank 0 to print."""
    d, t = exp.data, exp.train
    steps = sum(n for n, pd in zip(exp.phase_lengths(), exp.phases_data) if pd.reads_data_shards)
    return _plan(d.source_mixture, "data.mixture", "sources", index, train_samples, t.seed,
                 Budget(steps, t.global_batch(world), d.seq_len))


def _plan(mixture: SourceMixture, setting: str, what: str, index: DatasetIndex, train_samples: int | dict[str, int] | None,
          seed: int, budget: Budget) -> tuple[MixturePlan, list[str]]:
    """The plan of ``mixture`` (``setting``, of ``what``: sources or tasks) over ``index``, checked against
    ``budget``, and its lines for rank 0 to print."""
    try:
        plan = MixturePlan.build(index, mixture.ratios, seed, train_samples, setting)
        lines = check_budget(plan, budget, mixture.max_repetition, setting)
    except MixtureError as e:
        raise ConfigError(str(e)) from None
    left_out = [name for name in index.sources if name not in mixture.names]
    return plan, ([f"mixture of {len(mixture.names)} {what} over {budget.describe()}:", *(f"  {line}" for line in lines)]
            + ([f"note: {setting} leaves out {', '.join(left_out)} of {index.directory}: not trained on"]
               if left_out else []))


def check_pairs(exp: ExperimentConfig, index: DatasetIndex, objectives: tuple[tuple[WeightedObjective, ...], ...],
                world: int) -> tuple[MixturePlan | None, list[str]]:
    """The pair shards against what reads them: the instruction format, hard negatives for a supervised objective
    with ``in_batch_negatives: false``, ``data.pair_batching: same_task`` over a ``data.pair_mixture`` of >= 2 of
    their tasks, and that mixture against the tasks and the budget of the phases reading pairs. Returns its plan
    (None without one) and lines."""
    d, t = exp.data, exp.train
    check_instruction_format(exp, index)
    check_hard_negatives(exp, index)
    check_teachers(exp, index)
    mixture = d.task_mixture
    if d.pair_batching == "same_task" and len(mixture.names) < 2:
        counts = {name: c["samples"] for name, c in index.source_counts().items()}
        if len(counts) < 2:
            raise ConfigError(f"data.pair_batching: same_task draws each global batch from one task of "
                              f"data.pair_mixture, but data.pair_shards {index.directory} holds one task "
                              f"({', '.join(counts)!r}; built before pairs shards recorded their tasks?); build "
                              f"pairs shards of >= 2 tasks (a row's \"task\" or its file's stem), or set "
                              f"data.pair_batching=mixed")
        total = sum(counts.values())
        ratios = ", ".join(f"{name}: {n / total:.4g}" for name, n in counts.items())
        raise ConfigError(f"data.pair_batching: same_task draws each global batch from one task of "
                          f"data.pair_mixture, which names {len(mixture.names)} task(s); set data.pair_mixture to >= 2 "
                          f"tasks of {index.directory}, e.g. {{{ratios}}} (in proportion to their rows, as "
                          f"FlagEmbedding's same_dataset_within_batch draws them)")
    if not mixture:
        return None, []
    steps = sum(n for n, objs in zip(exp.phase_lengths(), objectives)
                if any(o.objective.shard_kind == ShardKind.PAIRS for o in objs))
    return _plan(mixture, "data.pair_mixture", "tasks", index, None, t.seed,
                 Budget(steps, t.global_batch(world), index.seq_len))


def loader_micro_batches(exp: ExperimentConfig) -> dict[str, int]:
    """Each loader's micro-batch: train.micro_batch, the units' data.unit_micro_batch, each phase's own."""
    t, d = exp.train, exp.data
    micro = {ShardKind.PACKED.value: t.micro_batch, ShardKind.UNITS.value: d.unit_micro_batch or t.micro_batch,
             ShardKind.PAIRS.value: t.micro_batch}
    return micro | {pd.loader: pd.micro_batch for pd in exp.phases_data}


def check_shards(exp: ExperimentConfig, tok: Tokenizer, objectives: tuple[tuple[WeightedObjective, ...], ...],
                 warmup: BatchWarmup | None, world: int) -> Shards:
    """The index of each shard kind the run reads, checked against the tokenizer, the ``objectives``, the batch and
    the mixture, the held-out split and validation samples, and the loader of each (``warmup`` on those the first
    phase reads). The loaders are named by plain strings, as checkpoints record their positions: each kind's by its
    value ("packed", "units", "pairs"), a phase's own shards by the phase (``PhaseData.loader``)."""
    from pipeline.train.phases import shard_kind_readers

    readers = shard_kind_readers(objectives)
    t, d = exp.train, exp.data
    micro = loader_micro_batches(exp)
    packed, units, pairs = ShardKind.PACKED.value, ShardKind.UNITS.value, ShardKind.PAIRS.value  # loaders' names
    indexes = {packed: _load_index(d.shards, "data.shards", d, tok, d.seq_len, ShardKind.PACKED,
                                   readers[ShardKind.PACKED])}
    holdout = split(indexes[packed], exp.eval.holdout)  # once: training, validation and the mixture take it
    _check_enough("data.shards", indexes[packed], t.global_batch(world, micro[packed]), holdout)
    for i, pd in own_phase_data(exp):
        phase_readers = sorted({o.name for o in objectives[i] if o.objective.shard_kind == ShardKind.PACKED})
        indexes[pd.loader] = _check_index(pd.shards, f"phases[{i}].shards", d, tok, pd.seq_len, ShardKind.PACKED,
                                          phase_readers, t.global_batch(world, micro[pd.loader]))
    validation = check_held_out(exp, tok, indexes[packed], holdout)
    plan, notes = check_mixture(exp, indexes[packed], holdout.limit, world) if d.source_mixture else (None, [])
    plans = {packed: (d.source_mixture, plan)}
    if readers[ShardKind.UNITS]:
        indexes[units] = _check_index(d.unit_shards, "data.unit_shards", d, tok, None, ShardKind.UNITS,
                                      readers[ShardKind.UNITS], t.global_batch(world, micro[units]))
    if readers[ShardKind.PAIRS]:
        indexes[pairs] = _check_index(d.pair_shards, "data.pair_shards", d, tok, None, ShardKind.PAIRS,
                                      readers[ShardKind.PAIRS], t.global_batch(world, micro[pairs]))
        pair_plan, pair_notes = check_pairs(exp, indexes[pairs], objectives, world)
        plans[pairs], notes = (d.task_mixture, pair_plan), notes + pair_notes
    first = exp.phases_data[0].loader  # the batch warmup lies in the first phase: it warms that phase's loaders
    warmed = {first if o.objective.shard_kind == ShardKind.PACKED else o.objective.shard_kind.value
              for o in objectives[0]}
    mixtures = {name: (MappingProxyType(m.ratios), p) for name, (m, p) in plans.items() if m}
    loaders = {name: LoaderSpec(index, micro[name], t.grad_accum, t.seed, d.num_workers, d.verify_shards,
                                holdout if name == packed else None,
                                *mixtures.get(name, (None, None)), warmup if name in warmed else None,
                                name == pairs and d.pair_batching == "same_task")
               for name, index in indexes.items()}
    return Shards(MappingProxyType(indexes), MappingProxyType(loaders), holdout, validation, tuple(notes))


def check_instruction_format(exp: ExperimentConfig, index: DatasetIndex) -> None:
    """The supervised objective records the instruction format its export applies to queries: it must be the one
    data prep joined the shards' instructions with."""
    built = index.pairs["instruction_format"]
    for i, phase in enumerate(exp.phases):
        for j, o in enumerate(phase.objectives):
            if getattr(o, "instruction_format", built) != built:
                raise ConfigError(f"phases[{i}].objectives[{j}].instruction_format: {o.instruction_format!r}, but "
                                  f"data.pair_shards {index.directory} joined its instructions with {built!r}; set "
                                  f"it to {built!r} (or rebuild the shards with --instruction-format)")


def check_hard_negatives(exp: ExperimentConfig, index: DatasetIndex) -> None:
    """A supervised objective with ``in_batch_negatives: false`` scores each query against its own hard negatives
    only: the pair shards must hold some, and the objective must read them."""
    for i, phase in enumerate(exp.phases):
        for j, o in enumerate(phase.objectives):
            if getattr(o, "in_batch_negatives", True) or not o.hard_negatives:
                continue  # (in_batch_negatives false with hard_negatives false is refused at load)
            if index.pairs["negatives"] < 1:
                raise ConfigError(f"phases[{i}].objectives[{j}].in_batch_negatives: false scores each query against "
                                  f"its own hard negatives only, but data.pair_shards {index.directory} holds none "
                                  f"(built with --negatives 0); rebuild them with --negatives 1 or more, or set "
                                  f"phases[{i}].objectives[{j}].in_batch_negatives=true")


def check_teachers(exp: ExperimentConfig, index: DatasetIndex) -> None:
    """A ``distill`` objective's teacher directory must hold the embeddings of these very shards: its record's
    fingerprint and row count theirs, a file per text column."""
    for i, phase in enumerate(exp.phases):
        for j, o in enumerate(phase.objectives):
            if o.name == "distill":
                try:
                    check_teacher(o.teacher, index.fingerprint, index.num_samples, index.pairs["slots"])
                except TeacherError as e:
                    raise ConfigError(f"phases[{i}].objectives[{j}].teacher: {e}") from None


def check_held_out(exp: ExperimentConfig, tokenizer: Tokenizer, packed: DatasetIndex,
                   holdout: Holdout) -> ValidationSamples | None:
    """The validation samples: the first ``eval.samples`` of ``eval.shards``, or of ``holdout``, the last
    ``eval.holdout`` of each source of ``data.shards`` (``pipeline.data.loading.holdout``). Training stops short of a holdout
    even while ``eval.every`` is 0, so turning validation on at a resume does not change the training order."""
    v = exp.eval
    if not v.every:
        return None
    if v.shards:
        index = _check_index(v.shards, "eval.shards", exp.data, tokenizer, exp.data.seq_len, ShardKind.PACKED,
                             ["validation"], 1)
        if index.fingerprint == packed.fingerprint:
            raise ConfigError(f"eval.shards: {v.shards} holds the samples of data.shards, all of which training "
                              f"reads; point it at held-out shards, or hold samples out with eval.holdout")
        available = index.num_samples
    else:
        index, available = packed, holdout.held_count
    if v.samples > available:
        raise ConfigError(f"eval.samples: {v.samples} samples to score, but {index.directory} holds out only "
                          f"{available}; set eval.samples={available} (or 0: all of them), or hold out more")
    count = v.samples or available
    if v.shards:
        return ValidationSamples(index, 0, count)
    ids = holdout.scored(count)
    if ids[-1] - ids[0] + 1 == count:  # one range: one source (its last samples), or all held out ones adjacent
        return ValidationSamples(index, int(ids[0]), count)
    return ValidationSamples(index, int(ids[0]), count, ids)
