"""The run state a checkpoint carries (:class:`pipeline.train.state.TrainState`): its round trip, and a checkpoint
written before it existed (``tests/fixtures/old_checkpoint``, a hand-written client dict with ``phase``) resuming
under the current code and training on."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import ZERO3, launch_training, logged_steps, make_shard_dir
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.data.format.index import load_index
from pipeline.data.loading.loader import ShardLoader
from pipeline.io import read_json, write_json_atomic
from pipeline.run_dir import DATA, RunDir, tag
from pipeline.train.state import TrainState

OLD = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")), "fixtures", "old_checkpoint")
OLD_STEP = 2  # the fixture's checkpoint: a run of 4 steps stopped at step 2
# The fixture's run: the smallest Llama the tokenizer allows (its embedding table is most of it), one rank, ZeRO-3
OVERRIDES = ("train.steps=4", "train.micro_batch=2", "train.grad_accum=1", "train.log_every=1", "data.seq_len=64",
             "data.build_if_missing=false", "optim.warmup_steps=0", "optim.decay_steps=0", "checkpoint.every=2",
             "model.lm_head_chunk=0")


def fresh_state(shards: str, *sources: str) -> TrainState:
    """A run's state at its start: one loader over ``shards`` (global batch 2), ``sources`` counted apart."""
    return TrainState({"packed": ShardLoader(load_index(shards), 2, 1, 0, 1, 0)},
                      source_tokens=dict.fromkeys(sources, 0))


def smallest_llama(tokenizer, out: str) -> str:
    """A one-layer Llama of hidden size 4 with tied embeddings and seeded weights, as an HF directory."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.info.vocab_size, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
                         eos_token_id=tokenizer.eos_id)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def run_fixture_training(run_dir: str, shards: str, init: str, *overrides: str):
    """The fixture's run (``OVERRIDES``) on one rank under ZeRO-3."""
    return launch_training(run_dir, None, *OVERRIDES, f"data.shards={shards}", f"model.init={init}", *overrides,
                           nproc=1, ds_config=ZERO3)


def saved_client_state(checkpoint: str) -> dict:
    """The client state of a one-rank ZeRO-3 checkpoint directory, as DeepSpeed saved it (with its own entries)."""
    return torch.load(os.path.join(checkpoint, "zero_pp_rank_0_mp_rank_00_model_states.pt"), weights_only=False)


def made_here(client: dict, shards: str) -> dict:
    """``client`` with the fingerprint of this checkout's ``shards``: a fingerprint covers the input files' absolute
    paths, so the fixture's is that of the checkout that made it; nothing else of the old state changes."""
    client["loaders"]["packed"]["fingerprint"] = load_index(shards).fingerprint
    return client


def test_the_state_round_trips_and_the_loaders_continue(tmp_path):
    """A state saved after three steps, loaded into a fresh one, has its counts and serves the batches the saved
    run's loader serves next; the sources counted are the loading run's, one the checkpoint lacks from 0."""
    shards = make_shard_dir(tmp_path)
    saved = fresh_state(shards, "a", "b")
    for _ in range(3):
        saved.loaders["packed"].next_global_step()
        saved.advance(64)
    saved.source_tokens |= {"a": 150, "b": 42}
    state = saved.state_dict()
    assert set(state) == {"step", "tokens_seen", "loaders", "source_tokens"}
    loaded = fresh_state(shards, "a", "c")
    loaded.load_state_dict(state)
    assert (loaded.step, loaded.tokens_seen, loaded.source_tokens) == (3, 192, {"a": 150, "c": 0})
    assert loaded.sources == ("a", "c")
    ours, theirs = loaded.loaders["packed"].next_global_step(), saved.loaders["packed"].next_global_step()
    assert [b.keys for b in ours] == [b.keys for b in theirs]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(ours, theirs))
    assert "source_tokens" not in fresh_state(shards).state_dict()  # one source: nothing counted apart


def test_the_old_client_dict_loads_and_its_phase_is_not_written_again(shards):
    """The fixture's client state (written by hand before TrainState, ``phase`` included) loads into a run's
    state over the same shards; saving that state writes the old one less the derived ``phase``."""
    old = made_here(saved_client_state(os.path.join(OLD, tag(OLD_STEP))), shards)
    client = {k: old[k] for k in ("step", "tokens_seen", "loaders", "phase")}
    state = fresh_state(shards)
    state.load_state_dict(client)
    assert (state.step, state.tokens_seen) == (OLD_STEP, client["tokens_seen"])
    assert state.state_dict() == {k: v for k, v in client.items() if k != "phase"}


@pytest.mark.e2e
def test_a_checkpoint_of_the_old_client_dict_resumes_and_trains_on(tmp_path, shards, tokenizer):
    """The fixture resumes at its step with its tokens and loader position, trains steps 3-4 with the losses of the
    uninterrupted old run, and its new checkpoint carries the state advanced by two steps."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(OLD, tag(OLD_STEP)),
                    RunDir(run_dir).checkpoint(OLD_STEP))
    states = os.path.join(RunDir(run_dir).checkpoint(OLD_STEP), "zero_pp_rank_0_mp_rank_00_model_states.pt")
    old = made_here(saved_client_state(RunDir(run_dir).checkpoint(OLD_STEP)), shards)
    torch.save(old, states)
    record = os.path.join(RunDir(run_dir).checkpoint(OLD_STEP), DATA)  # preflight holds a resume to its shards
    write_json_atomic(record, {**read_json(record), "fingerprint": load_index(shards).fingerprint})
    assert old["phase"] == "clm"  # the key the current code no longer writes
    proc = run_fixture_training(run_dir, shards, smallest_llama(tokenizer, str(tmp_path / "init")))
    assert f"resumed from {tag(OLD_STEP)} ({old['tokens_seen']:,} tokens seen)" in proc.stdout
    with open(os.path.join(OLD, "uninterrupted.jsonl")) as f:
        whole = {rec["step"]: rec for rec in map(json.loads, f)}
    logged = logged_steps(run_dir)
    assert sorted(logged) == [3, 4]
    for step in (3, 4):
        # another machine may sum in another order: the 2-rank vs single-process bound of test_train.py
        assert logged[step]["loss/clm"] == pytest.approx(whole[step]["loss/clm"], rel=1e-5), step
        assert logged[step]["progress/tokens_seen"] == whole[step]["progress/tokens_seen"], step
    new = saved_client_state(RunDir(run_dir).checkpoint(4))
    assert (new["step"], new["tokens_seen"]) == (4, whole[4]["progress/tokens_seen"])
    assert new["loaders"]["packed"]["samples_consumed"] == 2 * old["loaders"]["packed"]["samples_consumed"]
    assert "phase" not in new
