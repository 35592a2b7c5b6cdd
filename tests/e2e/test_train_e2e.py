"""The trainer end to end: real DeepSpeed ZeRO-3 engines in 2 CPU processes (gloo), real shards of the sample
corpus, the shipped tokenizer and a tiny HF Llama.

One 20-step baseline run is shared by the tests: it is compared with a plain single-process PyTorch loop, with a
run stopped at step 10 and resumed, with a run killed while its writer thread writes the step-20 checkpoint (checkpoint.async_save), and its HF export is
reloaded. Each launch costs ~15 s of process start-up, so launches are few.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from dataclasses import dataclass

import pytest
import torch
import warm
from helpers import ZERO3, launch_training, logged_steps

from pipeline.data.format.index import load_index
from pipeline.data.loading.loader import ShardLoader
from pipeline.experiment import SAMPLE_DIR, load_experiment
from pipeline.model.build import build_model, model_spec
from pipeline.model.weight_decay import param_groups
from pipeline.run_dir import RunDir
from pipeline.tokenizer import load_tokenizer
from pipeline.train.batch_warmup import batch_warmup
from pipeline.train.engine_spec import lr_schedule
from pipeline.train.module import TrainModule
from pipeline.train.phases import build_objectives
from pipeline.train.schedule import lr_multiplier

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
TOKENIZER = os.path.join(SAMPLE_DIR, "tokenizer")
EXPORT = os.path.join(REPO, "launch", "export_hf.py")
STEPS = 20
COMMON = ["train.steps=20", "train.micro_batch=2", "train.grad_accum=2", "train.log_every=5",
          "optim.warmup_steps=4", "optim.decay_steps=6", "optim.lr=0.002", "checkpoint.every=10",
          "data.seq_len=64", "data.build_if_missing=false",
          "model.lm_head_chunk=32"]  # ~126 targets a micro-batch: the chunked head's multi-chunk path under ZeRO-3


def launch(run_dir: str, shards: str, init: str, *overrides: str, nproc: int = 2, env: dict | None = None,
           check: bool = True, ds_config: str = ZERO3) -> subprocess.CompletedProcess:
    """The default experiment with this module's settings, on ``shards`` from the checkpoint ``init``."""
    return launch_training(run_dir, None, *COMMON, f"data.shards={shards}", f"model.init={init}", *overrides,
                           nproc=nproc, env=env, check=check, ds_config=ds_config)


def losses(run_dir: str) -> dict[int, float]:
    """Step -> loss; a step logged twice (replayed after a resume) keeps its last value."""
    return {step: rec["loss/clm"] for step, rec in logged_steps(run_dir).items()}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, shards, init_dir) -> str:
    run_dir = str(tmp_path_factory.mktemp("runs") / "baseline")
    launch(run_dir, shards, init_dir)
    return run_dir


@dataclass(frozen=True)
class Reference:
    losses: list[float]  # per step
    grad_norms: list[float]  # per step, before clipping
    lm: torch.nn.Module  # the trained model


def reference_losses(shards: str, init_dir: str, run_dir: str, *overrides: str) -> Reference:
    """The same training in one process with plain PyTorch: AdamW, LambdaLR, clip-by-norm, no DeepSpeed, and the
    unchunked LM head; ``overrides`` (a batch warmup) on top of this module's settings."""
    exp = load_experiment(None, [*COMMON, f"model.init={init_dir}", f"data.shards={shards}", *overrides])
    tok = load_tokenizer(TOKENIZER)
    lm = build_model(model_spec(init_dir, tok.info.vocab_size, pad_token_id=tok.info.pad_id, bos_token_id=tok.info.bos_id,
                     eos_token_id=tok.info.eos_id))
    model = TrainModule(lm)
    opt = torch.optim.AdamW(param_groups(model, exp.optim.weight_decay), lr=exp.optim.lr, betas=exp.optim.betas,
                            eps=exp.optim.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, lr_schedule(exp.optim, STEPS)))
    # 2 ranks x micro 2 x accumulation 2 = global batch 8: one rank taking micro-batches of 4, twice
    loader = ShardLoader(load_index(shards), micro_batch=4, grad_accum=2, seed=exp.train.seed,
                         warmup=batch_warmup(dataclasses.replace(exp.train, micro_batch=4), 1))
    (clm,) = build_objectives(exp.phases[0], tok)
    out, norms = [], []
    for _ in range(STEPS):
        batches = loader.next_global_step()
        count = int(sum(clm.objective.num_targets(b)["clm"] for b in batches))
        total = 0.0
        for b in batches:
            loss_sum = model(clm.objective, b)["clm"].loss_sum
            (loss_sum / count).backward()
            total += loss_sum.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), exp.optim.grad_clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(total / count)
    return Reference(out, norms, lm)


@pytest.mark.e2e
def test_zero3_two_ranks_match_single_process_loop(baseline, shards, init_dir):
    ours = losses(baseline)
    ref = reference_losses(shards, init_dir, baseline).losses
    assert sorted(ours) == list(range(1, STEPS + 1)) or len(ours) == STEPS
    for step, expected in enumerate(ref, start=1):
        assert abs(ours[step] - expected) <= 1e-5 * abs(expected), (step, ours[step], expected)
    assert ours[STEPS] < ours[1] - 0.5  # it learns


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, 2])
def test_grad_norm_is_measured_on_every_zero_stage(baseline, shards, init_dir, tmp_path, stage):
    """The logged gradient norm, which the divergence guard reads too, is torch's norm before clipping: on one
    rank at ZeRO stage 0 (where DeepSpeed measures none) and 2, and on the 2-rank ZeRO-3 baseline. Stage 0 on one
    rank, the layout of the slow suite's real-model runs, has the baseline's losses."""
    ds = tmp_path / "ds.json"
    with open(ZERO3) as f:
        ds.write_text(json.dumps({**json.load(f), "zero_optimization": {"stage": stage}}))
    run_dir = str(tmp_path / f"zero{stage}")
    launch(run_dir, shards, init_dir, "train.micro_batch=4", nproc=1, ds_config=str(ds))  # the reference's batches
    reference = reference_losses(shards, init_dir, run_dir).grad_norms
    for run in (run_dir, baseline):
        logged = [logged_steps(run)[step]["optim/grad_norm"] for step in range(1, STEPS + 1)]
        # ZeRO sums a million squares in fp32 in its own order (5e-5 apart at step 1), then 20 updates of rounding
        assert logged == pytest.approx(reference, rel=1e-3), run
    if stage == 0:  # the fastest CPU layout (one rank, no ZeRO) trains what the 2-rank ZeRO-3 path trains
        assert list(losses(run_dir).values()) == pytest.approx(list(losses(baseline).values()), rel=1e-5)


@pytest.mark.e2e
def test_resume_is_bit_identical_and_survives_kill_during_an_async_checkpoint(baseline, shards, init_dir, tmp_path):
    """Checkpoints written in the background (checkpoint.async_save) resume bit for bit, and a kill -9 while the
    writer thread is writing one leaves it incomplete and untrusted."""
    run_dir = str(tmp_path / "resumed")
    first = launch(run_dir, shards, init_dir, "train.stop_at_step=10", "checkpoint.async_save=true")
    assert "stopped at step 10 (checkpointed)" in first.stdout
    assert RunDir(run_dir).complete_steps() == [10]
    assert sorted(f for f in os.listdir(RunDir(run_dir).checkpoint(10)) if f.startswith("written-rank")) == [
        "written-rank0", "written-rank1"]
    # resume, and die (SIGKILL) while the writer threads write step 20's files
    killed = launch(run_dir, shards, init_dir, "checkpoint.async_save=true",
                    env={"PIPELINE_FAULT": "kill-mid-write:20"}, check=False)
    assert killed.returncode != 0
    assert "resumed from step00000010" in killed.stdout
    assert os.path.isdir(RunDir(run_dir).checkpoint(20))
    assert RunDir(run_dir).latest_complete() == 10  # the half-written step 20 is not trusted
    final = launch(run_dir, shards, init_dir)
    assert "resumed from step00000010" in final.stdout
    assert RunDir(run_dir).latest_complete() == STEPS
    ours, base = losses(run_dir), losses(baseline)
    assert [ours[s] for s in range(11, STEPS + 1)] == [base[s] for s in range(11, STEPS + 1)]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:  # steps 11-20 ran twice (the kill), logged once
        assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))


@pytest.mark.e2e
@pytest.mark.slow  # compiling in both ranks adds ~2.5 min on 2 cores; tests/unit/model/test_compile.py is the fast check
@pytest.mark.extended  # and test_zero3_engine.py compiles the layers under ZeRO-3
def test_compiled_body_under_zero3_gives_the_eager_losses(baseline, shards, init_dir, tmp_path):
    """model.compile with activation checkpointing and ZeRO-3's gather hooks around the compiled layers, on 2 ranks:
    the first steps equal the (eager, unchecked) baseline's (selective checkpointing with compile is refused:
    test_preflight.py)."""
    run_dir = str(tmp_path / "compiled")
    launch(run_dir, shards, init_dir, "model.compile=true", "model.activation_checkpointing=true",
           "train.stop_at_step=3")
    ours, base = losses(run_dir), losses(baseline)
    for step in (1, 2, 3):
        assert abs(ours[step] - base[step]) <= 1e-4 * abs(base[step]), (step, ours[step], base[step])


def _logits(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()(input_ids=ids).logits


@pytest.mark.e2e
def test_hf_export_reloads_with_the_trained_weights(baseline, shards, init_dir, tmp_path):
    ids = torch.randint(4, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    exported = _logits(os.path.join(baseline, "hf"), ids)
    offline = str(tmp_path / "offline")
    proc = warm.run(EXPORT, ["--run", baseline, "--output", offline])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(_logits(offline, ids), exported)  # 16-bit gather in training == offline fp32 export
    records = [json.load(open(os.path.join(d, "config.json")))["decoder_encoders"] for d in (offline, baseline + "/hf")]
    assert records[0] == records[1] and records[0]["attention"] == "causal"  # both routes record the same training
    reference = reference_losses(shards, init_dir, baseline).lm
    with torch.no_grad():
        ref = reference.eval()(input_ids=ids).logits
    assert torch.allclose(exported, ref, atol=1e-3), (exported - ref).abs().max()
    assert not torch.allclose(_logits(init_dir, ids), exported, atol=1e-3)  # training changed the weights
    tok = load_tokenizer(os.path.join(baseline, "hf"))
    assert tok.info.fingerprint == load_tokenizer(TOKENIZER).info.fingerprint


@pytest.mark.e2e
def test_export_without_checkpoint_says_so(tmp_path):
    proc = warm.run(EXPORT, ["--run", str(tmp_path), "--output", str(tmp_path / "out")])
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
