"""LoRA adapters (PEFT's) on the decoder's projections, and their merge into plain weights for the HF export.

LLM2Vec trains every stage as LoRA (r 16, alpha 32, dropout 0.05 on q/k/v/o/gate/up/down) and merges each
stage's adapter into the weights before the next one starts. Here the adapter is injected in place
(``peft.inject_adapter_in_model``), so the model stays the HF class the objectives call (``model.model``,
``model.lm_head``) and DeepSpeed partitions the adapter's parameters like any other; everything but the adapter
(and the objectives' own heads, attached afterwards) is frozen. The export merges ``W + (alpha / r) B A`` into each
target's weight, so an export is an ordinary checkpoint that transformers loads alone, and a run continued from it
(SimCSE after MNTP) starts a fresh adapter on the merged weights. The export also writes the adapter alone in
PEFT's own format (:func:`save_adapter`), which ``peft.PeftModel.from_pretrained(base, DIR/adapter)`` puts on the
model the run started from, as LLM2Vec publishes its stages.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the experiment's LLM2VEC_TARGETS must not import torch
    import torch
    from torch import nn
    from transformers import PretrainedConfig

LLM2VEC_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_A, _B, _BASE = ".lora_A.default.weight", ".lora_B.default.weight", ".base_layer.weight"
ADAPTER_DIR = "adapter"  # inside an HF export


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, targets: tuple[str, ...]) -> None:
    """Inject the adapter into ``model`` in place and freeze every parameter but the adapter's."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets)),
                            model)
    for name, p in model.named_parameters():
        p.requires_grad = ".lora_" in name


def merge_lora(state_dict: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The state dict with each adapted weight merged (``base + scale * B @ A``, computed in fp32) under its plain
    name; a state dict without an adapter comes back unchanged."""
    merged = {}
    for key, value in state_dict.items():
        if key.endswith((_A, _B)):
            continue
        if key.endswith(_BASE):
            stem = key[: -len(_BASE)]
            a, b = state_dict[stem + _A].float(), state_dict[stem + _B].float()
            merged[stem + ".weight"] = (value.float() + scale * (b @ a)).to(value.dtype)
        else:
            merged[key.replace(".base_layer.", ".")] = value
    return merged


def save_adapter(state_dict: dict[str, torch.Tensor], lora, base: str, out: str, base_prefix: str = "") -> None:
    """Write the adapter of ``state_dict`` (HF names) as PEFT saves one: ``adapter_config.json`` naming ``base``
    (the run's start checkpoint: ``pipeline.export.hub.adapter_base``) and ``adapter_model.safetensors``. ``base_prefix`` (e.g. ``"model."``) is dropped
    from the names, for an adapter on the base model (``AutoModel``, an encoder's) rather than the causal LM."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    adapter = {"base_model.model." + key.removeprefix(base_prefix).replace(".default.", "."): value.contiguous()
               for key, value in state_dict.items() if key.endswith((_A, _B))}
    task = "FEATURE_EXTRACTION" if base_prefix else "CAUSAL_LM"
    LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets),
               base_model_name_or_path=base, task_type=task).save_pretrained(out)
    save_file(adapter, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})


def lora_params(config: PretrainedConfig, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters of a Llama-style ``config``: r (in + out) per adapted projection and layer."""
    h, f, heads, kv = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                       config.num_key_value_heads)
    d = getattr(config, "head_dim", None) or h // heads
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    return config.num_hidden_layers * sum(r * sum(shapes[t]) for t in targets)
