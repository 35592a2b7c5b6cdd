"""The trainer's loop in process: the divergence guard, checkpoints and the stop request working together, and a
phase's losses kept apart by name, on a small fake engine (what the loop uses of DeepSpeed's, over a real model,
AdamW, real shards and the real checkpoint path) in a one-rank gloo group. The same interplay under DeepSpeed on
2 ranks: tests/e2e/test_failure_modes.py and tests/e2e/test_train_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from helpers import MASK, SPECIAL_IDS, logged_steps, make_shard_dir, packed_text_batch

from pipeline.config import ConfigError, from_dict
from pipeline.data.format.index import load_index
from pipeline.data.loading.loader import ShardLoader
from pipeline.experiment import SAMPLE_DIR, ExperimentConfig, PhaseSpec
from pipeline.export.record import EncoderRecord
from pipeline.model.build import build_model, model_spec
from pipeline.objectives import OBJECTIVES, Masking, make_objective
from pipeline.run_dir import MARKER, RunDir
from pipeline.tokenizer import load_tokenizer
from pipeline.train.async_checkpoint import wait_for_ranks, written_marker
from pipeline.train.callbacks import Callback
from pipeline.train.checkpoint import Checkpointer, save
from pipeline.train.device_reads import DeviceReads
from pipeline.train.fit_summary import BestExport, FitSummary
from pipeline.train.guard import Diverged, DivergenceGuard
from pipeline.train.metrics import MetricsLogger, Throughput
from pipeline.train.module import TrainModule
from pipeline.train.phases import WeightedObjective, build_objectives
from pipeline.train.plan import checkpoint_spec, run_plan
from pipeline.train.run_setup import ResumePoint, half_written
from pipeline.train.signals import STOP_SIGNALS, StopRequest
from pipeline.train.state import TrainState
from pipeline.train.step import target_counts, train_step
from pipeline.train.trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def stop():
    """The real stop request; the test process's own signal handlers are given back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield StopRequest(rank=0)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class FakeEngine:
    """What the trainer and ``train_step`` call on a DeepSpeed engine. ``skip`` holds optimizer steps whose update
    is skipped, as DeepSpeed skips an update with an inf gradient norm; ``on_step`` runs after each optimizer step."""

    def __init__(self, module: TrainModule, skip=(), on_step=lambda step: None):
        self.module, self.skip, self.on_step = module, set(skip), on_step
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        self.steps, self.skipped_steps, self.grad_norm = 0, 0, 0.0
        self.boundary = True
        self.checkpoint_engine = TorchCheckpointEngine()  # replaced by checkpoint.async_save's (save_checkpoint
        # below writes its file itself; the RNG files and written-rank<r> markers go through the writer thread)

    def set_gradient_accumulation_boundary(self, boundary: bool):
        self.boundary = boundary  # the trainer marks the micro-step that ends the optimizer step

    def __call__(self, objective, batch, *counts):
        return self.module(objective, batch, *counts)

    def backward(self, loss):
        loss.backward()

    def step(self):
        if not self.boundary:  # DeepSpeed's step() only accumulates before the boundary
            return
        self.steps += 1
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), float("inf")))
        if self.steps in self.skip:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        self.on_step(self.steps)

    def get_lr(self):
        return [self.optimizer.param_groups[0]["lr"]]

    def get_global_grad_norm(self):
        return self.grad_norm

    def save_checkpoint(self, root, tag, client_state):
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        torch.save({"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "client": client_state}, os.path.join(root, tag, "state.pt"))

    def load_checkpoint(self, root, tag, load_module_strict):
        state = torch.load(os.path.join(root, tag, "state.pt"), weights_only=False)
        self.module.load_state_dict(state["module"], strict=load_module_strict)
        self.optimizer.load_state_dict(state["optimizer"])
        return os.path.join(root, tag), state["client"]


def objectives_of(phase: PhaseSpec) -> list[WeightedObjective]:
    """The phase's objectives over make_shard_dir's ids: a masking one masks with its MASK id and replaces with the
    regular ids, as one built from a tokenizer of those shards would."""
    regular = torch.arange(len(SPECIAL_IDS), 64)
    return [WeightedObjective(s.name, s.weight, OBJECTIVES[s.name](s, Masking(s.ratio, s.policy, MASK, regular))
                              if OBJECTIVES[s.name].masks else make_objective(s), s.log_as) for s in phase.objectives]


def trainer(tmp_path, stop, steps=8, every=2, max_bad_steps=2, phases=None, stop_at_step=0, log_every=100,
            async_save=False,
            **engine) -> Trainer:
    shards = make_shard_dir(tmp_path, num_samples=64, seq_len=32)
    exp = from_dict(ExperimentConfig, {"run_dir": str(tmp_path / "run"), "train": {
        "steps": steps, "micro_batch": 2, "max_bad_steps": max_bad_steps, "export_hf": False, "log_every": log_every,
        "stop_at_step": stop_at_step}, "optim": {"warmup_steps": 0, "decay_steps": 0},
        "checkpoint": {"every": every, "keep_last": 5, "async_save": async_save}, **({"phases": phases} if phases else {})})
    torch.manual_seed(0)
    lm = build_model(model_spec("tiny", 64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    fake = FakeEngine(TrainModule(lm), **engine)
    run = RunDir(exp.run_dir)
    objectives = [objectives_of(p) for p in exp.phases]
    return Trainer(run_plan(exp), fake, lm, None, objectives, EncoderRecord(),
                   TrainState({"packed": ShardLoader(load_index(shards), 2, 1, 0, 1, 0)}),
                   Checkpointer(fake, run, checkpoint_spec(exp.checkpoint), {}), MetricsLogger(run, True, log_every),
                   Throughput(0.0, 1), DivergenceGuard(max_bad_steps), stop, torch.device("cpu"))


def test_a_stop_signal_checkpoints_the_step_it_stops_at(tmp_path, stop, capsys):
    t = trainer(tmp_path, stop, on_step=lambda step: step == 3 and os.kill(os.getpid(), signal.SIGUSR1))
    summary = t.fit()
    assert t.state.step == 3 and summary == FitSummary(3, t.state.tokens_seen, summary.elapsed_s, t.plan.run_dir,
                                                       loss_plot=RunDir(t.plan.run_dir).loss_plot)
    assert RunDir(t.plan.run_dir).complete_steps() == [2, 3]  # step 3 is off the every-2 grid: saved for the stop
    out = capsys.readouterr().out
    assert "stopped at step 3 (checkpointed) on SIGUSR1; start the same command again to resume" in out
    assert f"summary: steps=3 tokens_seen={t.state.tokens_seen} elapsed_s={summary.elapsed_s} run_dir=" \
           f"{t.plan.run_dir} loss_plot={RunDir(t.plan.run_dir).loss_plot}\n" in out  # no export of a stopped run
    assert logged_step_numbers(t.plan.run_dir) == [1, 2, 3]  # the stop step's record is written before it stops
    client = torch.load(os.path.join(RunDir(t.plan.run_dir).checkpoint(3), "state.pt"), weights_only=False)["client"]
    assert client["step"] == 3 and client["loaders"]["packed"]["samples_consumed"] == 3 * 2


def test_the_summary_is_frozen_and_its_line_names_the_fields_set_in_order():
    """The console's summary line as before the summary was typed: the best checkpoint as its mapping."""
    summary = FitSummary(8, 4096, 1.5, "runs/x", hf_export="runs/x/hf",
                         best=BestExport("eval/sts_avg", 6, 0.71, "runs/x/hf-best"))
    assert summary.line() == ("summary: steps=8 tokens_seen=4096 elapsed_s=1.5 run_dir=runs/x hf_export=runs/x/hf "
                              "best={'metric': 'eval/sts_avg', 'step': 6, 'value': 0.71, 'hf': 'runs/x/hf-best'}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary.steps = 9


def test_bad_steps_write_no_checkpoint_and_diverge_keeping_the_last_good_one(tmp_path, stop):
    t = trainer(tmp_path, stop, skip={4, 5})
    with pytest.raises(Diverged, match=r"2 bad steps in a row .* up to step 5.* the last good checkpoint is "
                                       r".*step00000002"):
        t.fit()
    assert RunDir(t.plan.run_dir).complete_steps() == [2]  # step 4 was due but bad


def logged_step_numbers(run_dir: str) -> list[int]:
    """The steps in ``metrics.jsonl`` so far, in the order written."""
    if not os.path.exists(RunDir(run_dir).metrics):
        return []
    with open(RunDir(run_dir).metrics) as f:
        return [json.loads(line)["step"] for line in f]


def test_one_bad_step_delays_the_checkpoint_and_the_run_goes_on(tmp_path, stop):
    """Also: a step's record is written while the next step runs, except at a checkpoint step (the guard's verdict
    comes first); every step is logged once, in order."""
    logged = {}
    t = trainer(tmp_path, stop, skip={4}, on_step=lambda step: logged.update({step: logged_step_numbers(t.plan.run_dir)}))
    assert t.fit().steps == 8
    assert RunDir(t.plan.run_dir).complete_steps() == [2, 6, 8]
    assert {n: steps[-1] if steps else 0 for n, steps in logged.items()} == \
        {n: n - 2 if n % 2 == 0 else n - 1 for n in range(1, 9)}  # every=2: odd steps wait for the next one
    assert logged_step_numbers(t.plan.run_dir) == list(range(1, 9))


def test_the_callbacks_run_in_olmo_cores_hook_order_by_priority(tmp_path, stop):
    """``pre_train``; each step's record (``log_metrics``) while the next step runs, then that step's ``post_step``;
    a checkpoint step's record at once, inside ``post_step``, before the checkpoint (a callback of priority 45 sees
    the record and not yet the save); ``post_train`` (the last checkpoint) after the loop."""
    seen = []

    class Spy(Callback):
        priority = 45  # after keep-best (50), before the checkpoint (40)

        def pre_train(self, fit):
            seen.append("pre_train")

        def log_metrics(self, fit, s, scalars):
            seen.append(f"record {s.step}")

        def post_step(self, fit, end):
            seen.append(f"post_step {end.trained.step} saved {fit.checkpoints.last_saved}")

        def post_train(self, fit):
            seen.append("post_train")

    t = trainer(tmp_path, stop, steps=4, every=2)
    t.callbacks = sorted([*t.callbacks, Spy()], key=lambda c: -c.priority)
    t.fit()
    assert seen == ["pre_train", "post_step 1 saved 0", "record 1", "record 2", "post_step 2 saved 0",
                    "post_step 3 saved 2", "record 3", "record 4", "post_step 4 saved 2", "post_train"]


def test_a_stop_on_a_bad_step_keeps_the_last_good_checkpoint(tmp_path, stop, capsys):
    t = trainer(tmp_path, stop, max_bad_steps=3, skip={3},
                on_step=lambda step: step == 3 and os.kill(os.getpid(), signal.SIGTERM))
    assert t.fit().steps == 3
    assert RunDir(t.plan.run_dir).complete_steps() == [2]  # the bad newest step is not saved, not even at the end
    assert "stopped at step 3 (not checkpointed: the newest step was bad; the last good checkpoint is" in \
        capsys.readouterr().out


def test_a_restart_drops_half_written_checkpoints_whose_markers_would_complete_its_own(tmp_path, stop):
    """A run killed after its ranks wrote step 4's files and ``written-rank<r>`` markers, before ``COMPLETE``,
    leaves them behind; the restart writes step 4 again, and rank 0's completer used to take the old markers for
    the new files written and mark the checkpoint complete while they were still being written (a kill then left
    a complete checkpoint with missing files). Found while building bench/chaos_soak.py."""
    first = trainer(tmp_path, stop, steps=4, async_save=True)
    first.fit()
    run = RunDir(first.plan.run_dir)
    os.remove(os.path.join(run.checkpoint(4), MARKER))  # what a kill before the marker leaves
    assert os.path.exists(written_marker(run.checkpoint(4), 0))
    again = trainer(tmp_path, stop, steps=4, async_save=True)  # the restart: a new process
    assert again.checkpoints.resume(again.state, ResumePoint(2, 1), half_written(run.path)) and again.state.step == 2
    assert run.checkpoint_steps() == [2]  # the complete one kept, the half-written one gone
    release = threading.Event()
    again.checkpoints.writer.submit(release.wait)  # this rank's files of the save below are not written yet
    again.state.step = 4
    ckpt = again.checkpoints
    save(again.engine, run, 4, again.state.state_dict(), {}, 5, 0, ckpt.writer, ckpt.completer)  # Checkpointer.save's
    with pytest.raises(RuntimeError, match="rank 0 did not finish writing"):  # what rank 0's completer sees
        wait_for_ranks(run.checkpoint(4), 1, timeout_s=0)
    assert run.complete_steps() == [2]
    release.set()
    again.checkpoints.wait()
    assert run.complete_steps() == [2, 4]


def test_a_masking_ratio_schedule_is_logged_and_a_resume_inside_it_continues_it_exactly(tmp_path, stop, capsys):
    """CLM for 2 steps, then MLM (and MNTP logged as ``m``) whose ratios fall over the phase's last two thirds, at
    another RoPE theta: each step logs the ratio it masked at (on the console line too) and the theta it trained
    with (a TensorBoard scalar), and a run stopped inside the fall and resumed through the checkpoint logs the
    uninterrupted run's ratios and losses bit for bit."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fall = {"shape": "linear", "final": 0.1, "start": 0.2}
    phases = [{"share": 0.25, "objectives": [{"name": "clm"}]},
              {"share": 0.75, "rope_theta": 40000.0,
               "objectives": [{"name": "mlm", "ratio": 0.4, "ratio_schedule": fall},
                              {"name": "mntp", "log_as": "m", "ratio_schedule": {"shape": "step", "steps": [[0.5, 0.2]]}}]}]
    whole = trainer(tmp_path / "whole", stop, phases=phases, log_every=1)
    whole.fit()
    logged = logged_steps(whole.plan.run_dir)
    t = [min(max((i / 5 - 0.2) / 0.8, 0.0), 1.0) for i in range(6)]  # steps 3-8 are steps 0-5 of the MLM phase
    assert [logged[s].get("mask_ratio/mlm") for s in range(1, 9)] == pytest.approx(
        [None, None, *(0.4 * (1 - x) + 0.1 * x for x in t)], abs=1e-12)
    assert [logged[s].get("mask_ratio/m") for s in range(1, 9)] == [None, None, 0.3, 0.3, 0.3, 0.2, 0.2, 0.2]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split("]")[0] for line in lines] == [f"step {s:>6} [{'clm' if s < 3 else 'mlm+mntp'}" for s in range(1, 9)]
    assert "mask_ratio" not in lines[1] and " mask_ratio/mlm=0.400 mask_ratio/m=0.300 lr=" in lines[2]
    assert f" mask_ratio/mlm={logged[8]['mask_ratio/mlm']:.3f} mask_ratio/m=0.200 lr=" in lines[7]
    board = EventAccumulator(RunDir(whole.plan.run_dir).tensorboard).Reload().Scalars("model/rope_theta")
    assert [(e.step, e.value) for e in board] == [(s, 10000.0 if s < 3 else 40000.0) for s in range(1, 9)]
    first = trainer(tmp_path / "resumed", stop, phases=phases, stop_at_step=5)
    assert first.fit().steps == 5
    resumed = trainer(tmp_path / "resumed", stop, phases=phases)  # a new process: fresh model and objectives
    assert resumed.checkpoints.resume(resumed.state, ResumePoint(5, 1))  # what Trainer.build does
    assert (resumed.state.step, resumed.state.tokens_seen) == (5, first.state.tokens_seen)
    resumed.fit()
    again = logged_steps(resumed.plan.run_dir)
    assert sorted(again) == [6, 7, 8]
    for s in again:
        assert {k: v for k, v in again[s].items() if k.startswith(("loss/", "mask_ratio/"))} == \
            {k: v for k, v in logged[s].items() if k.startswith(("loss/", "mask_ratio/"))}, s


def test_two_objectives_of_one_loss_name_are_refused_or_kept_apart():
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    two = [{"name": "mlm", "ratio": 0.2}, {"name": "mlm", "ratio": 0.4}]
    with pytest.raises(ConfigError, match=r"phases\[0\]\.objectives\[1\]: its loss 'mlm' has the name of a loss of "
                                          r"phases\[0\]\.objectives\[0\].*phases\[0\]\.objectives\[1\]\.log_as=mlm1"):
        build_objectives(from_dict(PhaseSpec, {"objectives": two}), tokenizer, "phases[0]")
    with pytest.raises(ConfigError, match=r"its loss 'mntp' has the name"):
        build_objectives(from_dict(PhaseSpec, {"objectives": [{"name": "magnet"}, {"name": "mntp"}]}), tokenizer,
                         "phases[0]")
    two[1]["log_as"] = "mlm40"
    magnet = {"name": "magnet", "log_as": "magnet"}
    objectives = build_objectives(from_dict(PhaseSpec, {"objectives": [*two, magnet, {"name": "mntp"}]}), tokenizer)
    torch.manual_seed(0)
    lm = build_model(model_spec("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                     bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id))
    batch = packed_text_batch(tokenizer, ["The river rises in the hills and flows south to the sea."] * 8)
    result = train_step(FakeEngine(TrainModule(lm)), objectives, {"packed": [batch]}, 1, 1)
    assert set(result.losses) == set(result.accuracy) == {"mlm", "mlm40", "magnet/mntp", "magnet/msg", "mntp"}
    counts = {name: n for o in objectives for loss, n in o.objective.num_targets(batch).items()
              for name in [o.loss_name(loss)]}
    assert counts["mlm40"] > counts["mlm"] > 0  # each normalised by its own targets, not by their sum


def host_tensors(*batches) -> list[torch.Tensor]:
    """The batches' tensors: the host's own (on the CPU every other tensor stands for a device tensor)."""
    return [v for b in batches for v in vars(b).values() if isinstance(v, torch.Tensor)]


def test_a_step_reads_nothing_back():
    """A CLM + MNTP + MAGNET step of 2 micro-batches, its targets counted on the host copies as the trainer does
    (``target_counts``): the step reads nothing back (``DeviceReads``, every library's reads; the engine's own
    optimizer step aside): the plain-or-masked attention choice is made on the host copy. No read per loss for its
    targets (``nonzero_static`` of the host's count), none for MAGNET's span check (made on the host copy), none
    for the masking pool (copied to the device once), none for the results and the grad norm (one non-blocking
    copy, read later from the host: ``StepResult``). Losses bit-identical to counting them in the step. Before:
    14 reads for CLM + MAGNET alone (a nonzero per loss and micro-batch, the span check, results, grad norm); 36
    before that."""
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    spec = {"objectives": [{"name": "clm"}, {"name": "mntp"}, {"name": "magnet", "log_as": "magnet"}]}
    objectives = build_objectives(from_dict(PhaseSpec, spec), tokenizer)
    batch = packed_text_batch(tokenizer, ["The river rises in the hills and flows south to the sea."] * 8)
    batches = {"packed": [batch, batch]}
    results = []
    for host_counts in (False, True):
        torch.manual_seed(0)
        lm = build_model(model_spec("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id))
        counts = target_counts(objectives, batches) if host_counts else None
        with DeviceReads(host=host_tensors(batch)) as reads:
            results.append(train_step(FakeEngine(TrainModule(lm)), objectives, batches, 1, 2, counts=counts))
    assert [site for site in reads.sites if "test_trainer" not in site] == []  # FakeEngine's grad norm aside
    assert results[1].losses == results[0].losses and set(results[1].losses) == {"clm", "mntp", "magnet/mntp",
                                                                               "magnet/msg"}
    assert results[1].grad_norm == results[0].grad_norm > 0


def test_losses_per_source_add_no_host_read_and_average_to_the_loss():
    """A batch of two sources: the step's losses are those of the same step without sources (bit for bit), each
    source's loss is its own targets' mean (so the target-weighted mean of the sources' losses is the loss), the
    tokens per source are counted, and no host read is added: the sums stay on the device to the step's one
    copy back. The targets are counted on the host, as the trainer does (each row's loss from the static gather)."""
    tokenizer = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    spec = {"objectives": [{"name": "clm"}, {"name": "mlm", "ratio": 0.4}, {"name": "magnet", "log_as": "magnet"}]}
    objectives = build_objectives(from_dict(PhaseSpec, spec), tokenizer)
    texts = ["The river rises in the hills and flows south to the sea.", "Now is the winter of our discontent."]
    batch = packed_text_batch(tokenizer, texts * 4)
    results, reads = [], []
    for sources in ((), ("a", "b")):
        torch.manual_seed(0)
        lm = build_model(model_spec("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id))
        batch.source_ids = torch.tensor([0, 1, 1, 0]) if sources else None
        batches = {"packed": [batch, batch]}
        counts = target_counts(objectives, batches)  # on the host copies, as the trainer does
        with DeviceReads(host=host_tensors(batch)) as counted:
            results.append(train_step(FakeEngine(TrainModule(lm)), objectives, batches, 1, 2, sources, counts))
        reads.append(counted.sites)
    plain, by_source = results
    assert by_source.losses == plain.losses and reads[1] == reads[0]
    assert set(by_source.source_losses) == {"clm", "mlm", "magnet/mntp", "magnet/msg"} and not plain.source_losses
    batch.source_ids = torch.tensor([0, 1, 1, 0])
    for o in objectives[:2]:
        rows = o.objective.targets(batch).predict_at.sum(-1).double()
        targets = {"a": float(rows[[0, 3]].sum()), "b": float(rows[[1, 2]].sum())}
        mean = sum(by_source.source_losses[o.name][s] * n for s, n in targets.items()) / sum(targets.values())
        assert mean == pytest.approx(by_source.losses[o.name], rel=1e-6)
    tokens = (batch.doc_ids >= 0).sum(-1)
    assert by_source.source_tokens == {"a": 2 * int(tokens[[0, 3]].sum()), "b": 2 * int(tokens[[1, 2]].sum())}
