"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random checkpoints, in process: the
router loss is transformers' own over the non-padding tokens, an MNTP step counts it in the loss and logs it, a
resumed run continues bit for bit, and the planner's FLOPs count the routed experts only. Their masks, SDPA vs eager
and plain-transformers export: tests/unit/model/test_families.py; 2 ZeRO-3 ranks: there, and the trainer's run of the tiny-moe
preset below (its resume from a DeepSpeed checkpoint: make test-extended)."""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from helpers import ZERO3, launch_training, logged_steps, packed_text_batch
from safetensors.torch import load_file
from shard_corpus import TOKENIZER
from test_families import TINY_MOE, batch, tiny_checkpoint
from test_trainer import FakeEngine
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModel

from pipeline.config import ConfigError, from_dict
from pipeline.experiment import ExperimentConfig, PhaseSpec
from pipeline.model.attention import attention_inputs
from pipeline.model.build import MOE_ARCHITECTURES, build_model, model_spec, start_checkpoint_config
from pipeline.model.flops import flops_per_token, param_counts
from pipeline.model.moe import ROUTER_AUX, load_balancing_loss, num_experts, router_aux_scope
from pipeline.train.engine_spec import engine_spec
from pipeline.train.module import build_train_model
from pipeline.train.phases import build_objectives
from pipeline.train.preflight import check_model, router_loss_coef
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
    lm = build_model(model_spec(moe[family], tokenizer.info.vocab_size)).eval()
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
    """The fake engine of tests/unit/train/test_trainer.py, keeping each loss it back-propagates."""

    def backward(self, loss):
        self.losses = [*getattr(self, "losses", []), float(loss.detach())]
        super().backward(loss)


def engine_of(path: str, tokenizer, steps_done: dict | None = None, coef: float | None = None):
    """(RecordingEngine, objectives) of an MNTP run of checkpoint ``path`` as the trainer builds its module;
    ``steps_done``: the module's and optimizer's states to continue from."""
    exp = from_dict(ExperimentConfig, {"model": {"init": path, "router_aux_coef": coef},
                                       "data": {"tokenizer": TOKENIZER, "seq_len": 32}})
    objectives = build_objectives(from_dict(PhaseSpec, {"objectives": [{"name": "mntp", "ratio": 0.3}]}), tokenizer)
    model = check_model(exp, tokenizer, {}, cuda=False)  # the trainer's preflight: the spec and the router loss
    torch.manual_seed(0)
    coef = router_loss_coef(exp, model.config, (tuple(objectives),))
    _, module, _ = build_train_model({}, model, engine_spec(exp, False, coef), [o.objective for o in objectives])
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
        router_loss_coef(exp, check_model(exp, tokenizer, {}, cuda=False).config, (tuple(objectives),))
    with router_aux_scope() as losses:  # a dense model in a scope records nothing
        build_model(model_spec("tiny", 64))(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert losses == []


@pytest.mark.parametrize("family", MOE_ARCHITECTURES)
def test_flops_count_the_routed_experts_only(family, moe, tokenizer):
    lm = build_model(model_spec(moe[family], tokenizer.info.vocab_size))
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
    lm = build_model(model_spec("tiny-moe", 64, attn_implementation="eager"))
    lm.set_experts_implementation("eager")
    ids = torch.randint(0, 64, (2, 32))
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=ids, labels=ids).loss.backward()
    # the closed form counts the norm weights as matmul parameters; the routers' FLOPs are counted
    assert counter.get_total_flops() == pytest.approx(flops_per_token(lm.config, 32) * ids.numel(), rel=0.005)
    assert param_counts(lm.config).active < param_counts(lm.config).body




def test_continued_pretraining_checks_the_experts_of_the_start(tmp_path):
    build_model(model_spec("tiny", 64)).save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"has 2 layers, hidden 64, FFN 128, 4/2 heads, but model.shape 'tiny-moe' "
                                         r"has 2 layers, hidden 64, FFN 128, 4/2 heads, 4 experts; point model.init"):
        start_checkpoint_config(str(tmp_path / "dense"), 64, shape="tiny-moe")
    build_model(model_spec("tiny-moe", 64)).save_pretrained(tmp_path / "moe")
    start_checkpoint_config(str(tmp_path / "moe"), 64, shape="tiny-moe")


RUN = ["train.steps=4", "train.micro_batch=2", "train.log_every=1", "optim.warmup_steps=0", "optim.decay_steps=0",
       "checkpoint.every=2", "data.seq_len=64", "data.build_if_missing=false", "model.init=tiny-moe",
       "phases=[{objectives: [{name: mntp}]}]"]


@pytest.fixture(scope="module")
def zero3_all_partitioned(tmp_path_factory) -> str:
    """ds_configs/zero3.json with no persistent parameters, so the tiny experts are partitioned too."""
    with open(ZERO3) as f:
        config = json.load(f)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    out = str(tmp_path_factory.mktemp("ds") / "zero3.json")
    with open(out, "w") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def moe_run(shards, zero3_all_partitioned, tmp_path_factory) -> str:
    """The tiny-moe preset trained with MNTP by the trainer on 2 ZeRO-3 ranks, its experts partitioned."""
    run_dir = str(tmp_path_factory.mktemp("moe_run") / "straight")
    launch_training(run_dir, None, *RUN, f"data.shards={shards}", ds_config=zero3_all_partitioned)
    return run_dir


@pytest.mark.e2e
@pytest.mark.slow  # a 2-rank launch
def test_a_zero3_moe_run_logs_the_router_loss_and_exports_an_encoder(moe_run):
    logged = logged_steps(moe_run)
    assert sorted(logged) == [1, 2, 3, 4] and all(r["loss/router_aux"] > 1.0 for r in logged.values())
    assert "acc/router_aux" not in logged[1] and "acc/mntp" in logged[1]
    plain = AutoModel.from_pretrained(os.path.join(moe_run, "hf"))  # transformers alone, an encoder
    assert type(plain).__name__ == "MixtralModel" and plain.config.is_causal is False
    counts = param_counts(plain.config)
    assert sum(p.numel() for p in plain.parameters()) == counts.embedding + counts.body


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.extended  # the in-process resume above checks each family's steps; this, DeepSpeed's checkpoint of them
def test_a_zero3_moe_run_resumed_from_its_checkpoint_continues_bit_for_bit(moe_run, shards, zero3_all_partitioned,
                                                                           tmp_path):
    resumed = str(tmp_path / "resumed")
    shutil.copytree(moe_run, resumed, ignore=shutil.ignore_patterns("step00000004", "hf", ".lock"))
    out = launch_training(resumed, None, *RUN, f"data.shards={shards}", ds_config=zero3_all_partitioned).stdout
    assert "resumed from step00000002" in out
    logged = [{s: (r["loss/mntp"], r["loss/router_aux"]) for s, r in logged_steps(d).items()}
              for d in (moe_run, resumed)]
    assert logged[0] == logged[1]
    weights = [load_file(os.path.join(d, "hf", "model.safetensors")) for d in (moe_run, resumed)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
