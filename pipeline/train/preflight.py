"""Everything about an experiment that can be checked before DeepSpeed builds an engine, each thing once: the run
directory (writable, locked for the run), the trackers' packages and login, the tokenizer, objectives against it, the start model and how it will run, the
shards (built when missing, then present, compatible, sizes, enough samples), and a resume's global batch.

:func:`agreed_preflight` runs it on every rank in three agreed stages (checks, rank 0 builds missing shards, the
shards' checks); the first failure of any rank is reported once, by rank 0. What it returns, :class:`Prepared`, is
what it built (objectives, probes, the start model's config, the shards' indexes, the held-out split), frozen: the
trainer builds the run from it and neither checks nor derives any of it again. Rank 0 takes the run directory's lock
onto the caller's ``ExitStack`` (the entry's ``with``), which releases it once, however the run ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from transformers import PretrainedConfig

from pipeline.config import ConfigError, to_dict
from pipeline.data.format.index import UNNAMED_SOURCE, DatasetIndex, load_index
from pipeline.data.loading.holdout import Holdout, ValidationSamples, split
from pipeline.data.loading.loader import (
    check_compatible,
    check_enough_samples,
    check_shard_kind,
    check_shard_sizes,
)
from pipeline.data.loading.mixture import Budget, MixtureError, MixturePlan, check_budget
from pipeline.data.loading.order import BatchWarmup
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import DataConfig, ExperimentConfig, PhaseData, ValidationConfig
from pipeline.export.record import EncoderRecord, from_experiment
from pipeline.inputs import check_buildable, has_shards, shard_store
from pipeline.lock import DirLock, describe
from pipeline.model.build import check_checkpoint_shape, check_sliding_window, start_checkpoint_config
from pipeline.model.presets import PRESETS
from pipeline.objectives.base import MaskTokenError
from pipeline.run_dir import RunDir
from pipeline.tokenizer import Tokenizer, load_tokenizer
from pipeline.train import errors
from pipeline.train.batch_warmup import batch_warmup
from pipeline.train.module import attn_implementation, fused_kind
from pipeline.train.phases import WeightedObjective, build_objectives, shard_kind_readers
from pipeline.train.trackers import check_trackers
from pipeline.train.validation import probes


@dataclass(frozen=True)
class Prepared:
    """What preflight built and checked; :func:`check_setup` fills the first part, :func:`check_shards` the
    shards' part (a new ``Prepared``)."""

    tokenizer: Tokenizer
    objectives: list[list[WeightedObjective]]  # per phase
    record: EncoderRecord  # what the run's HF export says of how to read the model
    attn_implementation: str  # the HF attention implementation to train with
    bf16: bool
    fused: str  # the AdamW kernel (module.fused_kind)
    start_config: PretrainedConfig | None = None  # model.init's config, checked against the tokenizer (None: a preset)
    probes: list[WeightedObjective] = field(default_factory=list)  # validation's probes (eval.every and eval.probes)
    warmup: BatchWarmup | None = None  # train.batch_warmup on this world size (None: none)
    notes: tuple[str, ...] = ()  # for rank 0 to print
    # per shard kind ("packed", "units", "pairs"), and per phase with shards of its own (PhaseData.loader)
    indexes: dict[str, DatasetIndex] = field(default_factory=dict)
    validation: ValidationSamples | None = None  # the samples validation scores (eval.every > 0)
    holdout: Holdout | None = None  # eval.holdout's split of data.shards: which packed samples training reads
    mixture: MixturePlan | None = None  # data.mixture's plan over those samples (None: no mixture)

    @property
    def train_samples(self) -> int | None:
        """How many packed samples training reads (None: not yet known, before :func:`check_shards`)."""
        return None if self.holdout is None else self.holdout.train_count


class PreflightFailed(Exception):
    """A rank's preflight failed; rank 0 has printed why."""


def check_run_dir(run_dir: str) -> None:
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir: {run_dir} is not writable ({e.strerror}); set run_dir to a directory this "
                          f"user can write (--set run_dir=...)") from None


def lock_run_dir(run_dir: str, held: contextlib.ExitStack) -> list[str]:
    """Lock ``run_dir`` until ``held`` closes (the entry's ``with``: one release, however the run ends); the note
    of a lock taken over from a run that died holding it."""
    lock = held.enter_context(DirLock(RunDir(run_dir).lock, f"run directory {run_dir}"))
    return [f"note: took over the lock of {run_dir} from a run that ended without releasing it: "
            f"{describe(lock.stale)}"] if lock.stale else []


def _start_config(exp: ExperimentConfig, tokenizer: Tokenizer) -> PretrainedConfig | None:
    """The start model: a preset (None), or a checkpoint directory that fits ``model.shape``, the tokenizer and the
    sequence length (its config, read once: the model builder takes it)."""
    try:
        if exp.model.init in PRESETS:
            if exp.model.shape:
                check_checkpoint_shape(exp.model.init, exp.model.shape)
            return None
        info = tokenizer.info
        config = start_checkpoint_config(exp.model.init, info.vocab_size, bos_token_id=info.bos_id,
                                         eos_token_id=info.eos_id, shape=exp.model.shape)
        check_sliding_window(config, exp.model.init, exp.phases_data[-1].context)
        return config
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
    saved = saved_train.global_batch(saved_world)
    t = exp.train
    now = t.global_batch(world)
    if saved != now:
        keep = saved // (t.micro_batch * world) if saved % (t.micro_batch * world) == 0 else None
        fix = f"set train.grad_accum={keep} to keep it, or " if keep else ""
        raise ConfigError(f"checkpoint.allow_global_batch_change: {path} was trained with a global batch of {saved} "
                          f"(micro_batch {saved_train.micro_batch} x grad_accum {saved_train.grad_accum} x "
                          f"{saved_world} ranks), this run has {now} (micro_batch {t.micro_batch} x grad_accum "
                          f"{t.grad_accum} x {world} ranks); {fix}set checkpoint.allow_global_batch_change=true "
                          f"to resume with the new batch")


def check_setup(exp: ExperimentConfig, rank: int, world: int, cuda: bool, held: contextlib.ExitStack) -> Prepared:
    """Everything but the shards' contents (they may not be built yet); rank 0 takes the run directory's lock
    until ``held`` closes."""
    check_run_dir(exp.run_dir)
    notes = lock_run_dir(exp.run_dir, held) if rank == 0 else []
    if rank == 0:  # rank 0 alone logs
        check_trackers(exp.train)
    tokenizer = load_tokenizer(exp.data.tokenizer)
    objectives = [build_objectives(p, tokenizer, f"phases[{i}]") for i, p in enumerate(exp.phases)]
    start_config = _start_config(exp, tokenizer)
    d = exp.data
    has_shards = check_buildable(d.shards, "data.shards", "data.build_inputs", d.build_inputs, d.seq_len, d)
    for i, data in _own_phase_data(exp):
        check_buildable(data.shards, f"phases[{i}].shards", f"data.build_inputs (for phases[{i}])",
                        list(data.build_inputs), data.seq_len, d)
    if not has_shards and set(d.source_mixture.names) - {UNNAMED_SOURCE} and not (d.build_source_field or
                                                                    d.build_source_default):
        raise ConfigError(f"data.mixture: mixes sources, but the shards data.build_if_missing would build into "
                          f"{d.shards} record none (one source {UNNAMED_SOURCE!r}); set data.build_source_field "
                          f"to the record field naming each document's source (SlimPajama: "
                          f"meta.redpajama_set_name), or build the shards with data_prep/build_shards.py "
                          f"--source-field")
    if shard_kind_readers(objectives)["units"] and not d.unit_shards:
        raise ConfigError("data.unit_shards: an objective reads sentence units (e.g. simcse, sscl) but "
                          "data.unit_shards is empty; build them with data_prep/build_shards.py --units and "
                          "set data.unit_shards")
    if shard_kind_readers(objectives)["pairs"] and not d.pair_shards:
        raise ConfigError("data.pair_shards: the supervised objective reads (query, positive, negatives) rows but "
                          "data.pair_shards is empty; build them with data_prep/build_shards.py --pairs and set "
                          "data.pair_shards")
    validation_probes = _probes(exp.eval, tokenizer) if exp.eval.every and exp.eval.probes else []
    check_resume_batch(exp, world)
    return Prepared(tokenizer, objectives, from_experiment(exp, tokenizer), attn_implementation(exp.model, cuda),
                    exp.model.dtype == "bf16" or (exp.model.dtype == "auto" and cuda), fused_kind(exp.optim, cuda),
                    start_config, validation_probes, batch_warmup(exp.train, world), tuple(notes))


def _own_phase_data(exp: ExperimentConfig) -> list[tuple[int, PhaseData]]:
    """(phase index, its data) of the first phase reading each shard directory other than data.shards."""
    return [(i, pd) for i, pd in enumerate(exp.phases_data) if pd.loader == f"phases[{i}]"]


def _probes(v: ValidationConfig, tokenizer: Tokenizer) -> list[WeightedObjective]:
    """Validation's probes, built (their mask token resolved) once, here."""
    try:
        return probes(v, tokenizer)
    except MaskTokenError as e:
        raise ConfigError(f"eval.mask_token: the MLM and MNTP probes mask tokens: {e.what}; set eval.mask_token to a "
                          f"token of its vocabulary, or eval.probes=false") from None


def build_missing_shards(exp: ExperimentConfig, tokenizer: Tokenizer) -> None:
    """Rank 0's job: the packed shards from ``data.build_inputs`` when ``data.shards`` has none, and each phase's
    own shards (at its sequence length) when they are missing."""
    d = exp.data
    sources = f", sources from {d.build_source_field or d.build_source_default!r}" if d.build_source_field or \
        d.build_source_default else ""
    for directory, seq_len, inputs in [(d.shards, d.seq_len, tuple(d.build_inputs)),
                                       *((pd.shards, pd.seq_len, pd.build_inputs) for _, pd in _own_phase_data(exp))]:
        if has_shards(directory, d):
            continue
        print(f"building shards of {list(inputs)} into {directory} (seq_len {seq_len}{sources})", flush=True)
        run_job(BuildConfig(inputs=inputs, tokenizer=tokenizer.path, output=directory, seq_len=seq_len,
                            workers=1, progress=False, source_field=d.build_source_field,
                            source_default=d.build_source_default))


def _load_index(directory: str, setting: str, d: DataConfig, tokenizer: Tokenizer, seq_len: int | None,
                kind: str, readers: list[str]) -> DatasetIndex:
    """The index of ``directory``: present, built with the tokenizer and sequence length, of the kind its
    ``readers`` read, every shard of its recorded size."""
    if not has_shards(directory, d):
        raise ConfigError(f"{setting}: {directory} is not a shard directory; build it with data_prep/build_shards.py"
                          + {"units": " --units", "pairs": " --pairs"}.get(kind, ""))
    index = load_index(directory, shard_store(d))
    check_compatible(index, tokenizer.info.fingerprint, index.seq_len if seq_len is None else seq_len)
    if readers:
        check_shard_kind(index, kind, setting, readers)
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
                 kind: str, readers: list[str], global_batch: int) -> DatasetIndex:
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
    mixture = d.source_mixture
    steps = sum(n for n, pd in zip(exp.phase_lengths(), exp.phases_data) if pd.loader == "packed")
    budget = Budget(steps, t.global_batch(world), d.seq_len)
    try:
        plan = MixturePlan.build(index, mixture.ratios, t.seed, train_samples)
        lines = check_budget(plan, budget, mixture.max_repetition)
    except MixtureError as e:
        raise ConfigError(str(e)) from None
    left_out = [name for name in index.sources if name not in mixture.names]
    return plan, ([f"mixture of {len(mixture.names)} sources over {budget.describe()}:", *(f"  {line}" for line in lines)]
            + ([f"note: data.mixture leaves out {', '.join(left_out)} of {index.directory}: not trained on"]
               if left_out else []))


def check_shards(exp: ExperimentConfig, prepared: Prepared, world: int, rank: int = 0) -> Prepared:
    """``prepared`` with the index of each shard kind the run reads, checked against the tokenizer, the
    objectives, the batch and the mixture, the held-out split and validation samples (and the mixture's plan in its
    notes, on rank 0)."""
    readers = shard_kind_readers(prepared.objectives)
    t, d, tok = exp.train, exp.data, prepared.tokenizer
    indexes = {"packed": _load_index(d.shards, "data.shards", d, tok, d.seq_len, "packed", readers["packed"])}
    holdout = split(indexes["packed"], exp.eval.holdout)  # once: training, validation and the mixture take it
    _check_enough("data.shards", indexes["packed"], t.global_batch(world), holdout)
    for i, pd in _own_phase_data(exp):
        phase_readers = sorted({o.name for o in prepared.objectives[i] if o.objective.shard_kind == "packed"})
        indexes[pd.loader] = _check_index(pd.shards, f"phases[{i}].shards", d, tok, pd.seq_len, "packed",
                                          phase_readers, t.global_batch(world, pd.micro_batch))
    validation = check_held_out(exp, tok, indexes["packed"], holdout)
    plan, notes = check_mixture(exp, indexes["packed"], holdout.limit, world) if d.source_mixture else (None, [])
    if readers["units"]:
        indexes["units"] = _check_index(d.unit_shards, "data.unit_shards", d, tok, None, "units", readers["units"],
                                        t.global_batch(world, d.unit_micro_batch))
    if readers["pairs"]:
        indexes["pairs"] = _check_index(d.pair_shards, "data.pair_shards", d, tok, None, "pairs", readers["pairs"],
                                        t.global_batch(world))
        check_instruction_format(exp, indexes["pairs"])
    return replace(prepared, indexes=indexes, validation=validation, holdout=holdout, mixture=plan,
                   notes=prepared.notes + (tuple(notes) if rank == 0 else ()))


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


def check_held_out(exp: ExperimentConfig, tokenizer: Tokenizer, packed: DatasetIndex,
                   holdout: Holdout) -> ValidationSamples | None:
    """The validation samples: the first ``eval.samples`` of ``eval.shards``, or of ``holdout``, the last
    ``eval.holdout`` of each source of ``data.shards`` (``pipeline.data.loading.holdout``). Training stops short of a holdout
    even while ``eval.every`` is 0, so turning validation on at a resume does not change the training order."""
    v = exp.eval
    if not v.every:
        return None
    if v.shards:
        index = _check_index(v.shards, "eval.shards", exp.data, tokenizer, exp.data.seq_len, "packed",
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


@contextlib.contextmanager
def preflight(exp: ExperimentConfig, rank: int, world: int, cuda: bool = False) -> Iterator[Prepared]:
    """``with preflight(...) as prepared:`` the whole preflight in one process (rank 0 also builds missing shards),
    the run directory locked (on rank 0) until the block ends; raises the first failure."""
    with contextlib.ExitStack() as held:
        prepared = check_setup(exp, rank, world, cuda, held)
        if rank == 0:
            build_missing_shards(exp, prepared.tokenizer)
        yield check_shards(exp, prepared, world, rank)


def code_digest() -> str:
    """sha256 of the pipeline package's Python sources, in path order: what each rank runs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _first_difference(a, b, key: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else k)
    return f"{key or 'the experiment'}: {b!r} there, {a!r} on rank 0"


def check_same_run(exp: ExperimentConfig, world: int) -> None:
    """Every rank trains what rank 0 trains, with the same code: nodes that read other files (another checkout, a
    stale copy of the experiment, other --set options) would otherwise train together on mismatched settings."""
    import torch.distributed as dist

    mine = (socket.gethostname(), code_digest(), to_dict(exp))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    host0, code0, exp0 = everyone[0]
    for r, (host, code, exp_r) in enumerate(everyone[1:], 1):
        where = f"rank {r} on {host} runs"
        if code != code0:
            raise ConfigError(f"{where} other code than rank 0 on {host0} (pipeline/ differs); launch every node "
                              f"from the same checkout")
        if exp_r != exp0:
            raise ConfigError(f"{where} another experiment than rank 0 on {host0}, "
                              f"{_first_difference(exp0, exp_r)}; launch every node with the same --experiment file "
                              f"and --set options")


def _agreed(rank: int, world: int, stage: Callable[[], object], on_failure: Callable[[], None]):
    """``stage()`` on every rank; when any rank fails, rank 0 prints the first failure once, no rank leaves before
    it has (a rank's exit makes the launcher signal the others), and every rank raises :class:`PreflightFailed`."""
    import torch.distributed as dist

    result, failure = None, None
    try:
        result = stage()
    except Exception as e:  # noqa: BLE001 - reported below, once
        failure = ("config error" if isinstance(e, ConfigError) else "error", errors.one_line(e))
    failures: list = [None] * world
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return result
    on_failure()
    if rank == 0:
        print(f"{first[0]}: {first[1]}", file=sys.stderr, flush=True)
    dist.barrier()
    raise PreflightFailed(first[1])


def agreed_preflight(exp: ExperimentConfig, rank: int, world: int, cuda: bool, held: contextlib.ExitStack,
                     on_failure: Callable[[], None] = lambda: None) -> Prepared | None:
    """The stages of :func:`preflight` on every rank, agreed; None when any rank failed (rank 0 said why). Rank 0
    holds the run directory's lock until ``held`` closes. ``on_failure`` runs on every rank before the report (the
    trainer's stop request then holds signals)."""
    try:
        _agreed(rank, world, lambda: check_same_run(exp, world), on_failure)
        prepared = _agreed(rank, world, lambda: check_setup(exp, rank, world, cuda, held), on_failure)
        _agreed(rank, world, lambda: build_missing_shards(exp, prepared.tokenizer) if rank == 0 else None,
                on_failure)
        return _agreed(rank, world, lambda: check_shards(exp, prepared, world, rank), on_failure)
    except PreflightFailed:
        return None
