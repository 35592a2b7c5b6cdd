"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): which configs route, and their routers'
auxiliary load-balancing loss.

The HF ``*ForCausalLM`` adds ``router_aux_loss_coef`` times Switch Transformer's load-balancing loss to its LM loss
(``load_balancing_loss_func``); the objectives here call the body (``model.model``) and the LM head apart, so that
loss is theirs to add. Inside :func:`router_aux_scope` (the engine's module opens one around each objective call
while training) ``Objective.hidden_states`` asks the body for its router logits and records the loss of each body
forward over its non-padding tokens; the step weighs the mean of an objective call's forwards like any other loss
(``loss/router_aux``). Outside a scope (evaluation, the export, tests) the body runs exactly as a dense one.

transformers keeps a layer's experts as 3D parameters of one module that runs on every forward (the routing
indexes into them), so under ZeRO-3 experts are ordinary partitioned parameters and every rank gathers the same
modules in the same order whatever its tokens' routes: no ZeRO-3 leaf modules are needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from transformers import PretrainedConfig

ROUTER_AUX = "router_aux"  # the loss's name in the step's losses and metrics (``loss/router_aux``)

_SCOPE: ContextVar[list[torch.Tensor] | None] = ContextVar("router_aux", default=None)


def num_experts(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer (Mixtral's ``num_local_experts``, the others' ``num_experts``); 0 for a dense
    decoder."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def is_moe(config: PretrainedConfig) -> bool:
    return num_experts(config) > 0 and getattr(config, "num_experts_per_tok", None) is not None


def router_aux_coef(config: PretrainedConfig, configured: float | None) -> float | None:
    """The weight of the routers' loss in the objective's: ``model.router_aux_coef`` where set, else the
    checkpoint's ``router_aux_loss_coef``; None for a dense decoder (no routers, no loss)."""
    if not is_moe(config):
        return None
    return configured if configured is not None else float(config.router_aux_loss_coef)


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], valid: torch.Tensor, experts: int,
                        top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as transformers defines it (``load_balancing_loss_func``): the
    experts' share of the top-k assignments times their mean router probability, each taken over all MoE layers
    and the tokens where ``valid`` [B, L] (padding routes nothing), summed and times ``experts``. A batch without
    a valid token gives 0 (transformers' gives NaN)."""
    mask = valid.reshape(-1).float()
    assigned = torch.zeros(experts, dtype=torch.float32, device=valid.device)
    probability = torch.zeros(experts, dtype=torch.float32, device=valid.device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = assigned.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probability = probability + (probs * mask[:, None]).sum(0)
    rows = (mask.sum() * len(router_logits)).clamp(min=1.0)
    return (assigned / rows * probability / rows).sum() * experts


@contextlib.contextmanager
def router_aux_scope() -> Iterator[list[torch.Tensor]]:
    """Collect the router loss of every MoE body forward run inside the block (a list of fp32 scalars)."""
    losses: list[torch.Tensor] = []
    token = _SCOPE.set(losses)
    try:
        yield losses
    finally:
        _SCOPE.reset(token)


def routing(config: PretrainedConfig) -> bool:
    """Whether a body forward of ``config``'s model should return its router logits: an MoE model in a scope."""
    return _SCOPE.get() is not None and is_moe(config)


def record(config: PretrainedConfig, router_logits: tuple[torch.Tensor, ...], valid: torch.Tensor) -> None:
    """Add one body forward's router loss (its ``router_logits``; ``valid`` marks its non-padding tokens) to the
    open scope."""
    _SCOPE.get().append(load_balancing_loss(router_logits, valid, num_experts(config), config.num_experts_per_tok))
