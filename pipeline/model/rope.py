"""RoPE settings changed during a run (a context-extension phase, docs/training.md): the config's theta and context,
and the rotary embeddings' buffers recomputed from them as a model built with that config computes them.

transformers 5 keeps theta in ``config.rope_parameters`` (``{"rope_type", "rope_theta", ...}``, or one such dict
per attention layer type, as Gemma 3's); the rotary module derives ``inv_freq`` from it once, at construction, in a
non-persistent buffer (in no checkpoint, and never partitioned by ZeRO-3, so every rank holds and updates all of
it). A resumed run builds the start model again and sets the settings of its phase before its first step.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameter_sets(config: PretrainedConfig) -> list[dict]:
    """The config's RoPE parameter dicts: one, or one per attention layer type."""
    params = config.rope_parameters or {}
    return [params] if "rope_theta" in params else [v for v in params.values() if isinstance(v, dict)]


def configure_rope(config: PretrainedConfig, theta: float | None, context: int) -> bool:
    """Set ``theta`` (None: keep) in every RoPE parameter set and raise ``max_position_embeddings`` to ``context``;
    True when the config changed."""
    sets = rope_parameter_sets(config)
    changed = theta is not None and any(s["rope_theta"] != theta for s in sets)
    for s in sets if theta is not None else ():
        s["rope_theta"] = float(theta)
    if context > config.max_position_embeddings:
        config.max_position_embeddings, changed = context, True
    return changed


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if any(name.endswith("inv_freq") for name in m._buffers)
            and hasattr(m, "compute_default_rope_parameters")]


def _recompute(module: torch.nn.Module) -> None:
    """``module``'s buffers from its config, as its ``__init__`` computes them (in the buffers' dtype and device)."""
    for layer_type in module.rope_type if isinstance(module.rope_type, dict) else [None]:
        rope_type = module.rope_type[layer_type] if layer_type else module.rope_type
        init = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
        kwargs = {"layer_type": layer_type} if layer_type else {}
        prefix = f"{layer_type}_" if layer_type else ""
        buffer = getattr(module, f"{prefix}inv_freq")
        inv_freq, scaling = init(module.config, **kwargs)
        with torch.no_grad():
            buffer.copy_(inv_freq)
            getattr(module, f"{prefix}original_inv_freq").copy_(inv_freq)
        setattr(module, f"{prefix}attention_scaling", scaling)
    module.max_seq_len_cached = module.original_max_seq_len = module.config.max_position_embeddings


def set_rope(model: torch.nn.Module, theta: float | None, context: int) -> bool:
    """:func:`configure_rope` on the model's config (and its rotary modules', where they hold another), then their
    buffers recomputed; True when anything changed."""
    rotary = _rotary_modules(model)
    configs = {id(c): c for c in [model.config, *(m.config for m in rotary)]}
    changed = [configure_rope(c, theta, context) for c in configs.values()]
    if any(changed):
        for module in rotary:
            _recompute(module)
    return any(changed)
