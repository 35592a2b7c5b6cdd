"""Infilling: perplexity of a missing span given both sides (MAGNET attention) against a causal baseline that sees
only the left side, and generation of the span both ways.

Each example is a left context, the missing span and a right context (``{"left", "middle", "right"}``), or a
``{"text"}`` whose middle sentence is the span (ROCStories' five sentences: the third). The example is tokenized as
one text, ``BOS left middle right EOS``, and the span is the tokens overlapping the middle's characters, so both
readings score the very same tokens:

- ``magnet``: the whole sequence under the ``magnet`` mask (``pipeline.model.attention``): context sees context on
  both sides, span token l sees all context and the span tokens before it; span token l is predicted from position
  l - 1, the first from the context token before the gap (MAGNET's MSG loss);
- ``causal``: ``BOS left middle`` under causal attention, the span tokens predicted the same way.

The loss is the training objectives' target-only head and cross-entropy (``pipeline.objectives.base``). Generation
is greedy and in place: the span keeps its gold length, and slot l is filled from the logits at l - 1 once slots
before it are filled (span tokens never influence the context or earlier slots under either mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pipeline.data.format.units import split_units
from pipeline.eval.data import DataError, Row, dataset_name, read_rows
from pipeline.eval.forward import encode_with_offsets, hidden_states, pad_id, pad_rows, token_owner, wrap
from pipeline.eval.task import EvalContext, Task
from pipeline.objectives.base import next_token_targets, target_loss
from pipeline.tasks import INFILLING_MODES, SPECS, InfillOptions


@dataclass
class Example:
    ids: list[int]  # BOS, tokens, EOS
    start: int  # the span is ids[start:end]
    end: int
    where: str


def split_example(row: Row) -> tuple[str, str, str]:
    """(left, middle, right) of a record."""
    middle = row.get(("middle", "span", "missing"), "missing span", required=False)
    if middle is not None:
        return (row.get(("left", "prefix"), "left context", required=False) or "", middle,
                row.get(("right", "suffix"), "right context", required=False) or "")
    sentences = split_units(row.get(("text", "story"), "text"), "sentence")
    if len(sentences) < 3:
        raise DataError(f"{row.where}: {len(sentences)} sentences; a text example needs >= 3 (its middle sentence is "
                        f"the span), or give left/middle/right fields")
    mid = len(sentences) // 2
    return " ".join(sentences[:mid]), sentences[mid], " ".join(sentences[mid + 1:])


def tokenize(ctx: EvalContext, rows: list[Row]) -> list[Example]:
    texts, spans = [], []
    for row in rows:
        left, middle, right = (s.strip() for s in split_example(row))
        prefix = f"{left} " if left else ""
        texts.append(prefix + middle + (f" {right}" if right else ""))
        spans.append((len(prefix), len(prefix) + len(middle)))
    out = []
    offset = int(ctx.model.tokenizer.bos_id is not None)
    for row, (ids, offsets), span in zip(rows, encode_with_offsets(ctx.model.tokenizer, texts), spans):
        inside = [i for i, o in enumerate(token_owner(offsets, [span])) if o == 0]
        if not inside:
            raise DataError(f"{row.where}: the missing span is empty")
        if inside[0] + offset == 0:
            raise DataError(f"{row.where}: no left context and no BOS token, so nothing predicts the span's first "
                            f"token; give a left context")
        out.append(Example(wrap(ctx.model.tokenizer, ids), inside[0] + offset, inside[-1] + 1 + offset, row.where))
    return out


def _batch(ctx: EvalContext, examples: list[Example], mode: str):
    """(ids, doc_ids, span_ids) of ``mode``'s reading: the whole example (magnet) or up to the span's end."""
    rows = [e.ids if mode == "magnet" else e.ids[: e.end] for e in examples]
    ids, doc_ids = pad_rows(rows, pad_id(ctx.model.tokenizer), ctx.model.device)
    span_ids = torch.full_like(doc_ids, -1)
    for i, e in enumerate(examples):
        span_ids[i, e.start:e.end] = 0
    return ids, doc_ids, span_ids


@torch.no_grad()
def span_nll(ctx: EvalContext, examples: list[Example], mode: str) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens) of the spans."""
    ids, doc_ids, span_ids = _batch(ctx, examples, mode)
    hidden = hidden_states(ctx.model.lm, ids, doc_ids, mode, span_ids)
    out = target_loss(ctx.model.lm.lm_head, hidden, next_token_targets(ids, ids, doc_ids, span_ids >= 0))
    return float(out.loss_sum), int(out.num_targets)


@torch.no_grad()
def fill_spans(ctx: EvalContext, examples: list[Example], mode: str) -> list[list[int]]:
    """Greedy in-place generation of each span, at its gold length."""
    ids, doc_ids, span_ids = _batch(ctx, examples, mode)
    for i, e in enumerate(examples):
        ids[i, e.start:e.end] = pad_id(ctx.model.tokenizer)
    for step in range(max(e.end - e.start for e in examples)):
        hidden = hidden_states(ctx.model.lm, ids, doc_ids, mode, span_ids)
        for i, e in enumerate(examples):
            if e.start + step < e.end:
                ids[i, e.start + step] = ctx.model.lm.lm_head(hidden[i, e.start + step - 1]).argmax()
    return [ids[i, e.start:e.end].tolist() for i, e in enumerate(examples)]


def evaluate_file(ctx: EvalContext, dataset: str, opts: InfillOptions) -> dict:
    rows = read_rows(dataset)
    rows = rows[: opts.max_examples] if opts.max_examples else rows
    examples = [e for e in tokenize(ctx, rows) if len(e.ids) <= min(opts.max_length, ctx.model.max_length)]
    if not examples:
        raise DataError(f"{dataset}: no example fits max_length {opts.max_length}")
    result: dict = {"examples": len(examples), "skipped_too_long": len(rows) - len(examples)}
    chunks = [examples[i:i + ctx.batch_size] for i in range(0, len(examples), ctx.batch_size)]
    for mode in INFILLING_MODES:
        nll = tokens = 0
        for chunk in tqdm(chunks, desc=f"infill {mode}", disable=not ctx.progress, leave=False):
            n, t = span_nll(ctx, chunk, mode)
            nll, tokens = nll + n, tokens + t
        result[mode] = {"loss": nll / tokens, "perplexity": math.exp(nll / tokens), "span_tokens": tokens}
    shown = examples[: opts.generate]
    if shown:
        decode = ctx.model.tokenizer.decode
        generated = {mode: [g for i in range(0, len(shown), ctx.batch_size)
                            for g in fill_spans(ctx, shown[i:i + ctx.batch_size], mode)] for mode in INFILLING_MODES}
        for mode in INFILLING_MODES:
            hits = sum(a == b for e, g in zip(shown, generated[mode]) for a, b in zip(e.ids[e.start:e.end], g))
            result[mode]["generated_token_accuracy"] = hits / sum(e.end - e.start for e in shown)
        result["samples"] = [{"where": e.where, "left": decode(e.ids[:e.start]), "gold": decode(e.ids[e.start:e.end]),
                              **{mode: decode(generated[mode][k]) for mode in INFILLING_MODES}}
                             for k, e in enumerate(shown)]
    return result


def run(ctx: EvalContext, opts: InfillOptions) -> dict:
    datasets = ctx.datasets("infilling", opts.datasets, (".jsonl", ".json", ".tsv"))
    return {"datasets": {dataset_name(s): evaluate_file(ctx, s, opts) for s in datasets}}


TASKS = (Task(SPECS["infilling"], run),)
