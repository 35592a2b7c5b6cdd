"""Sentence embeddings from any checkpoint of the project or HF directory (LLM2Vec's ``encode()``, MTEB's model).

A text is read as ``BOS, instruction tokens, text tokens, EOS`` (the instruction and the text tokenized apart, so
the boundary is exact; SSCL trains on the same layout). The instruction conditions the text's states but is left
out of pooling, as LLM2Vec's ``skip_instruction``:

- ``mean``: the mean over the text tokens (LLM2Vec's default; SimCSE pools the same tokens);
- ``weighted_mean``: text token j of n weighted j / sum(1..n) (LLM2Vec, after SGPT: later tokens have seen more);
- ``last``: the last token's state, the EOS when the tokenizer has one (MAGNET's SSCL embedding).

Attention is the model's (``EvalModel.attention``: bidirectional for bidirectionally trained runs) unless given.
Texts are sorted by length into batches, so little padding is computed, and returned in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from pipeline.eval.forward import hidden_states, pad_id, pad_rows
from pipeline.eval.model import EvalModel, load_model

POOLINGS = ("mean", "last", "weighted_mean")


def layout(model: EvalModel, texts: Sequence[str], instruction: str | None, max_length: int
           ) -> list[tuple[list[int], int, int]]:
    """(ids, first text position, end of text) per text; the text is cut to fit ``max_length`` tokens."""
    tok = model.tokenizer
    head = ([tok.bos_id] if tok.bos_id is not None else []) + (tok.encode_batch([instruction])[0] if instruction else [])
    tail = [tok.eos_id] if tok.eos_id is not None else []
    room = max_length - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"the instruction takes {len(head)} of the {max_length} tokens allowed; shorten it or "
                         f"raise max_length")
    rows = []
    for ids in tok.encode_batch(list(texts)):
        ids = ids[:room]
        rows.append((head + ids + tail, len(head), len(head) + len(ids)))
    return rows


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
def encode(model: EvalModel, texts: Sequence[str], instruction: str | None = None, pooling: str = "mean",
           batch_size: int = 32, attention: str | None = None, max_length: int = 512, progress: bool = False
           ) -> np.ndarray:
    """float32 [len(texts), hidden] embeddings; ``attention`` defaults to the model's (``model.attention``)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    texts = list(texts)
    rows = layout(model, texts, instruction, min(max_length, model.max_length))
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


class SentenceEncoder:
    """A sentence-transformers-compatible model (``.encode(sentences, batch_size=..., **kw) -> np.ndarray``), so
    MTEB can evaluate any checkpoint: ``mteb.MTEB(tasks=[...]).run(SentenceEncoder("runs/x"))``.

    The instruction is, in order: the call's ``prompt``, ``instructions[task_name]`` (MTEB passes ``task_name``),
    the default ``instruction``. Other keyword arguments MTEB or sentence-transformers pass are accepted and ignored.
    """

    def __init__(self, model: EvalModel | str, pooling: str = "mean", instruction: str | None = None,
                 instructions: dict[str, str] | None = None, attention: str | None = None, max_length: int = 512,
                 **load_kwargs):
        self.model = load_model(model, **load_kwargs) if isinstance(model, str) else model
        self.pooling, self.instruction, self.instructions = pooling, instruction, dict(instructions or {})
        self.attention, self.max_length = attention, max_length

    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, show_progress_bar: bool = False,
               normalize_embeddings: bool = False, prompt: str | None = None, task_name: str | None = None,
               convert_to_tensor: bool = False, **_ignored) -> np.ndarray | torch.Tensor:
        single = isinstance(sentences, str)
        instruction = prompt or self.instructions.get(task_name or "", self.instruction)
        emb = encode(self.model, [sentences] if single else list(sentences), instruction, self.pooling, batch_size,
                     self.attention, self.max_length, show_progress_bar)
        if normalize_embeddings:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        emb = emb[0] if single else emb
        return torch.from_numpy(emb) if convert_to_tensor else emb
