"""What the DeepSpeed engine around the model is built from (:class:`EngineSpec`), decided once by the trainer's
preflight from the experiment, so the builder (:func:`pipeline.train.module.build_engine`) reads a spec, not the
experiment. Imports neither DeepSpeed nor the model: preflight stays light."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.experiment import ExperimentConfig, OptimConfig
from pipeline.train.compiling import leaf_layers
from pipeline.train.kernels import adamw_kernel


@dataclass(frozen=True)
class AdamWSpec:
    """AdamW's settings (``optim``)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class Schedule:
    """The LR schedule over a run of ``total`` optimizer steps, its warmup and decay resolved once (``optim``)."""

    kind: str  # optim.schedule: wsd, cosine or constant
    total: int
    warmup: int  # steps of the linear warmup
    decay: int  # steps of wsd's final decay (0 for the others)
    min_lr_ratio: float


def adamw(o: OptimConfig) -> AdamWSpec:
    return AdamWSpec(o.lr, o.betas, o.eps, o.weight_decay)


def lr_schedule(o: OptimConfig, total: int) -> Schedule:
    return Schedule(o.schedule, total, o.warmup(total), o.decay(total), o.min_lr_ratio)


@dataclass(frozen=True)
class EngineSpec:
    adamw: AdamWSpec
    schedule: Schedule
    fused: str  # the AdamW kernel (pipeline.train.kernels.adamw_kernel)
    leaf_layers: bool = False  # under ZeRO-3, the decoder layers become leaf modules (compiling.leaf_layers)
    router_aux_coef: float | None = None  # an MoE model's weight of its routers' loss (None: a dense model)


def engine_spec(exp: ExperimentConfig, cuda: bool, router_aux_coef: float | None = None) -> EngineSpec:
    """The engine ``exp`` trains with on CUDA or not (the AdamW kernel), an MoE model's router loss weight
    ``router_aux_coef`` (preflight's ``router_loss_coef``) given."""
    o = exp.optim
    return EngineSpec(adamw(o), lr_schedule(o, exp.train.steps), adamw_kernel(o, cuda), leaf_layers(exp),
                      router_aux_coef)
