"""Sentence embeddings from any checkpoint of the project or HF directory (LLM2Vec's ``encode()``, MTEB's model).

A text is read as ``head, instruction + text, tail``. The instruction and the text are tokenized as one string,
as sentence-transformers and LLM2Vec do, and the instruction's own token count marks where the text starts; the
instruction conditions the text's states but is left out of pooling (LLM2Vec's ``skip_instruction``). ``layout``
picks head and tail:

- ``bos_eos``: BOS and EOS, as data prep writes every document and unit (the default);
- ``special``: what the tokenizer itself adds (``tokenizer(text)``: BOS for Llama, nothing for Qwen2), LLM2Vec's and
  sentence-transformers' layout;
- ``text``: the text tokens alone;
- ``echo``: Echo embeddings (``pipeline.eval.echo``): BOS, the text twice in the Echo paper's template, EOS; the
  second copy is pooled, the model read causally. Not a layout a training record holds (``LAYOUTS``).

Pooling (special tokens are never pooled, except by ``last``):

- ``mean``: the mean over the text tokens (LLM2Vec's default; SimCSE pools the same tokens);
- ``weighted_mean``: text token j of n weighted j / sum(1..n) (LLM2Vec, after SGPT: later tokens have seen more);
- ``last``: the last token's state, the EOS under ``bos_eos`` (MAGNET's SSCL embedding).

``dim`` keeps the first dims of each embedding (a Matryoshka-trained model's, sentence-transformers'
``truncate_dim``), cut after pooling as that library cuts.

Defaults come from the model's training record (``EvalModel.record``, docs/export.md); attention is the model's
(``EvalModel.attention``) unless given. Texts are sorted by length into batches of at most ``max_tokens`` padded
tokens (``pipeline.eval.forward.length_batches``), so little padding is computed, and returned in input order.

Across ranks (an initialised process group, ``pipeline.eval.ranks``), every rank builds the same batch list from
all texts and encodes every ``world``-th batch (rank r: batches r, r + world, ...); the rows are gathered in input
order on every rank (``gather="all"``) or on rank 0 only (``"rank0"``; None elsewhere). A row's embedding depends
on its batch (its neighbours and padded width change the kernels' summation order, ~1e-6 on CPU fp32), so batches
are a function of the whole input and not of the rank count: the result is bit-equal to one process's. Under
ZeRO-3 (an evaluator during training, ``pipeline.train.evaluators``) a rank with one batch fewer runs one more
forward whose states it drops, since every forward gathers the weights from all ranks. On CUDA the embeddings are
copied without blocking into pinned host memory, so the host never waits on a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from pipeline.data.format.instructions import LAYOUTS, format_instruction, instructed_rows, special_tokens
from pipeline.eval.echo import ECHO, echo_rows
from pipeline.eval.forward import length_batches, pad_id, row_states, to_device
from pipeline.eval.load import EvalModel
from pipeline.eval.ranks import gather_rows, lockstep, world
from pipeline.export.record import POOLINGS

MAX_TOKENS = 16384  # padded tokens per batch (rows x longest row)
GATHERS = ("all", "rank0")
ENCODE_LAYOUTS = (*LAYOUTS, ECHO)  # a record's layouts, and Echo, which encode() alone reads


def rows_for(model: EvalModel, texts: Sequence[str], instruction: str | None, max_length: int, layout: str
             ) -> list[tuple[list[int], int, int]]:
    """(ids, first text position, end of text) per text; ``instruction`` is the verbatim prefix (already
    formatted, :func:`query_prefix`); the text is cut to fit ``max_length`` tokens (under ``echo`` each copy is, and
    the row fits the model's positions). The layout is data prep's for pairs shards
    (``pipeline.data.format.instructions.instructed_rows``), so supervised training pools what this pools."""
    if layout not in ENCODE_LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(ENCODE_LAYOUTS)}")
    if layout == ECHO:
        return echo_rows(model.tokenizer, texts, instruction, max_length, model.max_length,
                         *special_tokens(model.tokenizer, "bos_eos"))
    head, tail = special_tokens(model.tokenizer, layout)
    return instructed_rows(model.tokenizer, texts, [instruction or ""] * len(texts), max_length, head, tail)


def query_prefix(model: EvalModel, instruction: str | None) -> str:
    """The prefix an instruction becomes: the model's recorded ``instruction_format`` (a supervised run's, e.g.
    ``"{instruction}: "``) filled with it, or the instruction verbatim for a model recorded without one;
    ``None`` is the recorded default instruction."""
    record = model.record
    return format_instruction(record.instruction_format, record.instruction if instruction is None else instruction)


def pool(hidden: torch.Tensor, rows: Sequence[tuple[list[int], int, int]], pooling: str) -> torch.Tensor:
    """[B, d] embeddings of a right-padded batch; the weights are built on ``hidden``'s device from one copy of
    the rows' bounds."""
    bounds = to_device(torch.tensor([[len(ids) - 1, start, end] for ids, start, end in rows]), hidden.device)
    if pooling == "last":
        return hidden[torch.arange(len(rows), device=hidden.device), bounds[:, 0]]
    start, end = bounds[:, 1:2], bounds[:, 2:3]
    pos = torch.arange(hidden.shape[1], device=hidden.device)[None]
    inside = (pos >= start) & (pos < end)
    weights = torch.where(inside, (pos - start + 1) if pooling == "weighted_mean" else 1, 0).float()
    weights = weights / weights.sum(1, keepdim=True).clamp_min(1)
    return (hidden * weights.to(hidden).unsqueeze(-1)).sum(1)


@torch.no_grad()
def encode(model: EvalModel, texts: Sequence[str], instruction: str | None = None, pooling: str | None = None,
           max_tokens: int = MAX_TOKENS, attention: str | None = None, max_length: int = 512, progress: bool = False,
           layout: str | None = None, gather: str = "all", dim: int | None = None) -> np.ndarray | None:
    """float32 [len(texts), dim] embeddings; ``instruction`` (``""``: none), ``pooling``, ``layout``, ``dim`` and
    ``attention`` default to the model's (its training record, ``model.record``; ``attention``: ``model.attention``;
    ``dim``: the record's ``truncate_dim``, else the hidden size).
    A model whose record has an ``instruction_format`` (supervised training) takes bare task instructions and
    formats them as it was trained (``"Retrieve semantically similar text"`` -> ``"Retrieve ...: "``).
    ``max_tokens``: padded tokens per batch; ``gather``: where the rows of several ranks end up (module docstring)."""
    instruction = query_prefix(model, instruction)
    pooling = pooling or model.record.pooling
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    if gather not in GATHERS:
        raise ValueError(f"gather {gather!r} is not one of {', '.join(GATHERS)}")
    hidden = model.lm.config.hidden_size
    dim = dim or model.record.truncate_dim or hidden
    if not 1 <= dim <= hidden:
        raise ValueError(f"dim {dim}: the model's embeddings have {hidden} dims; pass 1 to {hidden}")
    layout, mode = layout or model.record.layout, attention or model.attention
    if layout == ECHO and mode != "causal":
        raise ValueError(f"layout echo reads a causal model (the second copy sees the first); attention is {mode!r}: "
                         "pass attention='causal' or another layout")
    rows = rows_for(model, list(texts), instruction, min(max_length, model.max_length), layout)
    rank, size = world()
    batches = length_batches([len(r[0]) for r in rows], max_tokens)
    owned = [[i for batch in batches[r::size] for i in batch] for r in range(size)]
    cuda = model.device.type == "cuda"
    local = torch.empty((len(owned[rank]), dim), dtype=torch.float32, pin_memory=cuda)
    pad, done = pad_id(model.tokenizer), 0
    mine = batches[rank::size]
    rounds = -(-len(batches) // size) if size > 1 and lockstep(model.lm) else len(mine)
    for n in tqdm(range(rounds), desc="encode", disable=not progress, leave=False):
        if n == len(mine):  # ZeRO-3: this rank's share is done; it joins the others' last forward, on the last batch
            row_states(model.lm, [rows[j][0] for j in batches[-1]], pad, mode)
            continue
        batch = mine[n]
        chunk = [rows[i] for i in batch]
        embedded = pool(row_states(model.lm, [r[0] for r in chunk], pad, mode), chunk, pooling)[:, :dim].float()
        local[done:done + len(batch)].copy_(embedded, non_blocking=cuda)
        done += len(batch)
    if cuda:
        torch.cuda.current_stream(model.device).synchronize()
    if size == 1:
        out = np.zeros(tuple(local.shape), dtype=np.float32)
        out[owned[0]] = local.numpy()
        return out
    return gather_rows(local, owned, len(rows), gather == "all")
