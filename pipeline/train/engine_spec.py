"""What the DeepSpeed engine around the model is built from (:class:`EngineSpec`), decided once by the trainer's
preflight from the experiment, so the builder (:func:`pipeline.train.module.build_engine`) reads a spec, not the
experiment. Imports neither DeepSpeed nor the model: preflight stays light."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.experiment import ExperimentConfig, OptimConfig
from pipeline.train.compiling import leaf_layers
from pipeline.train.kernels import adamw_kernel


@dataclass(frozen=True)
class EngineSpec:
    optim: OptimConfig  # AdamW's settings and the LR schedule's
    steps: int  # train.steps: the LR schedule's length
    fused: str  # the AdamW kernel (pipeline.train.kernels.adamw_kernel)
    leaf_layers: bool = False  # under ZeRO-3, the decoder layers become leaf modules (compiling.leaf_layers)
    router_aux_coef: float | None = None  # an MoE model's weight of its routers' loss (None: a dense model)


def engine_spec(exp: ExperimentConfig, cuda: bool, router_aux_coef: float | None = None) -> EngineSpec:
    """The engine ``exp`` trains with on CUDA or not (the AdamW kernel), an MoE model's router loss weight
    ``router_aux_coef`` (preflight's ``router_loss_coef``) given."""
    return EngineSpec(exp.optim, exp.train.steps, adamw_kernel(exp.optim, cuda), leaf_layers(exp), router_aux_coef)
