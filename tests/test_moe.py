"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random checkpoints, in process: the
router loss is transformers' own over the non-padding tokens, an MNTP step counts it in the loss and logs it, a
resumed run continues bit for bit, and the planner's FLOPs count the routed experts only. Their masks, SDPA vs eager
and plain-transformers export: tests/test_families.py; 2 ZeRO-3 ranks: there and test_a_zero3_moe_run_* below."""

from __future__ import annotations

import copy
import importlib
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from helpers import launch_training, logged_steps, packed_text_batch
from safetensors.torch import load_file
from shard_corpus import TOKENIZER
from test_families import TINY_MOE, batch, tiny_checkpoint
from test_trainer_loop import FakeEngine
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModel

from pipeline.config import ConfigError, from_dict
from pipeline.experiment import ExperimentConfig, PhaseSpec
from pipeline.model.attention import attention_inputs
from pipeline.model.build import MOE_ARCHITECTURES, build_model
from pipeline.model.flops import flops_per_token, param_counts
from pipeline.model.moe import ROUTER_AUX, load_balancing_loss, num_experts, router_aux_scope
from pipeline.train.module import build_train_model
from pipeline.train.phases import build_objectives
from pipeline.train.step import train_step

TEXTS = ["The river rises in the hills and flows south to the sea.", "A king, a queen, and a knight.",
         "Rain fell on the town all night, and by morning the bridge was gone."]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe(tokenizer, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {f: tiny_checkpoint(f, str(root / f), tokenizer) for f in MOE_ARCHITECTURES}


def test_every_moe_family_has_a_tiny_config():
    assert set(TINY_MOE) == set(MOE_ARCHITECTURES)


@pytest.mark.parametrize("family", MOE_ARCHITECTURES)
def test_router_loss_is_transformers_over_the_real_tokens(family, moe, tokenizer):
    lm = build_model(moe[family], tokenizer.info.vocab_size).eval()
    ids, doc_ids = batch(tokenizer)
    valid = doc_ids >= 0
    kwargs = attention_inputs("bidirectional", doc_ids)
    with torch.no_grad():
        logits = lm.model(input_ids=ids, **kwargs, output_router_logits=True).router_logits
        theirs = importlib.import_module(type(lm).__module__).load_balancing_loss_func(
            logits, num_experts(lm.config), lm.config.num_experts_per_tok, valid.long())
        ours = load_balancing_loss(logits, valid, num_experts(lm.config), lm.config.num_experts_per_tok)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
        other = ids.masked_fill(~valid, tokenizer.info.bos_id)  # other padding tokens: the same loss
        again = lm.model(input_ids=other, **kwargs, output_router_logits=True).router_logits
        torch.testing.assert_close(load_balancing_loss(again, valid, num_experts(lm.config),
                                                       lm.config.num_experts_per_tok), ours, atol=1e-6, rtol=0)
        assert not torch.allclose(load_balancing_loss(logits, torch.ones_like(valid), num_experts(lm.config),
                                                      lm.config.num_experts_per_tok), ours)
        assert load_balancing_loss(logits, torch.zeros_like(valid), 4, 2) == 0  # no real token: no NaN


class RecordingEngine(FakeEngine):
    """The fake engine of tests/test_trainer_loop.py, keeping each loss it back-propagates."""

    def backward(self, loss):
        self.losses = [*getattr(self, "losses", []), float(loss.detach())]
        super().backward(loss)


def engine_of(path: str, tokenizer, steps_done: dict | None = None, coef: float | None = None):
    """(RecordingEngine, objectives) of an MNTP run of checkpoint ``path`` as the trainer builds its module;
    ``steps_done``: the module's and optimizer's states to continue from."""
    exp = from_dict(ExperimentConfig, {"model": {"init": path, "router_aux_coef": coef},
                                       "data": {"tokenizer": TOKENIZER, "seq_len": 32}})
    objectives = build_objectives(from_dict(PhaseSpec, {"objectives": [{"name": "mntp", "ratio": 0.3}]}), tokenizer)
    torch.manual_seed(0)
    _, module, _ = build_train_model(exp, {}, tokenizer, False, [o.objective for o in objectives],
                                     attn_implementation="sdpa", fused="none")
    engine = RecordingEngine(module)
    if steps_done is not None:
        module.load_state_dict(steps_done["module"])
        engine.optimizer.load_state_dict(steps_done["optimizer"])
    return engine, objectives


@pytest.mark.parametrize("family", MOE_ARCHITECTURES)
def test_mntp_steps_count_the_router_loss_and_resume_bit_for_bit(family, moe, tokenizer):
    batches = [packed_text_batch(tokenizer, TEXTS * 2, seq_len=32, rows=2, seed=s) for s in range(2)]
    engine, objectives = engine_of(moe[family], tokenizer)
    coef = AutoConfig.from_pretrained(moe[family]).router_aux_loss_coef
    assert engine.module.router_aux_coef == coef
    straight, saved = [], None
    for step, b in enumerate(batches):
        result = train_step(engine, objectives, {"packed": [b]}, 1, 1)
        assert set(result.losses) == {"mntp", ROUTER_AUX} and set(result.accuracy) == {"mntp"}
        assert result.losses[ROUTER_AUX] > 1.0  # 2 (the experts per token) at perfect balance, more when unbalanced
        # the step back-propagated the objective's loss plus the weighted router loss (each over its one call)
        assert engine.losses[-1] == pytest.approx(result.losses["mntp"] + coef * result.losses[ROUTER_AUX], rel=1e-6)
        straight.append(result.losses)
        if step == 0:
            saved = copy.deepcopy({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()})
    resumed, _ = engine_of(moe[family], tokenizer, saved)
    assert [train_step(resumed, objectives, {"packed": [b]}, 1, 1).losses for b in batches[1:]] == straight[1:]
    unweighted, _ = engine_of(moe[family], tokenizer, coef=0.0)  # model.router_aux_coef overrides the checkpoint's
    first = train_step(unweighted, objectives, {"packed": [batches[0]]}, 1, 1)
    assert first.losses == straight[0] and unweighted.losses[0] == pytest.approx(first.losses["mntp"], rel=1e-6)
    unweighted.module.eval()  # validation: the body runs as a dense one's, no router loss
    assert set(unweighted(objectives[0].objective, batches[0])) == {"mntp"}


def test_router_loss_refuses_grad_cache(moe, tokenizer):
    exp = from_dict(ExperimentConfig, {"model": {"init": moe["mixtral"]}, "train": {"grad_accum": 2},
                                       "data": {"tokenizer": TOKENIZER, "seq_len": 32},
                                       "phases": [{"objectives": [{"name": "supervised", "grad_cache": True}]}]})
    objectives = build_objectives(exp.phases[0], tokenizer)
    with pytest.raises(ConfigError, match=r"mixtral' is a mixture-of-experts model, whose router loss needs each "
                                          r"micro-batch's forward graph, which grad_cache \(objective supervised\)"):
        build_train_model(exp, {}, tokenizer, False, [o.objective for o in objectives], attn_implementation="sdpa",
                          fused="none")
    with router_aux_scope() as losses:  # a dense model in a scope records nothing
        build_model("tiny", 64)(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert losses == []


@pytest.mark.parametrize("family", MOE_ARCHITECTURES)
def test_flops_count_the_routed_experts_only(family, moe, tokenizer):
    lm = build_model(moe[family], tokenizer.info.vocab_size)
    counts = param_counts(lm.config)
    assert counts.total == sum(p.numel() for p in lm.parameters())
    experts = sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n)
    assert counts.body - counts.active == experts // 2  # 2 of the 4 experts run for each token
    c = lm.config
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * 32
    assert flops_per_token(c, 32) == 6 * (counts.active + c.vocab_size * c.hidden_size) + attention


def test_tiny_moe_preset_flops_match_torch_flop_counter():
    """What a step of the tiny-moe preset computes (eager experts: a matmul per expert on its tokens) is the
    routed experts' FLOPs, not all of them."""
    torch.manual_seed(0)
    lm = build_model("tiny-moe", 64, attn_implementation="eager")
    lm.set_experts_implementation("eager")
    ids = torch.randint(0, 64, (2, 32))
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=ids, labels=ids).loss.backward()
    # the closed form counts the norm weights as matmul parameters; the routers' FLOPs are counted
    assert counter.get_total_flops() == pytest.approx(flops_per_token(lm.config, 32) * ids.numel(), rel=0.005)
    assert param_counts(lm.config).active < param_counts(lm.config).body


RUN = ["train.steps=4", "train.micro_batch=2", "train.log_every=1", "optim.warmup_steps=0", "optim.decay_steps=0",
       "checkpoint.every=2", "data.seq_len=64", "data.build_if_missing=false", "model.init=tiny-moe",
       "phases=[{objectives: [{name: mntp}]}]"]


@pytest.mark.e2e
@pytest.mark.slow  # two 2-rank launches
def test_a_zero3_moe_run_logs_the_router_loss_resumes_exactly_and_exports_an_encoder(shards, tmp_path):
    """The tiny-moe preset trained by the trainer on 2 ZeRO-3 ranks, then again from its step-2 checkpoint."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    launch_training(straight, None, *RUN, f"data.shards={shards}")
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step00000004", "hf", ".lock"))
    out = launch_training(resumed, None, *RUN, f"data.shards={shards}").stdout
    assert "resumed from step00000002" in out
    logged = [{s: (r["loss/mntp"], r["loss/router_aux"]) for s, r in logged_steps(d).items()}
              for d in (straight, resumed)]
    assert logged[0] == logged[1] and sorted(logged[0]) == [1, 2, 3, 4]
    assert all(aux > 1.0 for _, aux in logged[0].values())
    weights = [load_file(os.path.join(d, "hf", "model.safetensors")) for d in (straight, resumed)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    plain = AutoModel.from_pretrained(os.path.join(straight, "hf"))  # transformers alone, an encoder
    assert type(plain).__name__ == "MixtralModel" and plain.config.is_causal is False
    assert sum(p.numel() for p in plain.parameters()) == param_counts(plain.config).total - param_counts(
        plain.config).head
