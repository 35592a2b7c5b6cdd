"""Token classification (CoNLL-2003, OntoNotes, UNER in CoNLL column files): a linear layer on each word's first
sub-token; entity F1 (conlleval / seqeval rules) for BIO tags, word accuracy otherwise.

``DATA_DIR/token_classification/<dataset>/`` holds ``train.txt``, ``dev.txt`` (optional) and ``test.txt``; the tag is
column ``tag_column`` (default: the last, CoNLL-2003's NER). Sentences longer than ``max_length`` tokens are left
out of every split (the result's ``sizes`` shows how many remain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.eval.data import DataError, Sentence, read_conll
from pipeline.eval.finetune.protocol import FinetuneTask, eval_batches, run_family
from pipeline.eval.forward import pad_id, row_states, tokenize_words
from pipeline.eval.metrics import entity_f1
from pipeline.eval.task import Task
from pipeline.tasks import SPECS


@dataclass
class Tagged:
    ids: list[int]
    first: list[int]  # position of each word's first token
    tags: list[int]


class TokenClassification(FinetuneTask):
    family = "token_classification"
    metric = "f1"

    def read(self, path: str, split: str) -> list[Sentence]:
        return read_conll(path)

    def prepare(self, rows: dict[str, list[Sentence]]) -> dict[str, list[Tagged]]:
        column = self.opts.tag_column
        tags = {split: [s.tags[column if column < 0 else column - 1] for s in sentences]
                for split, sentences in rows.items()}
        # training data = train + validation: a 95/5 split of a train file may put a rare tag in validation only
        self.labels = sorted({t for split in ("train", "validation") for sentence in tags[split] for t in sentence})
        index = {t: i for i, t in enumerate(self.labels)}
        max_length = min(self.opts.max_length, self.ctx.model.max_length)
        out = {}
        for split, sentences in rows.items():
            out[split] = []
            encoded = tokenize_words(self.ctx.model.tokenizer, [s.words for s in sentences])
            for sentence, sentence_tags, (ids, positions) in zip(sentences, tags[split], encoded):
                unseen = sorted(set(sentence_tags) - set(index))
                if unseen:
                    raise DataError(f"{sentence.where}: tag(s) {unseen} never occur in the training data; fix them "
                                    f"or add training data")
                if len(ids) <= max_length and all(positions):
                    out[split].append(Tagged(ids, [p[0] for p in positions], [index[t] for t in sentence_tags]))
        self.entity_tags = any("-" in t for t in self.labels)
        return out

    def head(self, hidden_size: int) -> nn.Module:
        return nn.Linear(hidden_size, len(self.labels))

    def logits(self, lm, head: nn.Module, batch: list[Tagged]) -> list[torch.Tensor]:
        hidden = row_states(lm, [t.ids for t in batch], pad_id(self.ctx.model.tokenizer), self.mode)
        return [head(hidden[i, t.first]).float() for i, t in enumerate(batch)]

    def loss(self, lm, head: nn.Module, batch: list[Tagged]) -> torch.Tensor:
        logits = torch.cat(self.logits(lm, head, batch))
        target = torch.tensor([y for t in batch for y in t.tags], device=logits.device)
        return nn.functional.cross_entropy(logits, target)

    def evaluate(self, lm, head: nn.Module, examples: list[Tagged]) -> float:
        pred: list = [None] * len(examples)
        for which, batch in eval_batches(examples, self.opts.eval_batch_size, lambda t: len(t.ids)):
            for i, logits in zip(which, self.logits(lm, head, batch)):
                pred[i] = [self.labels[int(j)] for j in logits.argmax(-1)]
        gold = [[self.labels[i] for i in t.tags] for t in examples]
        if self.entity_tags:
            return 100.0 * entity_f1(gold, pred)["f1"]
        pairs = [(g, p) for gs, ps in zip(gold, pred) for g, p in zip(gs, ps)]
        return 100.0 * sum(g == p for g, p in pairs) / len(pairs)


TASKS = (Task(SPECS["token_classification"], run_family(TokenClassification)),)
