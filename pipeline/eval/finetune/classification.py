"""Sequence classification (SST-2, MNLI, QQP, ...): mean-pooled states -> dense -> GELU -> labels; accuracy.

Records are GLUE-style ``.tsv`` files with a header (or ``.jsonl``): the text is the first of these column groups
present, a pair rendered as ``"Premise: ...\\nHypothesis: ..."`` (EncodEval's layout); the label is ``label``,
``gold_label`` (MNLI) or ``is_duplicate`` (QQP). Labels are strings; one in the validation or test split that the
training data (train and validation) lacks is an error naming the record.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.eval.data import DataError, Row
from pipeline.eval.encode import pool, rows_for
from pipeline.eval.finetune.protocol import FinetuneTask, eval_batches, run_family
from pipeline.eval.forward import pad_id, row_states
from pipeline.eval.task import Task
from pipeline.tasks import SPECS

TEXT_FIELDS = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"),
               ("question", "sentence"), ("sentence",), ("text",))
LABEL_FIELDS = ("label", "gold_label", "is_duplicate")


def render(row: Row) -> str:
    lowered = {k.lower(): v for k, v in row.fields.items()}
    for group in TEXT_FIELDS:
        if all(lowered.get(name) not in (None, "") for name in group):
            if len(group) == 1:
                return str(lowered[group[0]])
            return "\n".join(f"{name.capitalize()}: {lowered[name]}" for name in group)
    raise DataError(f"{row.where}: no text columns; expected one of {[list(g) for g in TEXT_FIELDS]}, the record "
                    f"has {list(row.fields)}")


def label_ids(rows: dict[str, list[Row]], labels: list[str]) -> dict[str, list[int]]:
    """Label index per record of each split; a label the training data (train and validation) lacks is an error naming the record."""
    index = {label: i for i, label in enumerate(labels)}
    out = {}
    for split, split_rows in rows.items():
        out[split] = []
        for row in split_rows:
            label = str(row.get(LABEL_FIELDS, "label"))
            if label not in index:
                raise DataError(f"{row.where}: label {label!r} never occurs in the training data (labels: "
                                f"{labels}); fix the label or add training data")
            out[split].append(index[label])
    return out


class SequenceClassification(FinetuneTask):
    family = "classification"
    metric = "accuracy"

    def prepare(self, rows: dict[str, list[Row]]) -> dict[str, list]:
        # training data = train + validation: a 95/5 split of a train file may put a rare label in validation only
        self.labels = sorted({str(r.get(LABEL_FIELDS, "label")) for split in ("train", "validation")
                              for r in rows[split]})
        if len(self.labels) < 2:
            raise DataError(f"{rows['train'][0].where}: the training data has one label ({self.labels}); a "
                            f"classifier needs at least two")
        ids = label_ids(rows, self.labels)
        max_length = min(self.opts.max_length, self.ctx.model.max_length)
        return {split: list(zip(rows_for(self.ctx.model, [render(r) for r in split_rows], None, max_length, "bos_eos"), ids[split]))
                for split, split_rows in rows.items()}

    def head(self, hidden_size: int) -> nn.Module:
        return nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, len(self.labels)))

    def logits(self, lm, head: nn.Module, batch: list) -> torch.Tensor:
        rows = [r for r, _ in batch]
        return head(pool(row_states(lm, [r[0] for r in rows], pad_id(self.ctx.model.tokenizer), self.mode), rows, "mean"))

    def loss(self, lm, head: nn.Module, batch: list) -> torch.Tensor:
        target = torch.tensor([y for _, y in batch], device=self.ctx.model.device)
        return nn.functional.cross_entropy(self.logits(lm, head, batch).float(), target)

    def evaluate(self, lm, head: nn.Module, examples: list) -> float:
        correct = sum(int((self.logits(lm, head, b).argmax(-1).cpu() == torch.tensor([y for _, y in b])).sum())
                      for _, b in eval_batches(examples, self.opts.eval_batch_size, lambda e: len(e[0][0])))
        return 100.0 * correct / len(examples)


TASKS = (Task(SPECS["classification"], run_family(SequenceClassification)),)
