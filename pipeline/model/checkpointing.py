"""Activation checkpointing of the decoder layers (``model.activation_checkpointing``): every layer, every k-th
layer, or selective, torchtitan's op-level policy: keep the outputs of the expensive ops (attention, every other
matmul) and recompute the cheap ones (norms, RoPE, SiLU, residual adds), which hold most of a layer's activation
bytes but little of its FLOPs. What it keeps per token and layer: :func:`selective_layer_bytes`."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import PretrainedConfig, PreTrainedModel

SELECTIVE = "selective"
_MM = torch.ops.aten.mm.default


def _saved_ops() -> frozenset:
    """The ops whose outputs the selective policy keeps: matmuls and every attention kernel this torch has (CPU's
    and CUDA's SDPA variants, FlexAttention, the variable-length kernel), as torchtitan lists them."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    ops = {_MM, torch._higher_order_ops.flex_attention}
    ops.update(getattr(aten, n).default for n in names if hasattr(aten, n))
    varlen = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn", None)
    if varlen is not None:
        ops.add(varlen.default)
    return frozenset(ops)


SAVED_OPS = _saved_ops()


def selective_contexts():
    """The (forward, recompute) contexts of one checkpointed layer call: keep the outputs of :data:`SAVED_OPS`
    except every second matmul (the forward and the recompute count their matmuls apart, so both pick the same)."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op is _MM:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_checkpointing(model: PreTrainedModel, setting: bool | str | int) -> None:
    """Checkpoint the decoder layers as ``setting`` says (false: none; true or 1: every layer; k: every k-th;
    ``selective``: every layer under :func:`selective_contexts`). Non-reentrant, so it composes with
    ``torch.compile`` of the layer (which then traces the checkpoint) and with ZeRO-3's gathers."""
    if setting is False:
        return
    kwargs = {"use_reentrant": False}
    if setting == SELECTIVE:
        kwargs["context_fn"] = selective_contexts
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    every = setting if type(setting) is int else 1
    for i, layer in enumerate(model.model.layers):
        layer.gradient_checkpointing = i % every == 0


def selective_layer_bytes(config: PretrainedConfig) -> int:
    """Bytes per token one selectively checkpointed bf16 layer keeps: its input (2 h), the kept matmul outputs
    (the 1st, 3rd, 5th and 7th of q k v o gate up down: q, v, gate and down, 2 (2 h + kv + f)) and the attention
    kernel's output and fp32 log-sum-exp (2 h + 4 heads)."""
    h, heads = config.hidden_size, config.num_attention_heads
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // heads)
    return 2 * h + 2 * (2 * h + kv + config.intermediate_size) + 2 * h + 4 * heads
