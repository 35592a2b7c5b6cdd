"""An export's weights in the form of the class its config names, so each load is silent.

A causal-LM export (CLM) is ``save_pretrained``'s own: the ``*ForCausalLM`` class with its LM head. An encoder
export names the base class (e.g. ``LlamaModel``, what ``AutoModel`` and sentence-transformers load) and keeps
only the base model's weights in ``model.safetensors``: a causal-LM checkpoint read by ``AutoModel`` would report
``lm_head.weight`` as UNEXPECTED. The LM head, which MNTP/MLM evaluation and infilling need, lies beside them in
``lm_head.safetensors``; the index ``model.safetensors.index.lm.json`` lists both files, so
``AutoModelForCausalLM.from_pretrained(DIR, variant="lm")`` loads the whole causal LM (transformers' own variant
lookup). The project's loader passes that variant where the index exists
(:func:`pipeline.model.load_hf.causal_lm_kwargs`).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from pipeline.model.load_hf import LM_INDEX

HEAD = "lm_head."
HEAD_FILE = "lm_head.safetensors"
BASE_INDEX = "model.safetensors.index.json"  # save_pretrained's, when it shards the weights


def _base_weight_map(out: str) -> dict[str, str]:
    index = os.path.join(out, BASE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        return {key: "model.safetensors" for key in f.keys()}


def save_weights(lm: PreTrainedModel, state_dict: dict[str, torch.Tensor], out: str, encoder: bool) -> None:
    """``lm``'s config and ``state_dict`` (HF names) into ``out``: the causal LM, or for an ``encoder`` the base
    model with the LM head beside it (module docstring)."""
    if not encoder:
        lm.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        return
    head = {k: v.contiguous() for k, v in state_dict.items() if k.startswith(HEAD)}
    # the base model's save names its class in config.json and keeps the causal LM's parameter names
    lm.base_model.save_pretrained(out, state_dict={k: v for k, v in state_dict.items() if k not in head},
                                  safe_serialization=True)
    if getattr(lm.config, "tie_word_embeddings", False):
        head = {}  # the head is the embedding (SmolLM2): from_pretrained ties it, as save_pretrained leaves it out
    else:
        save_file(head, os.path.join(out, HEAD_FILE), metadata={"format": "pt"})
    weight_map = {**_base_weight_map(out), **dict.fromkeys(head, HEAD_FILE)}
    with open(os.path.join(out, LM_INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")
