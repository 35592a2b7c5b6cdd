"""The MLM-vs-CLM fine-tuning protocol (EncodEval), shared by the four fine-tuning tasks.

For every learning rate x seed: a fresh copy of the model plus a new task head, trained for at most ``max_steps``
steps and one epoch (batch 32, AdamW (0.9, 0.95), eps 1e-5, weight decay 0.1 on matrices, linear warmup over 10 %
of the steps then linear decay to 0, gradient clipping 1.0), then scored on the validation and test splits. The
learning rate with the best mean validation score over seeds is chosen; the test score is reported as the mean
over seeds at that learning rate with its 95 % Student-t confidence interval. Attention is bidirectional by default,
as the paper fine-tunes every model (CLM ones included).

Data: ``DATA_DIR/<family>/<dataset>/`` with ``train``, ``dev`` (or ``validation``/``valid``/``val``) and ``test``
files; without a dev file the train file is split 95/5 with seed 42 (EncodEval's split). An HF dataset name
instead of a directory reads its ``train`` split as train and its ``validation`` split as test (the paper's test
sets are the official validation splits).
"""

from __future__ import annotations

import copy
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from pipeline.eval.data import DataError, Row, read_rows
from pipeline.eval.forward import length_batches
from pipeline.eval.metrics import mean_ci
from pipeline.eval.task import EvalContext
from pipeline.model.weight_decay import param_groups
from pipeline.tasks import FinetuneOptions

SPLITS = {"train": ("train",), "validation": ("dev", "validation", "valid", "val"), "test": ("test",)}
EXTS = (".tsv", ".csv", ".jsonl", ".json", ".txt")


def dataset_splits(directory: str) -> dict[str, str]:
    """The split files of a local dataset directory (dev may be missing)."""
    files = {}
    names = sorted(os.listdir(directory))
    for split, stems in SPLITS.items():
        found = [n for stem in stems for n in names if n.endswith(EXTS) and os.path.splitext(n)[0] == stem]
        if found:
            files[split] = os.path.join(directory, found[0])
        elif split != "validation":
            raise DataError(f"{directory}: no {split} file; expected {'/'.join(stems)} with one of {', '.join(EXTS)}")
    return files


def split_train(train: list, seed: int = 42, fraction: float = 0.05) -> tuple[list, list]:
    """(train, validation): a seeded 95/5 split of the training records, at least one each."""
    order = np.random.default_rng(seed).permutation(len(train))
    n_val = max(1, round(fraction * len(train)))
    if len(train) - n_val < 1:
        raise DataError(f"{len(train)} training records cannot be split into train and validation; add a dev file")
    return [train[i] for i in order[n_val:]], [train[i] for i in order[:n_val]]


class FinetuneTask(ABC):
    """One fine-tuning family: how to read its records, its head, its loss and its validation/test metric."""

    family: str
    metric: str  # name of the score ``evaluate`` returns (0-100)

    def __init__(self, ctx: EvalContext, opts: FinetuneOptions):
        self.ctx, self.opts = ctx, opts
        self.mode = ctx.model.attention if opts.attention == "auto" else opts.attention

    def read(self, path: str, split: str) -> list[Row]:
        """A split's records (``read_rows``); families with another file layout override it."""
        return read_rows(path, split)

    @abstractmethod
    def prepare(self, rows: dict[str, list]) -> dict[str, Any]:
        """Records of each split -> model-ready examples (checks labels against the training data)."""

    @abstractmethod
    def head(self, hidden_size: int) -> nn.Module:
        """A fresh task head (seeded by the caller)."""

    @abstractmethod
    def loss(self, lm, head: nn.Module, batch: list) -> torch.Tensor:
        """Mean loss of a list of training examples."""

    @abstractmethod
    def evaluate(self, lm, head: nn.Module, examples: Any) -> float:
        """The split's score, 0-100."""

    def load(self, dataset: str) -> dict[str, Any]:
        local = dataset if os.path.isdir(dataset) else os.path.join(self.ctx.data_dir, self.family, dataset)
        if os.path.isdir(local):
            rows = {split: self.read(path, split) for split, path in dataset_splits(local).items()}
        else:
            rows = {"train": self.read(dataset, "train"), "test": self.read(dataset, "validation")}
        if "validation" not in rows:
            rows["train"], rows["validation"] = split_train(rows["train"])
        n = self.opts.max_examples
        return self.prepare({k: v[:n] if n else v for k, v in rows.items()})

    def train_batches(self, train: list, seed: int) -> Iterator[list]:
        rng = np.random.default_rng(seed)
        while True:
            order = rng.permutation(len(train))
            for first in range(0, len(train), self.opts.batch_size):
                yield [train[i] for i in order[first:first + self.opts.batch_size]]


def steps_for(train_size: int, opts: FinetuneOptions) -> int:
    return max(1, min(opts.max_steps, math.ceil(opts.max_epochs * train_size / opts.batch_size)))


def linear_warmup_decay(step: int, total: int, warmup: float) -> float:
    warm = max(1, round(warmup * total))
    return (step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm))


def train_once(task: FinetuneTask, data: dict[str, Any], lr: float, seed: int) -> dict:
    """Fine-tune a copy of the model at ``lr`` with ``seed``; its validation and test scores."""
    opts = task.opts
    torch.manual_seed(seed)
    lm = copy.deepcopy(task.ctx.model.lm).train()
    head = task.head(lm.config.hidden_size).to(task.ctx.model.device)
    both = nn.ModuleDict({"lm": lm, "head": head})
    optim = torch.optim.AdamW(param_groups(both, opts.weight_decay), lr=lr, betas=opts.betas, eps=opts.eps)
    total = steps_for(len(data["train"]), opts)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: linear_warmup_decay(s, total, opts.warmup))
    batches = task.train_batches(data["train"], seed)
    for _ in range(total):
        loss = task.loss(lm, head, next(batches))
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(both.parameters(), opts.grad_clip)
        optim.step()
        sched.step()
    both.eval()
    with torch.no_grad():
        scores = {split: task.evaluate(lm, head, data[split]) for split in ("validation", "test")}
    return {"lr": lr, "seed": seed, "steps": total, "final_loss": float(loss.detach()), **scores}


def sweep(task: FinetuneTask, data: dict[str, Any], name: str) -> dict:
    """Every (lr, seed) run, the learning rate chosen on validation, and the test mean +- 95 % CI at it."""
    opts = task.opts
    runs = [train_once(task, data, lr, seed)
            for lr, seed in tqdm([(lr, s) for lr in opts.lrs for s in opts.seeds], desc=f"fine-tune {name}",
                                 disable=not task.ctx.progress, leave=False)]
    by_lr = {lr: [r for r in runs if r["lr"] == lr] for lr in opts.lrs}
    best_lr = max(opts.lrs, key=lambda lr: np.mean([r["validation"] for r in by_lr[lr]]))
    return {"metric": task.metric, "best_lr": best_lr,
            "test": mean_ci([r["test"] for r in by_lr[best_lr]]).as_dict(),
            "validation": mean_ci([r["validation"] for r in by_lr[best_lr]]).as_dict(),
            "sizes": {split: len(v) for split, v in data.items()}, "runs": runs}


def run_family(cls: type[FinetuneTask]):
    """The ``Task.run`` of a family: every dataset in DATA_DIR/<family> (or the ones named) through the sweep."""
    def run(ctx: EvalContext, opts: FinetuneOptions) -> dict:
        directory = os.path.join(ctx.data_dir, cls.family)
        names = opts.datasets or (sorted(n for n in os.listdir(directory) if os.path.isdir(os.path.join(directory, n)))
                                  if os.path.isdir(directory) else [])
        if not names:
            raise DataError(f"{directory}: no dataset directories for {cls.family} (see docs/evaluation.md)")
        task = cls(ctx, opts)
        results = {os.path.basename(n.rstrip("/")): sweep(task, task.load(n), n) for n in names}
        return {"datasets": results, "average": float(np.mean([r["test"]["mean"] for r in results.values()])),
                "attention": task.mode, "protocol": {k: v for k, v in vars(opts).items() if k != "datasets"}}
    return run


def eval_batches(items: Sequence, size: int, length: Callable[[Any], int]) -> Iterator[tuple[list[int], list]]:
    """(indices, items) of evaluation batches of at most ``size`` items, sorted by ``length`` (tokens) so little
    padding is computed (``pipeline.eval.forward.length_batches``). A row's scores move by float rounding with its
    batch (~1e-6 on CPU fp32), so a score on the edge may differ from input-order batches."""
    for batch in length_batches([length(item) for item in items], max_rows=size):
        yield batch, [items[i] for i in batch]
