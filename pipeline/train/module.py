"""The engine around the model: the model as the DeepSpeed engine sees it (:class:`TrainModule`), its optimizer,
and the engine itself (:func:`build_engine`). The model is preflight's spec built by
:func:`pipeline.model.build.build_model`, the engine preflight's :class:`~pipeline.train.engine_spec.EngineSpec`; this module adds what training
needs around the model and checks nothing (the HF export: :mod:`pipeline.train.export`)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import set_z3_leaf_modules
from torch import nn
from transformers.integrations import HfDeepSpeedConfig

from pipeline.model.build import ModelSpec, build_model
from pipeline.model.moe import ROUTER_AUX, router_aux_scope
from pipeline.model.weight_decay import param_groups
from pipeline.objectives.base import ObjectiveOutput
from pipeline.train.async_checkpoint import WeightsOnlyLoads
from pipeline.train.compiling import deepcompile
from pipeline.train.deepspeed_ops import arch_list_for_deepspeed
from pipeline.train.engine_spec import AdamWSpec, EngineSpec
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
        # each loss's ``ObjectiveOutput``: named tuples in a dict, which ZeRO-3's hooks see through
        if routed:  # the mean of the call's body forwards counts as one target (the step counts calls)
            aux = torch.stack(router_losses).mean()
            one = torch.ones((), dtype=torch.long, device=aux.device)
            out[ROUTER_AUX] = ObjectiveOutput(aux, one, torch.zeros_like(one))
        return out


BUILD_ERRORS = (RuntimeError, ImportError, OSError, subprocess.CalledProcessError)  # a failed JIT build of an op


def build_optimizer(groups: list[dict], o: AdamWSpec, kernel: str) -> torch.optim.Optimizer:
    """AdamW for the DeepSpeed engine with the kernel ``kernel`` (:func:`adamw_kernel`). DeepSpeed's FusedAdam is built
    on first use; where that build fails (a CUDA toolkit whose headers DeepSpeed's op builder cannot compile against)
    the run trains with torch's fused AdamW, the same update, and says so."""
    if kernel == "deepspeed":
        arch_list_for_deepspeed()  # its JIT build reads TORCH_CUDA_ARCH_LIST
        try:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adam_w_mode=True)
        except BUILD_ERRORS as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            print(f"warning: optim.fused: deepspeed: DeepSpeed's FusedAdam could not be built ({reason}); training "
                  "with torch's fused AdamW instead (optim.fused: torch)", file=sys.stderr, flush=True)
            kernel = "torch"
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True if kernel == "torch" else None)


def build_device(ds: dict) -> torch.device | None:
    """Where the model is built: on the engine's device below ZeRO-3 (a 1b model built on the CPU and moved took
    51 s on an H200, its weight init running on the host), None under ZeRO-3, whose ``zero.Init`` places each
    rank's partition itself."""
    stage3 = ds.get("zero_optimization", {}).get("stage") == 3
    return None if stage3 else torch.device(get_accelerator().current_device_name())


def build_train_model(ds: dict, model: ModelSpec, engine: EngineSpec, objectives=()):
    """(HF model, engine module, the optimizer arguments of ``deepspeed.initialize``): the model preflight
    specified (``model``, :func:`~pipeline.model.build.build_model`), built where the engine wants it (under ZeRO-3
    partitioned as it is constructed), the objectives' trainable heads attached (so the engine partitions and
    optimises them too), the layers made ZeRO-3 leaf modules where ``engine`` says they may be, and an MoE model's
    router loss weighted. The optimizer arguments are the client optimizer, or, when the DeepSpeed config builds
    its own (CPU Adam for offload), the parameter groups it optimises: either way weight decay skips the norms."""
    stage3 = ds.get("zero_optimization", {}).get("stage") == 3
    # Alive during construction, HfDeepSpeedConfig makes from_config/from_pretrained build the model partitioned
    # under zero.Init while keeping HF's weight init; kept on the module so the weak reference stays valid.
    hf_ds = HfDeepSpeedConfig(ds) if stage3 else None
    lm = build_model(model, build_device(ds))
    lm.train()  # from_pretrained returns the model in eval mode: dropout (SimCSE's positives) would be off
    for objective in objectives:
        objective.attach(lm)
    if stage3 and engine.leaf_layers:  # gather each layer whole in its own hook: one hook per layer instead of one
        # per Linear, norm and rotary module inside it, and, ZeRO-3's hooks being compiler-disabled, no graph break
        # in a compiled layer
        set_z3_leaf_modules(lm, list({type(layer) for layer in lm.model.layers}))
    module = TrainModule(lm, engine.router_aux_coef)
    module._hf_ds_config = hf_ds
    groups = param_groups(module, engine.adamw.weight_decay)
    optimizer = {"model_parameters": groups} if "optimizer" in ds else {
        "optimizer": build_optimizer(groups, engine.adamw, engine.fused)}
    return lm, module, optimizer


def parameter_line(model: nn.Module) -> str:
    """The model's trainable and total parameter counts as PEFT's ``print_trainable_parameters`` gives them; under
    ZeRO-3 each rank holds a partition, so a parameter counts its full size (``ds_numel``)."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"


def build_engine(ds: dict, model: ModelSpec, engine: EngineSpec,
                 objectives=()) -> tuple[nn.Module, deepspeed.DeepSpeedEngine]:
    """(HF model, the DeepSpeed engine that trains it with the LR schedule): :func:`build_train_model` initialised,
    compiled by DeepCompile when the DeepSpeed config asks for it (preflight checked that it can)."""
    lm, module, optimizer = build_train_model(ds, model, engine, objectives)
    initialized, *_ = deepspeed.initialize(model=module, **optimizer, config=ds,
                                           lr_scheduler=lr_scheduler(engine.schedule))
    initialized.checkpoint_engine = WeightsOnlyLoads(initialized.checkpoint_engine)  # a resume runs no code from files
    if deepcompile(ds):
        initialized.compile()
    return lm, initialized
