"""Extractive QA (SQuAD v1.1 / v2.0): start and end logits over the context tokens; SQuAD F1 (and exact match).

The model reads ``BOS question \\n context EOS``, tokenized as one text so the answer's characters map to tokens
through the offsets; a context longer than ``max_length`` is cut (a training answer beyond the cut is left out; an
evaluation question keeps its gold answers and is scored on what the model can see). Position 0 stands for "no
answer": SQuAD v2's unanswerable questions are trained to point there, and it is predicted when its score beats the
best span of at most ``max_answer_tokens`` tokens.

Records: SQuAD's ``{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}`` JSON, or HF's flat rows
(``context``, ``question``, ``answers: {"text": [...], "answer_start": [...]}``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.eval.data import DataError, Row
from pipeline.eval.finetune.protocol import FinetuneTask, eval_batches, run_family
from pipeline.eval.forward import encode_with_offsets, pad_id, row_states, wrap
from pipeline.eval.metrics import squad_scores
from pipeline.eval.task import Task
from pipeline.tasks import SPECS


@dataclass
class Question:
    ids: list[int]
    offsets: list[tuple[int, int]]  # per position (BOS and EOS get (0, 0)), in the rendered text
    context_start: int  # first context position
    text: str  # the rendered text
    answers: list[str]
    start: int  # gold start / end positions (0, 0: no answer or beyond the cut)
    end: int


def answers_of(row: Row) -> list[tuple[str, int]]:
    """(text, character start) of each gold answer; empty for an unanswerable question."""
    answers = row.get(("answers",), "answers", required=False) or []
    if isinstance(answers, dict):  # HF layout
        return list(zip(answers.get("text", []), answers.get("answer_start", [])))
    try:
        return [(a["text"], int(a["answer_start"])) for a in answers]
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{row.where}: answers must be [{{'text', 'answer_start'}}, ...] ({e})") from e


class ExtractiveQA(FinetuneTask):
    family = "qa"
    metric = "f1"

    def question(self, row: Row, ids: list[int], offsets: list, prefix: int, text: str, answers) -> Question:
        room = min(self.opts.max_length, self.ctx.model.max_length) - 2
        shift = int(self.ctx.model.tokenizer.bos_id is not None)
        ids, offsets = ids[:room], offsets[:room]
        context_start = next((i for i, (s, _) in enumerate(offsets) if s >= prefix), len(ids)) + shift
        start = end = 0
        if answers:
            first, chars = answers[0][1] + prefix, len(answers[0][0])
            if text[first:first + chars] != answers[0][0]:
                raise DataError(f"{row.where}: answer {answers[0][0]!r} is not at answer_start {answers[0][1]} of "
                                f"the context")
            inside = [i for i, (s, e) in enumerate(offsets) if s < first + chars and e > first and s >= prefix]
            if inside:
                start, end = inside[0] + shift, inside[-1] + shift
        full = wrap(self.ctx.model.tokenizer, ids)
        return Question(full, [(0, 0)] * shift + offsets + [(0, 0)] * (len(full) - len(offsets) - shift),
                        context_start, text, [a for a, _ in answers], start, end)

    def prepare(self, rows: dict[str, list[Row]]) -> dict[str, list[Question]]:
        out = {}
        for split, split_rows in rows.items():
            texts, prefixes, answers = [], [], []
            for row in split_rows:
                question = str(row.get(("question",), "question")).strip()
                texts.append(f"{question}\n{row.get(('context',), 'context')}")
                prefixes.append(len(question) + 1)
                answers.append(answers_of(row))
            encoded = encode_with_offsets(self.ctx.model.tokenizer, texts)
            questions = [self.question(*args) for args in zip(split_rows, *zip(*encoded), prefixes, texts, answers)]
            # a training answer cut off by max_length cannot be learnt: leave it out
            out[split] = [q for q in questions if split != "train" or not q.answers or q.start > 0]
        return out

    def head(self, hidden_size: int) -> nn.Module:
        return nn.Linear(hidden_size, 2)

    def logits(self, lm, head: nn.Module, batch: list[Question]) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end logits [B, L], -inf outside the context and the no-answer position 0."""
        logits = head(row_states(lm, [q.ids for q in batch], pad_id(self.ctx.model.tokenizer), self.mode)).float()
        allowed = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
        for i, q in enumerate(batch):
            allowed[i, q.context_start: len(q.ids) - 1] = True
            allowed[i, 0] = True
        logits = logits.masked_fill(~allowed.unsqueeze(-1), float("-inf"))
        return logits[..., 0], logits[..., 1]

    def loss(self, lm, head: nn.Module, batch: list[Question]) -> torch.Tensor:
        start, end = self.logits(lm, head, batch)
        gold = torch.tensor([[q.start, q.end] for q in batch], device=start.device)
        return (nn.functional.cross_entropy(start, gold[:, 0]) + nn.functional.cross_entropy(end, gold[:, 1])) / 2

    def answer(self, q: Question, start: torch.Tensor, end: torch.Tensor) -> str:
        n = len(q.ids)
        scores = start[:n, None] + end[None, :n]
        band = torch.ones(n, n, dtype=torch.bool).triu().tril(self.opts.max_answer_tokens - 1)
        band[0, :] = band[:, 0] = False
        scores = scores.masked_fill(~band, float("-inf"))
        best = int(scores.argmax())
        s, e = divmod(best, n)
        if not torch.isfinite(scores[s, e]) or start[0] + end[0] > scores[s, e]:
            return ""
        return q.text[q.offsets[s][0]:q.offsets[e][1]].strip()

    def evaluate(self, lm, head: nn.Module, examples: list[Question]) -> float:
        f1 = 0.0
        for _, batch in eval_batches(examples, self.opts.eval_batch_size, lambda q: len(q.ids)):
            start, end = self.logits(lm, head, batch)
            for i, q in enumerate(batch):
                f1 += squad_scores(q.answers, self.answer(q, start[i].cpu(), end[i].cpu()))[1]
        return 100.0 * f1 / len(examples)


TASKS = (Task(SPECS["qa"], run_family(ExtractiveQA)),)
