"""Repetition in open-ended generation (MAGNET's Table 5): continue prefixes of real documents, then measure how
much each continuation repeats itself.

- prefix: the document's first ``prefix_words`` words, or its first sentence (``prefix: sentence``);
- continuation: up to ``max_new_tokens`` tokens from HF ``generate`` (causal decoding with the KV cache: generation
  is left to right whatever the model was trained for), greedy by default; the decoding settings are recorded in
  the result;
- Rep-n = 1 - unique n-grams / n-grams over the continuation's whitespace words (n = 2, 3, 4; Welleck et al.'s
  seq-rep-n), Rep-Sen = 1 - unique sentences / sentences; each averaged over the continuations where it is
  defined (enough words, at least one sentence).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch
from tqdm import tqdm

from pipeline.data.format.units import split_units
from pipeline.eval.data import DataError, dataset_name, read_rows
from pipeline.eval.forward import pad_id
from pipeline.eval.metrics import rep_n, rep_sen
from pipeline.eval.task import EvalContext, Task
from pipeline.tasks import SPECS, Decoding, RepetitionOptions

NGRAMS = (2, 3, 4)


def prefix_of(text: str, opts: RepetitionOptions) -> str:
    if opts.prefix == "sentence":
        sentences = split_units(text, "sentence")
        return sentences[0] if sentences else ""
    return " ".join(text.split()[: opts.prefix_words])


@torch.no_grad()
def continue_texts(ctx: EvalContext, prefixes: list[str], decoding: Decoding) -> list[str]:
    """Continuations of ``prefixes`` (left-padded batches, as decoder generation needs)."""
    tok, lm = ctx.model.tokenizer, ctx.model.lm
    pad = pad_id(tok)
    head = [tok.bos_id] if tok.bos_id is not None else []
    torch.manual_seed(decoding.seed)
    out = []
    for first in tqdm(range(0, len(prefixes), ctx.batch_size), desc="generate", disable=not ctx.progress, leave=False):
        rows = [head + ids for ids in tok.encode_batch(prefixes[first:first + ctx.batch_size])]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=ctx.model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=ctx.model.device)
        sampling = {"top_p": decoding.top_p, "top_k": decoding.top_k or None,
                    "temperature": decoding.temperature} if decoding.do_sample else {}
        generated = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=decoding.max_new_tokens,
                                do_sample=decoding.do_sample, pad_token_id=pad, eos_token_id=tok.eos_id, **sampling)
        out += [tok.hf.decode(g[width:], skip_special_tokens=True) for g in generated.tolist()]
    return out


def _mean(values: list[float | None]) -> float | None:
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def repetition_scores(continuations: list[str]) -> dict:
    words = [c.split() for c in continuations]
    return {"rep_sen": _mean([rep_sen(c) for c in continuations]),
            **{f"rep_{n}": _mean([rep_n(w, n) for w in words]) for n in NGRAMS},
            "mean_words": float(np.mean([len(w) for w in words])) if words else 0.0}


def evaluate_file(ctx: EvalContext, dataset: str, opts: RepetitionOptions) -> dict:
    rows = read_rows(dataset)
    rows = rows[: opts.max_examples] if opts.max_examples else rows
    prefixes = [prefix_of(row.get(("text", "story", "document"), "text"), opts) for row in rows]
    empty = [row.where for row, p in zip(rows, prefixes) if not p]
    if empty:
        raise DataError(f"{empty[0]}: empty text, so no prefix to continue ({len(empty)} such records)")
    continuations = continue_texts(ctx, prefixes, opts.decoding)
    return {**repetition_scores(continuations), "continuations": len(continuations),
            "samples": [{"prefix": p, "continuation": c} for p, c in zip(prefixes, continuations)][: opts.samples]}


def run(ctx: EvalContext, opts: RepetitionOptions) -> dict:
    datasets = ctx.datasets("repetition", opts.datasets, (".jsonl", ".json", ".tsv"))
    return {"datasets": {dataset_name(s): evaluate_file(ctx, s, opts) for s in datasets},
            "decoding": asdict(opts.decoding), "prefix": opts.prefix}


TASKS = (Task(SPECS["repetition"], run),)
