"""Resolve the user's DeepSpeed JSON against the experiment: ``"auto"`` fields are filled, conflicts are errors."""

from __future__ import annotations

import copy

from pipeline.config import ConfigError
from pipeline.experiment import ExperimentConfig
from pipeline.io import read_json


def load_ds_config(path: str) -> dict:
    return read_json(path, "see ds_configs/ for examples", what="DeepSpeed config", error=ConfigError,
                     missing=ConfigError)


def _fill(cfg: dict, path: str, value, key: str, where: str) -> None:
    """Set the DeepSpeed field ``path`` to the experiment's ``value`` (its config ``key``, e.g. train.micro_batch)
    where the JSON says "auto" or nothing; a different value there is an error naming both."""
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    current = node.get(leaf, "auto")
    if current == "auto":
        node[leaf] = value
    elif current != value and not (isinstance(value, float) and isinstance(current, (int, float))
                                   and abs(current - value) <= 1e-12 * max(1.0, abs(value))):
        raise ConfigError(f"{where}: {path} = {current!r} contradicts the experiment's {key} = {value!r}; "
                          f"set it to \"auto\" (or remove it) so the experiment decides, or change {key}")


def _fp32_gradients(cfg: dict, stage: int, world_size: int) -> None:
    """With bf16 weights, reduce gradients in fp32 (where there is a reduction: more than one rank) and (ZeRO 1-3)
    accumulate them in fp32, as torchtitan does, unless the JSON says otherwise: DeepSpeed's default for both is
    the model's bf16, whose 8-bit mantissa loses the small terms of a sum over ranks and micro-steps. One rank has
    nothing to reduce, and an fp32 communication type would only add a bf16 -> fp32 copy of every gradient. With
    ZeRO-1 the fp32 accumulation makes DeepSpeed pick its BF16 optimizer (fp32 master weights and gradients).
    DeepSpeed has no fp32 accumulation for bf16 without ZeRO (stage 0 raises "unsupported mix"), so there the
    gradients stay bf16 and only their all-reduce is fp32."""
    if world_size > 1:
        cfg.setdefault("communication_data_type", "fp32")
    if stage >= 1:
        cfg.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")


def resolve_ds_config(ds: dict, exp: ExperimentConfig, world_size: int, bf16: bool, where: str = "DeepSpeed config") -> dict:
    cfg = copy.deepcopy(ds)
    t, o = exp.train, exp.optim
    _fill(cfg, "train_micro_batch_size_per_gpu", t.micro_batch, "train.micro_batch", where)
    _fill(cfg, "gradient_accumulation_steps", t.grad_accum, "train.grad_accum", where)
    _fill(cfg, "train_batch_size", t.global_batch(world_size),
          f"train.micro_batch x train.grad_accum x world size ({world_size})", where)
    _fill(cfg, "gradient_clipping", o.grad_clip, "optim.grad_clip", where)
    _fill(cfg, "bf16.enabled", bf16, "model.dtype", where)
    if cfg.get("fp16", {}).get("enabled") is True:
        raise ConfigError(f"{where}: fp16.enabled is not supported (loss scaling is not wired); use bf16 via model.dtype")
    if "scheduler" in cfg:
        raise ConfigError(f"{where}: remove the \"scheduler\" section; the learning-rate schedule comes from "
                          f"the experiment's optim section")
    if "optimizer" in cfg:  # DeepSpeed builds it (e.g. CPU Adam for offload); its hyper-parameters are ours
        params = f"{where} optimizer.params"
        _fill(cfg, "optimizer.params.lr", o.lr, "optim.lr", params)
        _fill(cfg, "optimizer.params.betas", list(o.betas), "optim.betas", params)
        _fill(cfg, "optimizer.params.eps", o.eps, "optim.eps", params)
        _fill(cfg, "optimizer.params.weight_decay", o.weight_decay, "optim.weight_decay", params)
    zero = cfg.get("zero_optimization", {})
    if bf16:
        _fp32_gradients(cfg, zero.get("stage", 0), world_size)
    if zero.get("stage") == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    return cfg


def sharding_note(ds: dict, world: int, cuda: bool) -> str | None:
    """A note for a ZeRO-3 run on one GPU: there is nothing to shard, and ZeRO-3's per-module gathers and hooks cost
    step time (issue 32's H200 measurement: 0.471 s a step against ZeRO-2's 0.326 s at 1b), so a model that fits
    trains faster with ``ds_configs/zero1.json``, the planner's choice."""
    if not cuda or world != 1 or ds.get("zero_optimization", {}).get("stage") != 3:
        return None
    offload = any(ds["zero_optimization"].get(k) for k in ("offload_param", "offload_optimizer"))
    return None if offload else ("note: ZeRO-3 on one GPU shards nothing and costs step time; for a model that fits "
                                 "(python launch/plan.py says which stage does), --config ds_configs/zero1.json "
                                 "trains faster")
