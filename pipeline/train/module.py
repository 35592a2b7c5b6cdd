"""The model as the DeepSpeed engine sees it, its optimizer, and the engine (the HF export: :mod:`pipeline.train.export`)."""

from __future__ import annotations

import contextlib

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.compile.util import is_deepcompile_supported
from deepspeed.utils import set_z3_leaf_modules
from torch import nn
from transformers import PretrainedConfig
from transformers.integrations import HfDeepSpeedConfig

from pipeline.config import ConfigError
from pipeline.experiment import ExperimentConfig, ModelConfig, OptimConfig
from pipeline.model.attention import FLEX, VARLEN, resolve_implementation
from pipeline.model.build import build_model, compile_body, compiles
from pipeline.model.checkpointing import enable_checkpointing
from pipeline.model.lm_head import chunk_lm_head
from pipeline.model.lora import add_lora
from pipeline.model.moe import ROUTER_AUX, router_aux_coef, router_aux_scope
from pipeline.model.weight_decay import param_groups
from pipeline.train.distributed import arch_list_for_deepspeed
from pipeline.train.gloo_gathers import wait_for_every_gather
from pipeline.train.schedule import lr_scheduler


class TrainModule(nn.Module):
    """Runs an objective inside the engine's forward, so ZeRO-3's hooks see one forward per objective even though
    objectives call the base model and the LM head separately (the head runs on target positions only)."""

    def __init__(self, lm: nn.Module, router_aux_coef: float | None = None):
        super().__init__()
        self.lm = lm
        # an MoE model's weight of its routers' loss (``pipeline.model.moe``); None: a dense model
        self.router_aux_coef = router_aux_coef

    def forward(self, objective, batch, counts: dict[str, int] | None = None):
        routed = self.training and self.router_aux_coef is not None
        with router_aux_scope() if routed else contextlib.nullcontext() as router_losses:
            out = objective(self.lm, batch) if counts is None else objective(self.lm, batch, counts)
        if isinstance(out, torch.Tensor):  # an embedding pass (``grad_cache.EmbedPass``)
            return out
        # plain tuples in a dict: ZeRO-3's hooks only see through tuples, lists and dicts; each row's loss and
        # targets follow when the objective made them (a batch with source ids)
        outputs = {name: (o.loss_sum, o.num_targets, o.num_correct)
                   + ((o.row_loss, o.row_targets) if o.row_loss is not None else ())
                   for name, o in out.items()}
        if routed:  # the mean of the call's body forwards counts as one target (the step counts calls)
            aux = torch.stack(router_losses).mean()
            one = torch.ones((), dtype=torch.long, device=aux.device)
            outputs[ROUTER_AUX] = (aux, one, torch.zeros_like(one))
        return outputs


def attn_implementation(config: ModelConfig, cuda: bool) -> str:
    """The HF attention implementation to train with; FlexAttention and varlen need CUDA (no FlexAttention backward,
    no varlen kernel on CPU) and have no attention dropout, so ``auto`` then falls back to SDPA and an explicit
    ``flex`` / ``varlen`` is an error."""
    setting = config.attn_implementation
    try:
        impl = resolve_implementation(setting, cuda)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if impl not in (FLEX, VARLEN):
        return impl
    if not cuda:
        raise ConfigError(f"model.attn_implementation: {setting} trains on CUDA only (torch has no FlexAttention "
                          "backward and no varlen kernel on CPU); use auto or sdpa")
    if config.attention_dropout > 0:
        if setting != "auto":
            raise ConfigError(f"model.attn_implementation: {setting} has no attention dropout, but "
                              f"model.attention_dropout is {config.attention_dropout}; use auto or sdpa")
        return "sdpa"
    return impl


def fused_kind(o: OptimConfig, cuda: bool) -> str:
    """The AdamW kernel of ``optim.fused``: auto is torch's fused AdamW on CUDA, the default foreach AdamW on CPU."""
    kind = o.fused if o.fused != "auto" else ("torch" if cuda else "none")
    if kind != "none" and not cuda:
        raise ConfigError(f"optim.fused: {kind} needs CUDA; use auto or none on CPU")
    return kind


def build_optimizer(groups: list[dict], o: OptimConfig, kind: str) -> torch.optim.Optimizer:
    """AdamW for the DeepSpeed engine with the kernel ``kind`` (:func:`fused_kind`)."""
    if kind == "deepspeed":
        from deepspeed.ops.adam import FusedAdam

        arch_list_for_deepspeed()  # its JIT build reads TORCH_CUDA_ARCH_LIST

        return FusedAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True if kind == "torch" else None)


def deepcompile(ds: dict) -> bool:
    """Whether the DeepSpeed config asks for DeepCompile (``"compile": {"deepcompile": true}``), DeepSpeed's
    compiler path: its own graph passes schedule ZeRO's gathers and reductions, and the engine compiles the
    whole module (:func:`build_engine`), so the per-layer ``model.compile`` stays off."""
    return bool(ds.get("compile", {}).get("deepcompile"))


def check_compile(exp: ExperimentConfig, ds: dict) -> None:
    """DeepCompile needs CUDA (DeepSpeed 0.19.7's ``is_deepcompile_supported``: its passes and native ops are
    CUDA-only) and compiles the whole module itself, so an explicit ``model.compile: true`` contradicts it."""
    if not deepcompile(ds):
        return
    if not is_deepcompile_supported():
        raise ConfigError("DeepSpeed config: compile.deepcompile needs CUDA (DeepSpeed's DeepCompile has no CPU "
                          "path); remove the \"compile\" section or use ds_configs/zero1.json here")
    if exp.model.compile is True:
        raise ConfigError("model.compile: true compiles each decoder layer, but the DeepSpeed config's "
                          "compile.deepcompile compiles the whole module; set model.compile=auto (or false)")


def build_device(ds: dict) -> torch.device | None:
    """Where the model is built: on the engine's device below ZeRO-3 (a 1b model built on the CPU and moved took
    51 s on an H200, its weight init running on the host), None under ZeRO-3, whose ``zero.Init`` places each
    rank's partition itself."""
    stage3 = ds.get("zero_optimization", {}).get("stage") == 3
    return None if stage3 else torch.device(get_accelerator().current_device_name())


def leaf_layers(exp: ExperimentConfig) -> bool:
    """Whether the decoder layers may be ZeRO-3 leaf modules. DeepSpeed reduces a leaf module's gradients in its
    backward hook, which runs once per forward call, so each micro-step must run a layer once before its backward:
    a phase of several objectives sums their losses into one backward after one body forward each (DeepSpeed 0.19
    then asserts on a parameter reduced twice: MAGNET + SSCL, tests/e2e/test_magnet_train.py). And a LoRA layer, whose
    frozen weights take no gradient, reaches its backward with them still partitioned (a size-0 weight in the
    input's gradient: tests/unit/model/test_lora.py). Those runs keep the per-module hooks. Every objective runs the body once
    a call (SimCSE its two views in one batch)."""
    return all(len(phase.objectives) == 1 for phase in exp.phases) and not exp.model.lora.r


def build_train_model(exp: ExperimentConfig, ds: dict, tokenizer, bf16: bool, objectives=(), *,
                      attn_implementation: str, fused: str, start_config: PretrainedConfig | None = None):
    """(HF model, engine module, the optimizer arguments of ``deepspeed.initialize``), with the implementation and
    kernel preflight chose (:func:`attn_implementation`, :func:`fused_kind`), and a checkpoint's ``start_config`` as
    preflight read and checked it. Objectives attach their trainable
    heads to the model first, so the engine partitions and optimises them too. The optimizer arguments are the
    client optimizer, or, when the DeepSpeed config builds its own (CPU Adam for offload), the parameter groups it
    optimises: either way weight decay skips the norms."""
    stage3 = ds.get("zero_optimization", {}).get("stage") == 3
    if stage3 and dist.is_initialized() and dist.get_backend() == "gloo":
        wait_for_every_gather()  # before zero.Init builds the model: its weight init gathers parameters
    # Alive during construction, HfDeepSpeedConfig makes from_config/from_pretrained build the model partitioned
    # under zero.Init while keeping HF's weight init; kept on the module so the weak reference stays valid.
    hf_ds = HfDeepSpeedConfig(ds) if stage3 else None
    info = tokenizer.info
    with build_device(ds) or contextlib.nullcontext():
        lm = build_model(exp.model.init, info.vocab_size, dtype=torch.bfloat16 if bf16 else torch.float32,
                         attn_implementation=attn_implementation, pad_token_id=info.pad_id,
                         bos_token_id=info.bos_id, eos_token_id=info.eos_id, config=start_config)
    lora = exp.model.lora
    if lora.r:
        add_lora(lm, lora.r, lora.alpha, lora.dropout, tuple(lora.targets))
    lm.train()  # from_pretrained returns the model in eval mode: dropout (SimCSE's positives) would be off
    lm.config.use_cache = False
    lm.config.attention_dropout = exp.model.attention_dropout
    for module in lm.modules():  # each attention layer copied the value from the config when it was built
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = exp.model.attention_dropout
    for objective in objectives:
        objective.attach(lm)
    if exp.model.lm_head_chunk:
        chunk_lm_head(lm, exp.model.lm_head_chunk)
    enable_checkpointing(lm, exp.model.activation_checkpointing)
    if stage3 and leaf_layers(exp):  # gather each layer whole in its own hook: one hook per layer instead of one per
        # Linear, norm and rotary module inside it, and, ZeRO-3's hooks being compiler-disabled, no graph break in a
        # compiled layer
        set_z3_leaf_modules(lm, list({type(layer) for layer in lm.model.layers}))
    cuda = get_accelerator().device_name() == "cuda"
    if compiles(exp.model.compile, cuda) and not deepcompile(ds):
        compile_body(lm)
    coef = router_aux_coef(lm.config, exp.model.router_aux_coef)
    cached = [o.name for o in objectives if getattr(o, "grad_cache", False)]
    if coef is not None and cached:
        raise ConfigError(f"model.init {exp.model.init!r} is a mixture-of-experts model, whose router loss needs "
                          f"each micro-batch's forward graph, which grad_cache (objective {cached[0]}) drops; set "
                          "its grad_cache=false (and train.grad_accum=1)")
    model = TrainModule(lm, coef)
    model._hf_ds_config = hf_ds
    groups = param_groups(model, exp.optim.weight_decay)
    optimizer = {"model_parameters": groups} if "optimizer" in ds else {
        "optimizer": build_optimizer(groups, exp.optim, fused)}
    return lm, model, optimizer


def parameter_line(model: nn.Module) -> str:
    """The model's trainable and total parameter counts as PEFT's ``print_trainable_parameters`` gives them; under
    ZeRO-3 each rank holds a partition, so a parameter counts its full size (``ds_numel``)."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"


def build_engine(exp: ExperimentConfig, ds: dict, tokenizer, bf16: bool, objectives=(), *, attn_implementation: str,
                 fused: str, start_config: PretrainedConfig | None = None) -> tuple[nn.Module, deepspeed.DeepSpeedEngine]:
    """(HF model, the DeepSpeed engine that trains it with the experiment's LR schedule), compiled by DeepCompile
    when the DeepSpeed config asks for it (:func:`deepcompile`)."""
    check_compile(exp, ds)
    lm, model, optimizer = build_train_model(exp, ds, tokenizer, bf16, objectives,
                                             attn_implementation=attn_implementation, fused=fused,
                                             start_config=start_config)
    engine, *_ = deepspeed.initialize(model=model, **optimizer, lr_scheduler=lr_scheduler(exp.train.steps, exp.optim),
                                      config=ds)
    if deepcompile(ds):
        engine.compile()
    return lm, engine
