"""The trainer's loop in process: the divergence guard, checkpoints and the stop request working together, and a
phase's losses kept apart by name, on a small fake engine (what the loop uses of DeepSpeed's, over a real model,
AdamW, real shards and the real checkpoint path) in a one-rank gloo group. The same interplay under DeepSpeed on
2 ranks: tests/e2e/test_failure_modes.py and tests/e2e/test_train_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from helpers import MASK, SPECIAL_IDS, logged_steps, make_shard_dir, packed_text_batch
from torch.overrides import TorchFunctionMode

from pipeline.config import ConfigError, from_dict
from pipeline.data.format.index import load_index
from pipeline.data.loading.loader import ShardLoader
from pipeline.experiment import SAMPLE_DIR, ExperimentConfig, PhaseSpec
from pipeline.export.record import EncoderRecord
from pipeline.model.build import build_model
from pipeline.objectives import OBJECTIVES, Masking, make_objective
from pipeline.run_dir import RunDir
from pipeline.tokenizer import load_tokenizer
from pipeline.train.checkpoint import Checkpointer
from pipeline.train.guard import Diverged, DivergenceGuard
from pipeline.train.metrics import MetricsLogger, Throughput
from pipeline.train.module import TrainModule
from pipeline.train.phases import WeightedObjective, build_objectives
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


def trainer(tmp_path, stop, steps=8, every=2, max_bad_steps=2, phases=None, stop_at_step=0, **engine) -> Trainer:
    shards = make_shard_dir(tmp_path, num_samples=64, seq_len=32)
    exp = from_dict(ExperimentConfig, {"run_dir": str(tmp_path / "run"), "train": {
        "steps": steps, "micro_batch": 2, "max_bad_steps": max_bad_steps, "export_hf": False, "log_every": 100,
        "stop_at_step": stop_at_step}, "optim": {"warmup_steps": 0, "decay_steps": 0},
        "checkpoint": {"every": every, "keep_last": 5}, **({"phases": phases} if phases else {})})
    torch.manual_seed(0)
    lm = build_model("tiny", 64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fake = FakeEngine(TrainModule(lm), **engine)
    run = RunDir(exp.run_dir)
    objectives = [objectives_of(p) for p in exp.phases]
    return Trainer(exp, fake, lm, None, objectives, EncoderRecord(),
                   TrainState({"packed": ShardLoader(load_index(shards), 2, 1, 0, 1, 0)}),
                   Checkpointer(fake, run, exp.checkpoint, {}), MetricsLogger(run, True, 100),
                   Throughput(0.0, 1), DivergenceGuard(max_bad_steps), stop, torch.device("cpu"))


def test_a_stop_signal_checkpoints_the_step_it_stops_at(tmp_path, stop, capsys):
    t = trainer(tmp_path, stop, on_step=lambda step: step == 3 and os.kill(os.getpid(), signal.SIGUSR1))
    summary = t.fit()
    assert summary["steps"] == 3 and t.state.step == 3
    assert RunDir(t.exp.run_dir).complete_steps() == [2, 3]  # step 3 is off the every-2 grid: saved for the stop
    assert "stopped at step 3 (checkpointed) on SIGUSR1; start the same command again to resume" in capsys.readouterr().out
    assert logged_step_numbers(t.exp.run_dir) == [1, 2, 3]  # the stop step's record is written before it stops
    client = torch.load(os.path.join(RunDir(t.exp.run_dir).checkpoint(3), "state.pt"), weights_only=False)["client"]
    assert client["step"] == 3 and client["loaders"]["packed"]["samples_consumed"] == 3 * 2


def test_bad_steps_write_no_checkpoint_and_diverge_keeping_the_last_good_one(tmp_path, stop):
    t = trainer(tmp_path, stop, skip={4, 5})
    with pytest.raises(Diverged, match=r"2 bad steps in a row .* up to step 5.* the last good checkpoint is "
                                       r".*step00000002"):
        t.fit()
    assert RunDir(t.exp.run_dir).complete_steps() == [2]  # step 4 was due but bad


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
    t = trainer(tmp_path, stop, skip={4}, on_step=lambda step: logged.update({step: logged_step_numbers(t.exp.run_dir)}))
    assert t.fit()["steps"] == 8
    assert RunDir(t.exp.run_dir).complete_steps() == [2, 6, 8]
    assert {n: steps[-1] if steps else 0 for n, steps in logged.items()} == \
        {n: n - 2 if n % 2 == 0 else n - 1 for n in range(1, 9)}  # every=2: odd steps wait for the next one
    assert logged_step_numbers(t.exp.run_dir) == list(range(1, 9))


def test_a_stop_on_a_bad_step_keeps_the_last_good_checkpoint(tmp_path, stop, capsys):
    t = trainer(tmp_path, stop, max_bad_steps=3, skip={3},
                on_step=lambda step: step == 3 and os.kill(os.getpid(), signal.SIGTERM))
    assert t.fit()["steps"] == 3
    assert RunDir(t.exp.run_dir).complete_steps() == [2]  # the bad newest step is not saved, not even at the end
    assert "stopped at step 3 (not checkpointed: the newest step was bad; the last good checkpoint is" in \
        capsys.readouterr().out


def test_a_masking_ratio_schedule_is_logged_and_a_resume_inside_it_continues_it_exactly(tmp_path, stop):
    """CLM for 2 steps, then MLM (and MNTP logged as ``m``) whose ratios fall over the phase's last two thirds:
    each step logs the ratio it masked at, and a run stopped inside the fall and resumed through the checkpoint
    logs the uninterrupted run's ratios and losses bit for bit."""
    fall = {"shape": "linear", "final": 0.1, "start": 0.2}
    phases = [{"share": 0.25, "objectives": [{"name": "clm"}]},
              {"share": 0.75, "objectives": [{"name": "mlm", "ratio": 0.4, "ratio_schedule": fall},
                                             {"name": "mntp", "log_as": "m", "ratio_schedule": {
                                                 "shape": "step", "steps": [[0.5, 0.2]]}}]}]
    whole = trainer(tmp_path / "whole", stop, phases=phases)
    whole.fit()
    logged = logged_steps(whole.exp.run_dir)
    t = [min(max((i / 5 - 0.2) / 0.8, 0.0), 1.0) for i in range(6)]  # steps 3-8 are steps 0-5 of the MLM phase
    assert [logged[s].get("mask_ratio/mlm") for s in range(1, 9)] == pytest.approx(
        [None, None, *(0.4 * (1 - x) + 0.1 * x for x in t)], abs=1e-12)
    assert [logged[s].get("mask_ratio/m") for s in range(1, 9)] == [None, None, 0.3, 0.3, 0.3, 0.2, 0.2, 0.2]
    first = trainer(tmp_path / "resumed", stop, phases=phases, stop_at_step=5)
    assert first.fit()["steps"] == 5
    resumed = trainer(tmp_path / "resumed", stop, phases=phases)  # a new process: fresh model and objectives
    assert resumed.checkpoints.resume(resumed.state)  # what Trainer.build does
    assert (resumed.state.step, resumed.state.tokens_seen) == (5, first.state.tokens_seen)
    resumed.fit()
    again = logged_steps(resumed.exp.run_dir)
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
    lm = build_model("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                     bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    batch = packed_text_batch(tokenizer, ["The river rises in the hills and flows south to the sea."] * 8)
    result = train_step(FakeEngine(TrainModule(lm)), objectives, {"packed": [batch]}, 1, 1)
    assert set(result.losses) == set(result.accuracy) == {"mlm", "mlm40", "magnet/mntp", "magnet/msg", "mntp"}
    counts = {name: n for o in objectives for loss, n in o.objective.num_targets(batch).items()
              for name in [o.loss_name(loss)]}
    assert counts["mlm40"] > counts["mlm"] > 0  # each normalised by its own targets, not by their sum


class HostReads(TorchFunctionMode):
    """Records the project's own calls that read tensor values back to the host (``.item()``, ``.tolist()``,
    ``bool()``/``int()``/``float()``, ``nonzero``, ``.cpu()``/``.numpy()``, a boolean index), by the file calling
    them: on a GPU each waits for everything queued on the device. (``nonzero_static`` is not one.)"""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
             torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.files = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        bool_index = (func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor)
                      and args[1].dtype == torch.bool)
        caller = sys._getframe(1).f_code.co_filename
        if (func in self.READS or bool_index) and os.sep + "pipeline" + os.sep in caller:
            self.files[os.path.basename(caller)] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_reads_back_only_the_attention_mask_decision():
    """A CLM + MNTP + MAGNET step of 2 micro-batches, its targets counted on the host copies as the trainer does
    (``target_counts``): the step reads the device back only for the choice of a plain (is_causal) or a masked
    attention (attention.py, once a micro-batch of CLM and of MNTP; MAGNET always has a mask): the attention path's
    to remove, deciding on the host's documents. No read per loss for its
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
        lm = build_model("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
        counts = target_counts(objectives, batches) if host_counts else None
        with HostReads() as reads:
            results.append(train_step(FakeEngine(TrainModule(lm)), objectives, batches, 1, 2, counts=counts))
    assert reads.files == {"attention.py": 2 * 2}
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
        lm = build_model("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
        batch.source_ids = torch.tensor([0, 1, 1, 0]) if sources else None
        batches = {"packed": [batch, batch]}
        counts = target_counts(objectives, batches)  # on the host copies, as the trainer does
        with HostReads() as counted:
            results.append(train_step(FakeEngine(TrainModule(lm)), objectives, batches, 1, 2, sources, counts))
        reads.append(counted.files)
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
