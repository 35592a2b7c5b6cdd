"""The trainer: one run's state and the loop over its optimizer steps.

:meth:`Trainer.build` sets a run up from preflight's hand-over (:class:`~pipeline.train.preflight.Prepared`: the
model spec, the DeepSpeed config, the run's plan, each collaborator's spec, the resume point), each part by one call
from its spec: the DeepSpeed engine with the LR schedule, run files, loaders, resume. :meth:`Trainer.fit` is the
loop, its phases and cadences the plan's (:class:`~pipeline.train.plan.RunPlan`); neither reads the experiment.
Each step is its batches, :func:`~pipeline.train.step.train_step` and the state advanced; all else around it
(validation, evaluators, the record, the divergence guard, keep-best, checkpoint and stop) are the callbacks of
:mod:`pipeline.train.callbacks`, in their order. Each collaborator has one job: :func:`~pipeline.train.step.train_step` the
optimizer step, :class:`~pipeline.train.checkpoint.Checkpointer` resume and save of the engine and the
:class:`~pipeline.train.state.TrainState` (steps, tokens, loader positions),
:class:`~pipeline.train.metrics.MetricsLogger` metrics.jsonl, the trackers and the console line,
:class:`~pipeline.train.guard.DivergenceGuard` bad steps, :class:`~pipeline.train.signals.StopRequest` the stop
signal, :class:`~pipeline.train.validation.Validator` the held-out evaluation when due and
:class:`~pipeline.train.evaluators.TrainingEvaluators` the evaluation tasks beside it,
:func:`~pipeline.train.export.export_engine` the HF export at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import deepspeed
import torch
import torch.distributed as dist

from pipeline.data.format.index import ShardKind
from pipeline.data.loading.loader import ShardLoader
from pipeline.export.record import EncoderRecord
from pipeline.model.flops import device_peak_tflops, work_flops
from pipeline.model.rope import rope_parameter_sets, set_rope
from pipeline.run_dir import RunDir, tag
from pipeline.train.callbacks import Callback, StepEnd, Unread, fit_callbacks
from pipeline.train.checkpoint import Checkpointer
from pipeline.train.ds_config import sharding_note
from pipeline.train.evaluators import TrainingEvaluators
from pipeline.train.export import export_best, export_engine
from pipeline.train.fit_summary import BestExport, FitSummary
from pipeline.train.guard import DivergenceGuard
from pipeline.train.metrics import MetricsLogger, Throughput
from pipeline.train.module import build_engine, parameter_line
from pipeline.train.phases import WeightedObjective, at_step
from pipeline.train.plan import RunPlan
from pipeline.train.preflight import Prepared
from pipeline.train.signals import StopRequest
from pipeline.train.state import TrainState
from pipeline.train.step import target_counts, train_step
from pipeline.train.validation import Validator


@dataclass
class Trainer:
    plan: RunPlan
    engine: deepspeed.DeepSpeedEngine
    lm: torch.nn.Module  # the HF model inside the engine
    tokenizer: object
    objectives: Sequence[Sequence[WeightedObjective]]  # per phase
    record: EncoderRecord  # what the HF export says of how to read the model
    state: TrainState  # what a checkpoint carries besides the engine: steps, tokens, the loaders
    checkpoints: Checkpointer
    metrics: MetricsLogger
    throughput: Throughput
    guard: DivergenceGuard
    stop: StopRequest
    device: torch.device
    validator: Validator | None = None  # None without eval.every
    evaluators: TrainingEvaluators | None = None  # None without eval.evaluators
    rope_phase: int = field(init=False, default=-1)  # the phase whose RoPE settings the model holds (-1: the start's)
    callbacks: list[Callback] = field(init=False)  # fit's concerns around each step, in the order they run

    @classmethod
    def build(cls, prepared: Prepared, stop: StopRequest, device: torch.device) -> Trainer:
        """Set the run up from what :func:`pipeline.train.preflight.agreed_preflight` checked and decided (it checks
        nothing again) and resume it from the checkpoint preflight found."""
        rank, world = dist.get_rank(), dist.get_world_size()
        plan = prepared.plan
        torch.manual_seed(plan.seed)
        tokenizer, objectives, index = prepared.tokenizer, prepared.objectives, prepared.indexes[ShardKind.PACKED]
        ds = prepared.ds_config()
        lm, engine = build_engine(ds, prepared.model, prepared.engine, [o.objective for p in objectives for o in p])
        if rank == 0:
            print(f"model {plan.model}: {parameter_line(engine.module)}", flush=True)
            note = sharding_note(ds, world, device.type == "cuda")
            if note:
                print(note, flush=True)
        run = RunDir(plan.run_dir)
        files = prepared.run_files(ds, lm.config.to_dict())
        if rank == 0:
            run.write_run_files(files)
        pin = device.type == "cuda"
        loaders = {name: ShardLoader(s.index, s.micro_batch, s.grad_accum, rank, world, s.seed, s.workers,
                                     pin_memory=pin, verify=s.verify, mixture=s.mixture, plan=s.plan,
                                     holdout=s.holdout, warmup=s.warmup, same_task=s.same_task)
                   for name, s in prepared.loaders.items()}
        validator = Validator(prepared.validator) if prepared.validator is not None else None
        evaluators = (TrainingEvaluators(prepared.evaluators, tokenizer, prepared.record, plan.run_dir)
                      if prepared.evaluators else None)
        checkpoints = Checkpointer(engine, run, prepared.checkpoint, files)
        state = TrainState(loaders, source_tokens=dict.fromkeys(index.sources if len(index.sources) > 1 else (), 0))
        if checkpoints.resume(state, prepared.resume, prepared.half_written) and rank == 0:
            print(f"resumed from {tag(state.step)} ({state.tokens_seen:,} tokens seen)")
        return cls(plan, engine, lm, tokenizer, objectives, prepared.record, state, checkpoints,
                   MetricsLogger(run, rank == 0, plan.log_every, start_step=state.step, trackers=prepared.trackers),
                   Throughput(device_peak_tflops(plan.peak_tflops), world),
                   DivergenceGuard(plan.max_bad_steps, skipped_before=engine.skipped_steps), stop, device,
                   validator, evaluators)

    def __post_init__(self):
        self.callbacks = fit_callbacks(self.validator, self.evaluators)

    def fit(self) -> FitSummary:
        """Train to ``train.steps``, or until a stop; returns the summary. Each step: its batches, ``train_step``,
        the state advanced, then the callbacks (:mod:`pipeline.train.callbacks`, which say in which order)."""
        for callback in self.callbacks:
            callback.pre_train(self)
        started = time.time()
        unread: Unread | None = None  # the newest step whose numbers are still on their way from the device
        while self.state.step < self.plan.steps:
            trained = self._train_step()
            if unread is not None:  # the previous step, read while this one runs; its time: from start to start
                self.log(unread, self._scalars(unread, trained.started - unread.started))
            end = StepEnd(trained)
            for callback in self.callbacks:
                callback.post_step(self, end)
            unread = trained if end.scalars is None else None
            if end.stopping:
                break
        for callback in self.callbacks:
            callback.post_train(self)
        return self._finish(started)

    def _train_step(self) -> Unread:
        """The next step: the phase's batches, ``train_step`` (queued on the device), the state advanced."""
        t0 = time.time()
        state, plan = self.state, self.plan
        phase_idx = plan.phase_at(state.step)
        phase = plan.phases[phase_idx]
        self._enter_phase(phase_idx)
        mask_ratios = at_step(self.objectives[phase_idx], state.step - phase.start, phase.steps)
        batches, local_tokens, counts = self._next_batches(self.objectives[phase_idx], phase.loader)
        world = dist.get_world_size()
        t_data = time.time() - t0
        result = train_step(self.engine, self.objectives[phase_idx], batches, world, plan.grad_accum,
                            state.sources if phase.loader == ShardKind.PACKED else (), counts)
        tokens = world * local_tokens
        state.advance(tokens)
        packed = batches.get(ShardKind.PACKED)
        host = (mask_ratios | {"batch/tokens": tokens}  # the step's numbers the host already has
                | {f"batch/samples/{kind}": world * sum(len(b.keys) for b in bs) for kind, bs in batches.items()}
                | ({"progress/seq_len": packed[0].input_ids.shape[1]} if packed else {})
                | {"model/rope_theta": rope_parameter_sets(self.lm.config)[0]["rope_theta"]})
        return Unread(state.step, phase_idx, phase.name, result, tokens, t0, t_data, self.engine.skipped_steps,
                      state.tokens_seen, host)

    def read(self, end: StepEnd) -> dict[str, float]:
        """The step's record, read now (once) instead of while the next step runs."""
        if end.scalars is None:
            end.scalars = self._scalars(end.trained)
        return end.scalars

    def log(self, s: Unread, scalars: dict[str, float]) -> None:
        """Step ``s``'s record to every callback's ``log_metrics``."""
        for callback in self.callbacks:
            callback.log_metrics(self, s, scalars)

    def _scalars(self, s: Unread, seconds: float | None = None) -> dict[str, float]:
        """Step ``s``'s metrics, its numbers read back (waiting for their copy from the device, not for later
        work). ``seconds``: the step's time, measured after the read-back when not given."""
        losses, grad_norm = s.result.losses, s.result.grad_norm
        seconds = time.time() - s.started if seconds is None else seconds
        return ({f"loss/{n}": v for n, v in losses.items()}
                | {f"acc/{n}": v for n, v in s.result.accuracy.items()}
                | {"optim/lr": s.result.lr, "optim/grad_norm": grad_norm, "optim/skipped_steps": s.skipped_steps}
                | self.throughput.scalars(s.tokens, seconds, s.data_seconds, work_flops(self.lm.config, s.result.work))
                | {"progress/tokens_seen": s.tokens_seen, "progress/phase": s.phase_idx} | s.host
                | self._source_scalars(s.result))

    def _source_scalars(self, result) -> dict[str, float]:
        """``source_loss/<output>/<source>`` of the step, ``progress/source_tokens/<source>`` so far."""
        for src, n in result.source_tokens.items():
            self.state.source_tokens[src] += n
        return ({f"source_loss/{name}/{src}": v for name, by in result.source_losses.items() for src, v in by.items()}
                | {f"progress/source_tokens/{src}": n for src, n in self.state.source_tokens.items()})

    def _enter_phase(self, phase_idx: int) -> None:
        """The phase's RoPE theta and context on the model before its first step (and a resumed run's first),
        a function of the phase alone, so a resume continues with the settings the run had."""
        if phase_idx == self.rope_phase:
            return
        phase, self.rope_phase = self.plan.phases[phase_idx], phase_idx
        if set_rope(self.lm, phase.rope_theta, phase.context) and dist.get_rank() == 0:
            print(f"phase {phase.name}: seq_len {phase.seq_len}, RoPE "
                  f"{self.lm.config.rope_parameters}, max_position_embeddings "
                  f"{self.lm.config.max_position_embeddings}", flush=True)

    def _next_batches(self, step_objs: list[WeightedObjective], packed: str) -> tuple[dict[str, list], int, list]:
        """The step's micro-batches of each shard kind its objectives read, on the device (the packed ones from the
        loader ``packed``, the phase's), this rank's non-padding tokens in them and the objectives' targets
        (``target_counts``), counted on the host copies (counting on the device would wait for it). The copies are
        asynchronous: the loaders pin the host memory on CUDA."""
        host = {kind: self.state.loaders[packed if kind == ShardKind.PACKED else kind].next_global_step()
                for kind in sorted({o.objective.shard_kind for o in step_objs})}
        tokens = sum(int((b.doc_ids >= 0).sum()) for bs in host.values() for b in bs)
        return ({kind: [b.to(self.device, non_blocking=True) for b in bs] for kind, bs in host.items()}, tokens,
                target_counts(step_objs, host))

    def _finish(self, started: float) -> FitSummary:
        """The HF export of a finished healthy run, the summary; the trackers and the loaders closed."""
        state = self.state
        elapsed_s = round(time.time() - started, 1)  # the loop's time, without the exports
        plan = self.plan
        finished = state.step == plan.steps and self.guard.healthy
        hf_export = None
        if finished and plan.export_hf:
            hf_export = export_engine(self.engine, self.lm, self.tokenizer, RunDir(plan.run_dir), self.record,
                                      plan.export_sentence_transformers, state.step, state.tokens_seen)
        best = self.checkpoints.best
        best_export = None
        if finished and best is not None:
            best_export = BestExport(plan.keep_best, best.step, best.value,
                                     export_best(RunDir(plan.run_dir), best.step))
        summary = self.metrics.close(FitSummary(state.step, state.tokens_seen, elapsed_s, plan.run_dir, hf_export,
                                                best_export))
        for loader in state.loaders.values():
            loader.close()
        return summary

