"""An HF directory loaded as a whole causal LM, the one way training (``pipeline.model.build``, a start checkpoint)
and evaluation (``pipeline.eval.load``, the model under evaluation) both load one.

An encoder export keeps its LM head beside the base model's weights, listed with them in the index of the variant
``lm`` (``pipeline.export.weights``); :func:`causal_lm_kwargs` asks ``from_pretrained`` for that variant where the
index exists. A loaded config gets HF's causal default back (:func:`project_masks`)."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

LM_VARIANT = "lm"
LM_INDEX = f"model.safetensors.index.{LM_VARIANT}.json"


def causal_lm_kwargs(hf_dir: str | os.PathLike) -> dict:
    """``from_pretrained`` keywords that load ``hf_dir`` as a whole causal LM (LM head included)."""
    return {"variant": LM_VARIANT} if os.path.isfile(os.path.join(hf_dir, LM_INDEX)) else {}


def project_masks(config: PretrainedConfig) -> PretrainedConfig:
    """HF's causal default back on a loaded config. A bidirectional export says ``is_causal: false`` (so plain
    transformers runs it bidirectionally), which would also turn the project's causal requests (``is_causal=True``
    and no mask, ``pipeline.model.attention``) bidirectional; in the project its own masks decide."""
    config.is_causal = True
    return config


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype, attn_implementation: str,
            config: PretrainedConfig | None = None) -> PreTrainedModel:
    """The causal LM in the local directory ``path`` (its own ``config.json``, or ``config`` already read), its
    config's masks projected."""
    lm = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn_implementation,
                                              local_files_only=True, **causal_lm_kwargs(path))
    project_masks(lm.config)
    return lm
