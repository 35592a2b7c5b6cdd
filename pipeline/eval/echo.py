"""Echo embeddings (Springer et al. 2024, "Repetition improves language model embeddings", arXiv 2402.15449): a
causal model is given the text twice and its states are mean-pooled over the second copy only, whose every token
has seen the whole text in the first. No training: the cost is the longer input (``encode(layout="echo")``).

The row is ``BOS, template, EOS`` with the text in both slots of the template:

- without an instruction, the paper's prompt: ``Rewrite the sentence: {text}, rewritten sentence: {text}``;
- with one, the query template of the authors' code (``echo_embeddings.py``, README: ``Instruct:{prompt,}\\nQuery:
  {text}\\nQuery again:{text}``): the instruction before the first copy, never pooled.

The template is tokenized as one string, as a model reads text; the second copy's tokens are those after the
template's opening, the first copy and the words between the copies tokenized alone (the rule the instructed layouts
use, ``pipeline.data.format.instructions``). The space before the second copy belongs to the copy, so no
tokenizer merges it into the words before; the copies' token ids are then the text's own (in context, after a
space). ``max_length`` cuts each copy as the other layouts cut the text; the row then holds ~2x the tokens plus the
template's, within the model's positions (the copy cut further where both would not fit).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.tokenizer import Tokenizer

ECHO = "echo"
TEMPLATE = "Rewrite the sentence: {text}, rewritten sentence: {text}"  # the paper's (its section 3)
INSTRUCTED = "Instruct: {instruction},\nQuery: {text}\nQuery again: {text}"  # the authors' code's query template


def bare(instruction: str) -> str:
    """An instruction prefix as encode() gets it (``"Retrieve ...: "``, LLM2Vec's join) without its join, since
    the template places the instruction itself."""
    return instruction.strip().removesuffix(":").rstrip()


def parts(instruction: str) -> tuple[str, str, str]:
    """(before the first copy, between the copies up to the space, that space) of the template."""
    template = INSTRUCTED.replace("{instruction}", bare(instruction)) if bare(instruction) else TEMPLATE
    opening, between, _ = template.split("{text}")
    words = between.rstrip()
    return opening, words, between[len(words):]


def echo_rows(tok: Tokenizer, texts: Sequence[str], instruction: str | None, max_length: int, limit: int,
              head: list[int], tail: list[int]) -> list[tuple[list[int], int, int]]:
    """(ids, first position of the second copy, its end) per text, ``head`` and ``tail`` around the template;
    ``max_length``: the tokens a copy may hold with ``head`` and ``tail`` (as other layouts hold the text);
    ``limit``: the tokens the whole row may hold (the model's positions)."""
    opening, words, space = parts(instruction or "")
    (template,) = tok.encode_batch([opening + words + space])
    room = min(max_length - len(head) - len(tail), (limit - len(template) - len(head) - len(tail)) // 2)
    if room < 1:
        raise ValueError(f"layout echo: the template takes {len(template) + len(head) + len(tail)} tokens and two "
                         f"copies of a text must fit in {limit}; raise max_length or shorten the instruction")
    cut = [t if len(ids) <= room else tok.decode(ids[:room]) for t, ids in zip(texts, tok.encode_batch(list(texts)))]
    firsts = tok.encode_batch([opening + t + words for t in cut])
    rows = []
    for ids, first in zip(tok.encode_batch([opening + t + words + space + t for t in cut]), firsts):
        if ids[:len(first)] != first:
            raise ValueError(f"tokenizer {tok.path}: the words before the second copy tokenize differently alone and "
                             "followed by it, so layout echo cannot find the copy; use another layout")
        ids = ids[:limit - len(head) - len(tail)]
        rows.append((head + ids + tail, len(head) + len(first), len(head) + len(ids)))
    return rows
