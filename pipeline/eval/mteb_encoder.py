"""Any checkpoint as an MTEB (2.x) model: ``mteb.evaluate(MTEBEncoder("runs/x"), mteb.get_tasks(...))``.

MTEB hands an encoder a DataLoader of batches (``{"text": [...]}``) with the task's metadata and the prompt type
(query / document); ``encode`` embeds the texts with ``pipeline.eval.encode`` and the model's recorded pooling,
layout and attention. The instruction is MTEB's prompt lookup over ``instructions`` (keys: a task name, a task type
such as ``"STS"``, a prompt type such as ``"query"``, or ``"TaskName-query"``; MTEB's own priority order), else
``instruction``, else the model's recorded one. Similarity is cosine. Needs ``mteb`` (the ``embeddings`` extra).

A model trained by the supervised objective (its record has an ``instruction_format``) takes bare task
instructions, formatted as in training (``encode`` does it), and, as LLM2Vec trains and evaluates it, instructs the
queries of a retrieval task only: its documents get no instruction unless a key names them (``"document"``,
``"TaskName-document"``, ...).
"""

from __future__ import annotations

import numpy as np
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction
from mteb.types import PromptType

from pipeline.eval.encode import encode
from pipeline.eval.load import EvalModel, load_model


class MTEBEncoder(AbsEncoder):
    def __init__(self, model: EvalModel | str, revision: str | None = None, *, pooling: str | None = None,
                 instruction: str | None = None, instructions: dict[str, str] | None = None,
                 attention: str | None = None, layout: str | None = None, max_length: int = 512, **load_kwargs):
        """MTEB's ``(model_name, revision, device=...)`` signature: ``model`` is a run or HF directory (or a loaded
        ``EvalModel``); ``revision`` is unused (local directories have none); ``load_kwargs`` go to ``load_model``."""
        self.model = load_model(model, **load_kwargs) if isinstance(model, str) else model
        self.pooling, self.layout, self.attention, self.max_length = pooling, layout, attention, max_length
        self.instruction = instruction
        self.model_prompts = self.validate_task_to_prompt_name(dict(instructions or {}))
        self.mteb_model_meta = ModelMeta.create_empty({
            "name": f"decoder-encoders/{self.model.run_dir or self.model.hf_dir}".replace("//", "/"),
            "revision": str(self.model.step) if self.model.step is not None else "hf",
            "embed_dim": self.model.lm.config.hidden_size, "similarity_fn_name": ScoringFunction.COSINE,
            "framework": ["PyTorch"], "max_tokens": max_length})

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs
               ) -> np.ndarray:
        texts = [text for batch in inputs for text in batch["text"]]
        name = self.get_prompt_name(task_metadata, prompt_type)  # the key of model_prompts MTEB's priority picks
        instruction = self.model_prompts[name] if name else self.instruction
        documents = prompt_type is not None and PromptType(prompt_type) == PromptType.document
        if documents and self.model.record.instruction_format is not None and not (name or "").endswith("document"):
            instruction = ""  # supervised training instructs queries only
        return encode(self.model, texts, instruction, self.pooling, kwargs.get("batch_size", 32), self.attention,
                      self.max_length, kwargs.get("show_progress_bar", False), self.layout)
