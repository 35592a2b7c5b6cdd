"""Everything about an experiment that can be checked or decided before DeepSpeed builds an engine, each thing once:
the run directory (writable, locked for the run), the trackers' packages and login, the tokenizer, objectives
against it, the DeepSpeed JSON against the experiment, the model (the start checkpoint, how it runs and compiles,
an MoE model's router loss against grad_cache), the evaluators' data files, the shards (built when missing, then
present, compatible, sizes, enough samples) and each loader over them, and the resume point with its global batch.
Every config error of a run is raised here: nothing below it raises ``ConfigError``.

:func:`local_preflight` is what one rank checks alone, before any process group (and all that ``launch/train.py
--check`` runs): it takes and writes nothing, so a refusal costs no rendezvous and leaves nothing behind.
:func:`agreed_preflight` then runs the rest on every rank in agreed checks (the same run and code, each rank's local
result, rank 0's lock, rank 0's build of missing shards, their checks); the first failure of any rank is reported
once, by rank 0. What it returns, :class:`Prepared`, is what it built and decided (objectives, probes, the
resolved DeepSpeed config, the model's spec, the run's plan and each part's spec, the resume point, the shards'
indexes, the held-out split, each loader's spec), frozen: the trainer builds the run from it and neither checks nor
derives any of it again, nor reads the experiment. Rank 0
takes the run directory's lock onto the caller's ``ExitStack`` (the entry's ``with``), which releases it once,
however the run ends.

This module composes the checks and holds what is the model's and the setup's; its parts by job:
:mod:`pipeline.train.run_setup` the run directory and the resume point, :mod:`pipeline.train.shard_checks` the
shards, held-out samples, mixture and loaders, :mod:`pipeline.train.agreement` the cross-rank agreement.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch
from transformers import PretrainedConfig

from pipeline.config import ConfigError, to_dict
from pipeline.data.format.index import UNNAMED_SOURCE, DatasetIndex, ShardKind
from pipeline.data.loading.holdout import Holdout, ValidationSamples
from pipeline.data.loading.order import BatchWarmup
from pipeline.experiment import ExperimentConfig, ValidationConfig
from pipeline.export.record import EncoderRecord, from_experiment
from pipeline.model.build import (
    ModelSpec,
    check_checkpoint_shape,
    check_sliding_window,
    preset_config,
    start_checkpoint_config,
)
from pipeline.model.moe import router_aux_coef
from pipeline.model.presets import PRESETS
from pipeline.objectives.base import MaskTokenError
from pipeline.run_dir import DataRecord, RunDir
from pipeline.tokenizer import Tokenizer, load_tokenizer
from pipeline.train import errors
from pipeline.train.agreement import PreflightFailed, agreed, check_same_run
from pipeline.train.batch_warmup import batch_warmup
from pipeline.train.compiling import body_compiles, check_compile
from pipeline.train.ds_config import resolve_ds_config
from pipeline.train.engine_spec import EngineSpec, engine_spec
from pipeline.train.evaluators import EvaluatorTask, evaluator_tasks
from pipeline.train.keep_best import keep_best
from pipeline.train.kernels import attn_implementation, model_dtype
from pipeline.train.phases import WeightedObjective, build_objectives, shard_kind_readers
from pipeline.train.plan import CheckpointSpec, RunPlan, checkpoint_spec, run_plan
from pipeline.train.run_setup import (
    ResumePoint,
    check_resumable,
    check_run_dir,
    check_run_dir_free,
    half_written,
    lock_run_dir,
    resume_point,
)
from pipeline.train.shard_checks import (
    LoaderSpec,
    build_input_files,
    build_missing_shards,
    check_packed_sources,
    check_shards,
    packed_fingerprints,
)
from pipeline.train.trackers import TrackersSpec, check_trackers, trackers_spec
from pipeline.train.validation import ValidationSpec, probes


@dataclass(frozen=True)
class Prepared:
    """What preflight built, checked and decided, the trainer's whole hand-over: it builds the run from it and
    neither checks nor derives any of it again, nor reads the experiment. :func:`check_setup` fills the first part,
    the shards' checks (:func:`~pipeline.train.shard_checks.check_shards`) the shards' part (a new ``Prepared``).
    Its containers are immutable; what it lends that others change is copied (:meth:`ds_config`,
    :meth:`run_files`; the model's config by :func:`~pipeline.model.build.build_model`)."""

    tokenizer: Tokenizer
    objectives: tuple[tuple[WeightedObjective, ...], ...]  # per phase
    record: EncoderRecord  # what the run's HF export says of how to read the model
    model: ModelSpec  # the model to build: config, weights, dtype, attention, LoRA, checkpointing, compile
    engine: EngineSpec  # the engine around it: optimizer, LR schedule, AdamW kernel, leaf layers, router loss
    resolved_ds: dict  # the DeepSpeed config resolved against the experiment: read it through :meth:`ds_config`
    plan: RunPlan  # the phases and the steps of logs, validations, checkpoints, the stop and the export
    checkpoint: CheckpointSpec  # how checkpoints are kept (with keep_best's decision once the shards are checked)
    trackers: TrackersSpec
    evaluators: tuple[EvaluatorTask, ...]  # eval.evaluators, parsed
    experiment: Mapping  # the experiment as a dict (experiment.json): read it through :meth:`run_files`
    resume: ResumePoint | None = None  # where the run resumes (None: it starts at step 0)
    half_written: tuple[int, ...] = ()  # steps of checkpoint directories without COMPLETE, which a killed run left
    probes: tuple[WeightedObjective, ...] = ()  # validation's probes (eval.every and eval.probes)
    warmup: BatchWarmup | None = None  # train.batch_warmup on this world size (None: none)
    notes: tuple[str, ...] = ()  # for rank 0 to print
    # per shard kind ("packed", "units", "pairs"), and per phase with shards of its own (PhaseData.loader)
    indexes: Mapping[str, DatasetIndex] = field(default_factory=lambda: MappingProxyType({}))
    loaders: Mapping[str, LoaderSpec] = field(default_factory=lambda: MappingProxyType({}))  # one per index
    validation: ValidationSamples | None = None  # the samples validation scores (eval.every > 0)
    validator: ValidationSpec | None = None  # what and how validation scores (None: no validation)
    holdout: Holdout | None = None  # eval.holdout's split of data.shards: which packed samples training reads

    @property
    def train_samples(self) -> int | None:
        """How many packed samples training reads (None: not yet known, before :func:`check_shards`)."""
        return None if self.holdout is None else self.holdout.train_count

    def ds_config(self) -> dict:
        """The resolved DeepSpeed config, a copy: DeepSpeed and the run files take it."""
        return copy.deepcopy(self.resolved_ds)

    def run_files(self, ds: dict, model_config: dict) -> dict[str, dict]:
        """The run's description (:meth:`RunDir.run_files`) with the DeepSpeed config ``ds`` the engine took and
        its model's config; the experiment's dict a copy."""
        return RunDir(self.plan.run_dir).run_files(copy.deepcopy(dict(self.experiment)), ds, model_config,
                                                   self.data_record())

    def data_record(self) -> DataRecord:
        """``data.json`` (written into every checkpoint): the shards of data.shards and of each phase's own, which
        :func:`~pipeline.train.run_setup.check_resumable` holds a resume to."""
        packed = self.indexes[ShardKind.PACKED.value]
        phases = {name: {"directory": i.directory, "fingerprint": i.fingerprint}
                  for name, i in self.indexes.items() if name.startswith("phases[")}
        return DataRecord(packed.directory, packed.fingerprint, packed.num_samples, packed.num_tokens, phases)


def check_lora_start(exp: ExperimentConfig) -> None:
    """LoRA adapts a trained model: an adapter over a preset's random weights names a base (the preset) that no
    loader can find, and its merged export is a random model with a small trained part."""
    if exp.model.lora.r and exp.model.init in PRESETS:
        raise ConfigError(f"model.lora.r: {exp.model.lora.r}, but model.init {exp.model.init!r} is a preset with "
                          f"random weights, and LoRA adapts a trained model; set model.init to a checkpoint "
                          f"directory (e.g. a run's hf/ export) or model.lora.r=0 for full-parameter training")


def check_model(exp: ExperimentConfig, tokenizer: Tokenizer, ds: dict, cuda: bool) -> ModelSpec:
    """The model the run trains, checked: a preset, or a checkpoint directory that fits ``model.shape``, the
    tokenizer and the sequence length (its config read once, here); how it runs (dtype, the attention
    implementation, LoRA, dropout, the chunked head, checkpointing) and whether its layers compile (against the
    resolved DeepSpeed config ``ds``)."""
    check_lora_start(exp)
    m, info = exp.model, tokenizer.info
    if m.init in PRESETS:
        config = preset_config(m.init, info.vocab_size, pad_token_id=info.pad_id, bos_token_id=info.bos_id,
                               eos_token_id=info.eos_id)
        try:
            if m.shape:
                check_checkpoint_shape(m.init, m.shape, config)
        except ValueError as e:  # names model.shape and model.init itself
            raise ConfigError(str(e)) from None
    else:
        try:
            config = start_checkpoint_config(m.init, info.vocab_size, bos_token_id=info.bos_id,
                                             eos_token_id=info.eos_id, shape=m.shape)
            check_sliding_window(config, m.init, exp.phases_data[-1].context)
        except ValueError as e:
            raise ConfigError(f"model.init: {e}") from None
    for i, phase in enumerate(exp.phases):  # the embedding's width is known from here on
        for j, objective in enumerate(phase.objectives):
            objective.check_embedding(f"phases[{i}].objectives[{j}]", config.hidden_size)
    check_compile(exp, ds)
    return ModelSpec(config, None if m.init in PRESETS else m.init, model_dtype(m, cuda), attn_implementation(m, cuda),
                     m.lora.r, m.lora.alpha, m.lora.dropout, tuple(m.lora.targets), m.attention_dropout,
                     m.lm_head_chunk, m.activation_checkpointing, body_compiles(exp, ds, cuda))


def router_loss_coef(exp: ExperimentConfig, config: PretrainedConfig,
                     objectives: tuple[tuple[WeightedObjective, ...], ...]) -> float | None:
    """The weight of an MoE model's router loss (None: a dense model), which needs each micro-batch's forward
    graph: refused with an objective whose grad_cache drops it."""
    coef = router_aux_coef(config, exp.model.router_aux_coef)
    cached = [o.objective.name for phase in objectives for o in phase if getattr(o.objective, "grad_cache", False)]
    if coef is not None and cached:
        raise ConfigError(f"model.init {exp.model.init!r} is a mixture-of-experts model, whose router loss needs "
                          f"each micro-batch's forward graph, which grad_cache (objective {cached[0]}) drops; set "
                          "its grad_cache=false (and train.grad_accum=1)")
    return coef


def check_setup(exp: ExperimentConfig, rank: int, world: int, cuda: bool, ds: dict | None = None) -> Prepared:
    """Everything but the shards' contents (they may not be built yet), with ``ds`` the user's DeepSpeed JSON (None:
    none, DeepSpeed's defaults) resolved against the experiment; takes and writes nothing."""
    check_run_dir(exp.run_dir)
    if rank == 0:  # rank 0 alone takes the lock and logs
        check_run_dir_free(exp.run_dir)
        check_trackers(exp.train)
    try:
        tokenizer = load_tokenizer(exp.data.tokenizer)
    except (OSError, ValueError, RuntimeError) as e:  # missing, or not a tokenizer (sentencepiece raises these)
        raise ConfigError(f"data.tokenizer: {errors.one_line(e)}") from None
    objectives = tuple(tuple(build_objectives(p, tokenizer, f"phases[{i}]")) for i, p in enumerate(exp.phases))
    bf16 = model_dtype(exp.model, cuda) == torch.bfloat16
    resolved = resolve_ds_config(ds or {}, exp, world, bf16)
    model = check_model(exp, tokenizer, resolved, cuda)
    coef = router_loss_coef(exp, model.config, objectives)
    d = exp.data
    to_build = check_packed_sources(exp, tokenizer)
    resume = resume_point(exp, world)
    if resume is not None:
        check_resumable(exp, resume, model.config.to_dict(), packed_fingerprints(exp, tokenizer, to_build))
    if d.shards in {p.directory for p in to_build} and set(d.source_mixture.names) - {UNNAMED_SOURCE} and not (d.build_source_field or
                                                                    d.build_source_default):
        raise ConfigError(f"data.mixture: mixes sources, but the shards data.build_if_missing would build into "
                          f"{d.shards} record none (one source {UNNAMED_SOURCE!r}); set data.build_source_field "
                          f"to the record field naming each document's source (SlimPajama: "
                          f"meta.redpajama_set_name), or build the shards with data_prep/build_shards.py "
                          f"--source-field")
    if shard_kind_readers(objectives)[ShardKind.UNITS] and not d.unit_shards:
        raise ConfigError("data.unit_shards: an objective reads sentence units (e.g. simcse, sscl) but "
                          "data.unit_shards is empty; build them with data_prep/build_shards.py --units and "
                          "set data.unit_shards")
    if shard_kind_readers(objectives)[ShardKind.PAIRS] and not d.pair_shards:
        raise ConfigError("data.pair_shards: the supervised objective reads (query, positive, negatives) rows but "
                          "data.pair_shards is empty; build them with data_prep/build_shards.py --pairs and set "
                          "data.pair_shards")
    validation_probes = _probes(exp.eval, tokenizer) if exp.eval.every and exp.eval.probes else []
    for i, evaluator in enumerate(exp.eval.evaluators):
        evaluator.check_files(f"eval.evaluators[{i}]")
    as_dict = to_dict(exp)
    return Prepared(tokenizer, objectives, from_experiment(exp, tokenizer), model, engine_spec(exp, cuda, coef),
                    resolved, run_plan(exp), checkpoint_spec(exp.checkpoint), trackers_spec(exp, as_dict),
                    evaluator_tasks(exp.eval.evaluators), as_dict, resume, half_written(exp.run_dir),
                    tuple(validation_probes), batch_warmup(exp.train, world))


def local_preflight(exp: ExperimentConfig, rank: int, world: int, cuda: bool, ds: dict | None = None) -> Prepared:
    """What a rank checks alone, before any process group: :func:`check_setup` (with the DeepSpeed JSON ``ds``),
    and :func:`check_shards` when every shard directory the run reads is there (else they wait for rank 0's build).
    Takes and writes nothing, so a refusal here costs no rendezvous and leaves nothing behind."""
    prepared = check_setup(exp, rank, world, cuda, ds)
    missing = build_input_files(exp, prepared.tokenizer)
    return prepared if missing else _with_shards(exp, prepared, world, rank)


def _with_shards(exp: ExperimentConfig, prepared: Prepared, world: int, rank: int) -> Prepared:
    """``prepared`` with its shards checked (:func:`~pipeline.train.shard_checks.check_shards`, by
    :func:`local_preflight`, or now that they are built) and each loader's spec."""
    if prepared.holdout is not None:
        return prepared
    shards = check_shards(exp, prepared.tokenizer, prepared.objectives, prepared.warmup, world)
    best, best_notes = keep_best(exp, prepared.objectives, prepared.probes,
                                 shards.validation.index.sources if shards.validation else ())
    v = exp.eval
    validator = (ValidationSpec(shards.validation, prepared.probes, v.micro_batch or exp.train.micro_batch,
                                exp.data.verify_shards) if v.every else None)
    return replace(prepared, indexes=shards.indexes, loaders=shards.loaders, validation=shards.validation,
                   validator=validator, holdout=shards.holdout, checkpoint=replace(prepared.checkpoint, keep=best),
                   notes=prepared.notes + ((*shards.notes, *best_notes) if rank == 0 else ()))


def _probes(v: ValidationConfig, tokenizer: Tokenizer) -> list[WeightedObjective]:
    """Validation's probes, built (their mask token resolved) once, here."""
    try:
        return probes(v, tokenizer)
    except MaskTokenError as e:
        raise ConfigError(f"eval.mask_token: the MLM and MNTP probes mask tokens: {e.what}; set eval.mask_token to a "
                          f"token of its vocabulary, or eval.probes=false") from None


@contextlib.contextmanager
def preflight(exp: ExperimentConfig, rank: int, world: int, cuda: bool = False,
              ds: dict | None = None) -> Iterator[Prepared]:
    """``with preflight(...) as prepared:`` the whole preflight in one process (rank 0 also builds missing shards),
    the run directory locked (on rank 0) until the block ends; raises the first failure."""
    with contextlib.ExitStack() as held:
        prepared = local_preflight(exp, rank, world, cuda, ds)
        if rank == 0:
            lock_run_dir(exp.run_dir, held)
            build_missing_shards(exp, prepared.tokenizer)
        yield _with_shards(exp, prepared, world, rank)


def _given(local: Prepared | Exception) -> Prepared:
    if isinstance(local, Exception):
        raise local
    return local


def agreed_preflight(exp: ExperimentConfig, rank: int, world: int, cuda: bool, held: contextlib.ExitStack,
                     local: Prepared | Exception, on_failure: Callable[[], None] = lambda: None) -> Prepared | None:
    """The rest of :func:`preflight` once the process group runs, each check agreed by every rank: the same run
    and code, each rank's :func:`local_preflight` (``local``: its result, or its failure, which rank 0 reports),
    rank 0's lock of the run directory (until ``held`` closes), its build of missing shards, and their checks.
    None when any rank failed (rank 0 said why). ``on_failure`` runs on every rank before the report (the
    trainer's stop request then holds signals)."""
    try:
        agreed(rank, world, lambda: check_same_run(exp, world), on_failure)
        prepared = agreed(rank, world, lambda: _given(local), on_failure)
        notes = agreed(rank, world, lambda: lock_run_dir(exp.run_dir, held) if rank == 0 else [], on_failure)
        agreed(rank, world, lambda: build_missing_shards(exp, prepared.tokenizer) if rank == 0 else None, on_failure)
        prepared = agreed(rank, world, lambda: _with_shards(exp, prepared, world, rank), on_failure)
        return replace(prepared, notes=(*notes, *prepared.notes))
    except PreflightFailed:
        return None
