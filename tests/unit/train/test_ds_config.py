"""The DeepSpeed JSON as the trainer resolves it (pipeline/train/ds_config.py): "auto" fields and conflicts with
the experiment, fp32 gradient reduction, the one-GPU ZeRO-3 note, and the optimizer a JSON builds over the trainer's
parameter groups."""

from __future__ import annotations

import json
import os

import pytest
import warm
from helpers import REPO, one_rank_env, rendezvous

from pipeline.config import ConfigError
from pipeline.experiment import load_experiment
from pipeline.model.build import build_model, model_spec
from pipeline.train.ds_config import resolve_ds_config, sharding_note


def test_ds_config_auto_fields_and_conflicts():
    exp = load_experiment(None, ["train.micro_batch=3", "train.grad_accum=2"])
    ds = resolve_ds_config({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                            "zero_optimization": {"stage": 3}}, exp, world_size=4, bf16=False)
    assert ds["train_batch_size"] == 24 and ds["gradient_accumulation_steps"] == 2 and ds["bf16"]["enabled"] is False
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu = 8 contradicts.*train.micro_batch"):
        resolve_ds_config({"train_micro_batch_size_per_gpu": 8}, exp, world_size=1, bf16=False)
    with pytest.raises(ConfigError, match="scheduler"):
        resolve_ds_config({"scheduler": {"type": "WarmupLR"}}, exp, world_size=1, bf16=False)
    with pytest.raises(ConfigError, match="optimizer.params.lr"):
        resolve_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, exp, world_size=1, bf16=False)


def test_ds_config_reduces_and_accumulates_bf16_gradients_in_fp32():
    """bf16 weights get fp32 gradient reduction (on more than one rank: one has nothing to reduce) and (with ZeRO)
    fp32 accumulation unless the JSON chooses; fp32 training and stage 0 (where DeepSpeed cannot accumulate bf16
    gradients in fp32) are left alone."""
    exp = load_experiment(None)
    zero3 = resolve_ds_config({"zero_optimization": {"stage": 3}}, exp, world_size=2, bf16=True)
    assert zero3["communication_data_type"] == "fp32" and zero3["data_types"] == {"grad_accum_dtype": "fp32"}
    one_rank = resolve_ds_config({"zero_optimization": {"stage": 1}}, exp, world_size=1, bf16=True)
    assert "communication_data_type" not in one_rank and one_rank["data_types"] == {"grad_accum_dtype": "fp32"}
    stage0 = resolve_ds_config({}, exp, world_size=2, bf16=True)
    assert stage0["communication_data_type"] == "fp32" and "data_types" not in stage0
    assert not {"communication_data_type", "data_types"} & set(resolve_ds_config({}, exp, world_size=2, bf16=False))
    theirs = resolve_ds_config({"zero_optimization": {"stage": 2}, "communication_data_type": "bf16",
                                "data_types": {"grad_accum_dtype": "bf16"}}, exp, world_size=2, bf16=True)
    assert theirs["communication_data_type"] == "bf16" and theirs["data_types"] == {"grad_accum_dtype": "bf16"}


def test_zero3_on_one_gpu_is_told_of_zero1():
    """The user's command names zero3.json; on one GPU, where it shards nothing, rank 0 says what is faster."""
    zero3 = {"zero_optimization": {"stage": 3}}
    assert "--config ds_configs/zero1.json trains faster" in sharding_note(zero3, world=1, cuda=True)
    assert sharding_note(zero3, world=2, cuda=True) is None  # a second rank: ZeRO-3 shards
    assert sharding_note(zero3, world=1, cuda=False) is None  # CPU ranks: the measured layouts differ (BENCHMARKS)
    assert sharding_note({"zero_optimization": {"stage": 1}}, world=1, cuda=True) is None
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert sharding_note(offload, world=1, cuda=True) is None  # offload needs ZeRO-3


# One rank builds the engine as the trainer does from a ZeRO-3 DeepSpeed JSON; prints each optimizer group's weight
# decay and element count. Exits without teardown (DeepSpeed's gloo threads, as launch/train.py leaves a rank).
ENGINE_OPTIMIZER = """
import json, os, sys
import deepspeed
from pipeline.tokenizer import load_tokenizer
from pipeline.train.ds_config import load_ds_config, resolve_ds_config
from pipeline.experiment import load_experiment
from pipeline.train.engine_spec import engine_spec
from pipeline.train.module import build_engine
from pipeline.train.preflight import check_model
deepspeed.init_distributed(dist_backend="gloo")
exp = load_experiment(None, ["optim.weight_decay=0.1"])
ds = resolve_ds_config(load_ds_config(sys.argv[1]), exp, 1, False)
_, engine = build_engine(ds, check_model(exp, load_tokenizer(exp.data.tokenizer), ds, cuda=False),
                        engine_spec(exp, cuda=False))
zero = engine.optimizer  # ZeRO-3 keeps each group's (partitioned) parameters in fp16_groups
print(json.dumps({"optimizer": type(zero.optimizer).__name__,
                  "groups": [[g["weight_decay"], sum(p.ds_numel for p in params)]
                             for g, params in zip(zero.param_groups, zero.fp16_groups, strict=True)]}), flush=True)
os._exit(0)
"""


@pytest.mark.e2e
@pytest.mark.slow  # the CPU Adam build takes minutes on a new machine
def test_ds_config_optimizer_skips_weight_decay_on_norms(tokenizer):
    """ds_configs/zero3_offload.json builds DeepSpeed's CPU Adam (a JIT build of a few minutes the first time)
    over the trainer's parameter groups: the norms' elements are exactly those without weight decay."""
    with rendezvous() as rdzv:
        proc = warm.run(code=ENGINE_OPTIMIZER, args=[os.path.join(REPO, "ds_configs", "zero3_offload.json")],
                        env=one_rank_env(rdzv))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    lm = build_model(model_spec("tiny", tokenizer.info.vocab_size))
    norms = sum(p.numel() for p in lm.parameters() if p.ndim == 1)
    assert result["optimizer"] == "DeepSpeedCPUAdam"
    decayed = {wd: sum(n for w, n in result["groups"] if w == wd) for wd, _ in result["groups"]}
    assert decayed == {0.1: sum(p.numel() for p in lm.parameters()) - norms, 0.0: norms}
