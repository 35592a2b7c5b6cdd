"""Any checkpoint as an MTEB (2.x) model: ``mteb.evaluate(MTEBEncoder("runs/x"), mteb.get_tasks(...))``.

MTEB hands an encoder a DataLoader of batches (``{"text": [...]}``) with the task's metadata and the prompt type
(query / document / none for symmetric tasks); ``encode`` embeds the texts with ``pipeline.eval.encode`` and the
model's recorded pooling, layout and attention. Similarity is cosine. Needs ``mteb`` (the ``embeddings`` extra).
Texts are batched by ``max_tokens`` padded tokens (MTEB's ``batch_size`` is not used). Under ``torchrun`` the
encoder starts the process group (``pipeline.eval.ranks.init_from_env``; a model path given with ``device="cuda"``
loads on ``cuda:LOCAL_RANK``), each ``encode`` splits its texts over the ranks and every rank gets all embeddings, so
every rank runs ``mteb.evaluate`` alike (docs/evaluation.md).

The instruction of a query, or of every text of a symmetric task (STS, classification, clustering, pair
classification), is, first found:

1. ``instructions``: MTEB's prompt lookup (keys: a task name, a task type such as ``"STS"``, a prompt type such as
   ``"query"``, or ``"TaskName-query"``; MTEB's own priority order);
2. ``instruction``;
3. the ``task_instructions`` table (a JSON file ``{task name: instruction}``; default: LLM2Vec's, below), else
   MTEB's own instruction for the task: LLM2Vec's evaluation (``experiments/mteb_eval_custom.py``);
4. the model's recorded one.

A document (retrieval, reranking) gets none unless an ``instructions`` key names documents (``"document"``,
``"TaskName-document"``, ...): LLM2Vec's ``encode_corpus``, and the project's ``zero_shot_retrieval``.

Instructions from 1, 2 and 4 are used as ``encode`` takes them: bare for a model recorded with an
``instruction_format`` (supervised training), verbatim prefixes otherwise. A table or MTEB instruction is made bare
as LLM2Vec writes it (``"Given a claim, ...:"``: the trailing ``:``, or MTEB's ``.``, dropped) and joined by the
model's ``instruction_format``, else ``"{instruction}: "``, so the model reads LLM2Vec's ``"Given a claim, ...: text"``.
"""

from __future__ import annotations

import json
import os

import numpy as np
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction
from mteb.types import PromptType

from pipeline.data.format.instructions import DEFAULT_FORMAT, format_instruction
from pipeline.eval.encode import MAX_TOKENS, encode
from pipeline.eval.load import EvalModel, load_model
from pipeline.eval.ranks import init_from_env

# McGill-NLP/llm2vec's test_configs/mteb/task_to_instructions.json (commit 3c633e8, 67 tasks), verbatim; MIT licence,
# Copyright (c) 2024 McGill NLP
LLM2VEC_INSTRUCTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llm2vec_mteb_instructions.json")


def load_task_instructions(path: str) -> dict[str, str]:
    """A ``{task name: instruction}`` JSON file, checked."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"task_instructions {path}: cannot read it as JSON ({e}); give a JSON object "
                         f'{{"TaskName": "instruction", ...}}') from None
    bad = (table if not isinstance(table, dict)
           else next(({k: v} for k, v in table.items() if not isinstance(v, str) or not v.strip()), None))
    if bad is not None:
        raise ValueError(f"task_instructions {path}: expected a JSON object of non-empty strings "
                         f'{{"TaskName": "instruction", ...}}, got {json.dumps(bad)[:80]}')
    return table


def bare(instruction: str) -> str:
    """LLM2Vec's instruction without the ``:`` it ends with (``llm2vec_instruction`` adds one, dropping a final
    ``.``), so the model's own format joins it."""
    instruction = instruction.strip()
    return instruction[:-1].rstrip() if instruction.endswith(":") else instruction.strip(".")


class MTEBEncoder(AbsEncoder):
    def __init__(self, model: EvalModel | str, revision: str | None = None, *, pooling: str | None = None,
                 instruction: str | None = None, instructions: dict[str, str] | None = None,
                 task_instructions: str | None = LLM2VEC_INSTRUCTIONS, attention: str | None = None,
                 layout: str | None = None, max_length: int = 512, max_tokens: int = MAX_TOKENS,
                 dim: int | None = None, **load_kwargs):
        """MTEB's ``(model_name, revision, device=...)`` signature: ``model`` is a run or HF directory (or a loaded
        ``EvalModel``); ``revision`` is unused (local directories have none); ``load_kwargs`` go to ``load_model``.
        ``task_instructions``: the table's path; None: no table nor MTEB instructions (the model's recorded one).
        ``max_tokens``: padded tokens per batch of ``encode``; ``dim``: the embedding's leading dims it keeps (a
        Matryoshka model's; None: the recorded ``truncate_dim``, else all)."""
        self.task_instructions = None if task_instructions is None else load_task_instructions(task_instructions)
        device = init_from_env(load_kwargs.pop("device", "cpu"))
        self.model = load_model(model, device=device, **load_kwargs) if isinstance(model, str) else model
        self.pooling, self.layout, self.attention, self.max_length = pooling, layout, attention, max_length
        self.max_tokens, self.dim = max_tokens, dim or self.model.record.truncate_dim
        self.instruction = instruction
        self.model_prompts = self.validate_task_to_prompt_name(dict(instructions or {}))
        self.mteb_model_meta = ModelMeta.create_empty({
            "name": f"decoder-encoders/{self.model.run_dir or self.model.hf_dir}".replace("//", "/"),
            "revision": str(self.model.step) if self.model.step is not None else "hf",
            "embed_dim": self.dim or self.model.lm.config.hidden_size, "similarity_fn_name": ScoringFunction.COSINE,
            "framework": ["PyTorch"], "max_tokens": max_length})

    def task_instruction(self, task_metadata, prompt_type: PromptType | None) -> str | None:
        """The instruction ``encode`` gets for these texts (``""``: none; None: the model's recorded one)."""
        name = self.get_prompt_name(task_metadata, prompt_type)  # the key of model_prompts MTEB's priority picks
        if prompt_type is not None and PromptType(prompt_type) == PromptType.document:
            return self.model_prompts[name] if (name or "").endswith("document") else ""
        if name:
            return self.model_prompts[name]
        if self.instruction is not None or self.task_instructions is None:
            return self.instruction
        given = self.task_instructions.get(task_metadata.name) or self.get_instruction(task_metadata, prompt_type)
        if not isinstance(given, str) or not bare(given):
            return None
        fmt = self.model.record.instruction_format
        return bare(given) if fmt is not None else format_instruction(DEFAULT_FORMAT, bare(given))

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs
               ) -> np.ndarray:
        texts = [text for batch in inputs for text in batch["text"]]
        return encode(self.model, texts, self.task_instruction(task_metadata, prompt_type), self.pooling,
                      self.max_tokens, self.attention, self.max_length, kwargs.get("show_progress_bar", False),
                      self.layout, dim=self.dim)
