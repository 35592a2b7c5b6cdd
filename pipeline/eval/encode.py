"""Sentence embeddings from any checkpoint of the project or HF directory (LLM2Vec's ``encode()``, MTEB's model).

A text is read as ``head, instruction + text, tail``. The instruction and the text are tokenized as one string,
as sentence-transformers and LLM2Vec do, and the instruction's own token count marks where the text starts; the
instruction conditions the text's states but is left out of pooling (LLM2Vec's ``skip_instruction``). ``layout``
picks head and tail:

- ``bos_eos``: BOS and EOS, as data prep writes every document and unit (the default);
- ``special``: what the tokenizer itself adds (``tokenizer(text)``: BOS for Llama, nothing for Qwen2), LLM2Vec's and
  sentence-transformers' layout;
- ``text``: the text tokens alone.

Pooling (special tokens are never pooled, except by ``last``):

- ``mean``: the mean over the text tokens (LLM2Vec's default; SimCSE pools the same tokens);
- ``weighted_mean``: text token j of n weighted j / sum(1..n) (LLM2Vec, after SGPT: later tokens have seen more);
- ``last``: the last token's state, the EOS under ``bos_eos`` (MAGNET's SSCL embedding).

Defaults come from the model's training record (``EvalModel.record``, docs/export.md); attention is the model's
(``EvalModel.attention``) unless given. Texts are sorted by length into batches, so little padding is computed,
and returned in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from pipeline.data.pairs import format_instruction, instructed_rows
from pipeline.eval.forward import hidden_states, pad_id, pad_rows
from pipeline.eval.load import EvalModel
from pipeline.export.record import LAYOUTS, POOLINGS
from pipeline.tokenizer import Tokenizer

PROBE = "probe text"  # what ``special`` tokenizes to find the tokenizer's own special tokens


def special_tokens(tokenizer: Tokenizer, layout: str) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the instruction and text under ``layout``; ``special`` asks the tokenizer what its
    own call adds around a text (e.g. Llama: BOS; Qwen2: nothing)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "text":
        return [], []
    if layout == "bos_eos":
        return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []), (
            [tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    bare = tokenizer.hf(PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer.hf(PROBE)["input_ids"]
    start = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    if start is None:
        raise ValueError(f"tokenizer {tokenizer.path}: its own special tokens change the text's tokens, so layout "
                         f"'special' cannot find the text in them; use layout 'bos_eos' or 'text'")
    return full[:start], full[start + len(bare):]


def rows_for(model: EvalModel, texts: Sequence[str], instruction: str | None, max_length: int, layout: str
             ) -> list[tuple[list[int], int, int]]:
    """(ids, first text position, end of text) per text; ``instruction`` is the verbatim prefix (already
    formatted, :func:`query_prefix`); the text is cut to fit ``max_length`` tokens. The layout is data prep's for
    pairs shards (``pipeline.data.pairs.instructed_rows``), so supervised training pools what this pools."""
    head, tail = special_tokens(model.tokenizer, layout)
    return instructed_rows(model.tokenizer, texts, [instruction or ""] * len(texts), max_length, head, tail)


def query_prefix(model: EvalModel, instruction: str | None) -> str:
    """The prefix an instruction becomes: the model's recorded ``instruction_format`` (a supervised run's, e.g.
    ``"{instruction}: "``) filled with it, or the instruction verbatim for a model recorded without one;
    ``None`` is the recorded default instruction."""
    record = model.record
    return format_instruction(record.instruction_format, record.instruction if instruction is None else instruction)


def pool(hidden: torch.Tensor, rows: Sequence[tuple[list[int], int, int]], pooling: str) -> torch.Tensor:
    """[B, d] embeddings of a right-padded batch."""
    if pooling == "last":
        last = torch.tensor([len(ids) - 1 for ids, _, _ in rows], device=hidden.device)
        return hidden[torch.arange(len(rows), device=hidden.device), last]
    weights = torch.zeros(hidden.shape[:2])
    for i, (_, start, end) in enumerate(rows):
        if end > start:
            w = torch.arange(1.0, end - start + 1) if pooling == "weighted_mean" else torch.ones(end - start)
            weights[i, start:end] = w / w.sum()
    return (hidden * weights.to(hidden).unsqueeze(-1)).sum(1)


@torch.no_grad()
def encode(model: EvalModel, texts: Sequence[str], instruction: str | None = None, pooling: str | None = None,
           batch_size: int = 32, attention: str | None = None, max_length: int = 512, progress: bool = False,
           layout: str | None = None) -> np.ndarray:
    """float32 [len(texts), hidden] embeddings; ``instruction`` (``""``: none), ``pooling``, ``layout`` and
    ``attention`` default to the model's (its training record, ``model.record``; ``attention``: ``model.attention``).
    A model whose record has an ``instruction_format`` (supervised training) takes bare task instructions and
    formats them as it was trained (``"Retrieve semantically similar text"`` -> ``"Retrieve ...: "``)."""
    instruction = query_prefix(model, instruction)
    pooling = pooling or model.record.pooling
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    texts = list(texts)
    rows = rows_for(model, texts, instruction, min(max_length, model.max_length), layout or model.record.layout)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out = np.zeros((len(rows), model.lm.config.hidden_size), dtype=np.float32)
    pad = pad_id(model.tokenizer)
    for first in tqdm(range(0, len(order), batch_size), desc="encode", disable=not progress, leave=False):
        chunk = order[first:first + batch_size]
        batch = [rows[i] for i in chunk]
        ids, doc_ids = pad_rows([r[0] for r in batch], pad, model.device)
        hidden = hidden_states(model.lm, ids, doc_ids, attention or model.attention)
        out[chunk] = pool(hidden, batch, pooling).float().cpu().numpy()
    return out
