"""Token-level linear probing on CoNLL column files (LLM2Vec's word tasks, MAGNET's Table 1): POS, chunk, NER.

The model is frozen. A word is the mean of its sub-token states (last layer; LLM2Vec's ``merge_subwords``); an
MNTP-trained model (``EvalModel.reads_previous``) is read one position earlier, at the states that predicted the
word's tokens (``retroactive_labels: next_token``). A linear classifier with dropout 0.1 (LLM2Vec: lr 5e-4, at most
4000 steps) is trained on the train file's words, with early stopping on the dev file's accuracy, and scored on
the test file: word accuracy, plus entity F1 (conlleval / seqeval rules) for BIO-tagged columns.

``DATA_DIR/conll/`` holds ``train``, ``dev`` and ``test`` files under CoNLL-2003's names (``eng.train``,
``eng.testa``, ``eng.testb``) or the usual ``train.txt`` / ``valid.txt`` / ``test.txt``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from pipeline.eval.data import DataError, Sentence, read_conll, split_file
from pipeline.eval.forward import length_batches, pad_id, row_states, tokenize_words
from pipeline.eval.metrics import entity_f1
from pipeline.eval.task import EvalContext, Task
from pipeline.tasks import SPECS, ProbingOptions

SPLIT_NAMES = {"train": ("train.txt", "eng.train", "train.conll", "train"),
               "dev": ("dev.txt", "valid.txt", "eng.testa", "dev.conll", "dev", "valid"),
               "test": ("test.txt", "eng.testb", "test.conll", "test")}


def load_splits(ctx: EvalContext, opts: ProbingOptions) -> dict[str, list[Sentence]]:
    directory = opts.directory if os.path.isabs(opts.directory) else os.path.join(ctx.data_dir, opts.directory)
    splits = {split: read_conll(split_file(directory, split, SPLIT_NAMES, "probing"))
              for split in ("train", "dev", "test")}
    if opts.max_train_sentences:
        splits["train"] = splits["train"][:opts.max_train_sentences]
    return splits


def tags_of(sentences: list[Sentence], column: int, name: str) -> list[list[str]]:
    if not sentences or column < 1 or column > len(sentences[0].tags):
        width = len(sentences[0].tags) + 1 if sentences else 0
        raise DataError(f"{sentences[0].where if sentences else 'probing'}: tag column {column} for {name!r} does "
                        f"not exist (the file has {width} columns, the token is column 0); set probing.columns")
    return [s.tags[column - 1] for s in sentences]


@torch.no_grad()
def word_features(ctx: EvalContext, sentences: list[Sentence], opts: ProbingOptions, shift: int
                  ) -> tuple[list[np.ndarray], int]:
    """Per sentence, float32 [words, d] features (None for a sentence that does not fit), and how many were skipped;
    sentences are sorted by length into batches of ``ctx.max_tokens`` padded tokens."""
    encoded = tokenize_words(ctx.model.tokenizer, [s.words for s in sentences])
    fits = [len(ids) <= min(opts.max_length, ctx.model.max_length) for ids, _ in encoded]
    feats: list = [None] * len(sentences)
    kept = [i for i, ok in enumerate(fits) if ok]
    pad, mode = pad_id(ctx.model.tokenizer), opts.attention or ctx.model.attention
    for batch in tqdm(length_batches([len(encoded[i][0]) for i in kept], ctx.max_tokens), desc="probe features",
                      disable=not ctx.progress, leave=False):
        chunk = [kept[b] for b in batch]
        hidden = row_states(ctx.model.lm, [encoded[i][0] for i in chunk], pad, mode).float().cpu()
        for row, i in enumerate(chunk):
            feats[i] = torch.stack([hidden[row, [p - shift for p in pos]].mean(0) if pos else torch.zeros(
                hidden.shape[-1]) for pos in encoded[i][1]]).numpy()
    return feats, len(sentences) - len(kept)


def check_labels(train: list[list[str]], other: list[list[str]], sentences: list[Sentence], name: str) -> None:
    known = {t for tags in train for t in tags}
    for tags, sentence in zip(other, sentences):
        unseen = sorted(set(tags) - known)
        if unseen:
            raise DataError(f"{sentence.where}: {name} label(s) {unseen} never occur in the training file, so a "
                            f"classifier trained on it cannot predict them; fix the tag or add training data")


def train_probe(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], num_labels: int, opts: ProbingOptions,
                seed: int) -> tuple[nn.Module, dict]:
    """Linear probe with early stopping on dev accuracy; returns the best probe and its training record."""
    torch.manual_seed(seed)
    probe = nn.Sequential(nn.Dropout(opts.dropout), nn.Linear(x["train"].shape[1], num_labels))
    optim = torch.optim.AdamW(probe.parameters(), lr=opts.lr)
    best, best_acc, bad, step, epoch = None, -1.0, 0, 0, 0
    while epoch < opts.max_epochs and step < opts.max_steps and bad < opts.patience:
        probe.train()
        for idx in torch.randperm(len(x["train"])).split(opts.batch_size):
            loss = nn.functional.cross_entropy(probe(x["train"][idx]), y["train"][idx])
            optim.zero_grad()
            loss.backward()
            optim.step()
            step += 1
            if step >= opts.max_steps:
                break
        epoch += 1
        probe.eval()
        with torch.no_grad():
            acc = float((probe(x["dev"]).argmax(-1) == y["dev"]).float().mean())
        if acc > best_acc:
            best, best_acc, bad = {k: v.clone() for k, v in probe.state_dict().items()}, acc, 0
        else:
            bad += 1
    probe.load_state_dict(best)
    return probe.eval(), {"dev_accuracy": best_acc, "epochs": epoch, "steps": step}


def run(ctx: EvalContext, opts: ProbingOptions) -> dict:
    splits = load_splits(ctx, opts)
    reads_previous = ctx.model.reads_previous if opts.read == "auto" else opts.read == "previous"
    feats, skipped = {}, {}
    for split, sentences in splits.items():
        feats[split], skipped[split] = word_features(ctx, sentences, opts, int(reads_previous))
    results = {}
    for name, column in opts.columns.items():
        tags = {split: tags_of(sentences, column, name) for split, sentences in splits.items()}
        for split in ("dev", "test"):
            check_labels(tags["train"], tags[split], splits[split], name)
        labels = sorted({t for sentence_tags in tags["train"] for t in sentence_tags})
        label_id = {t: i for i, t in enumerate(labels)}
        kept = {s: [i for i, f in enumerate(feats[s]) if f is not None] for s in splits}
        x = {s: torch.from_numpy(np.concatenate([feats[s][i] for i in kept[s]])) for s in splits}
        y = {s: torch.tensor([label_id[t] for i in kept[s] for t in tags[s][i]]) for s in splits}
        probe, record = train_probe(x, y, len(labels), opts, ctx.seed)
        with torch.no_grad():
            pred = probe(x["test"]).argmax(-1)
        result = {"accuracy": 100 * float((pred == y["test"]).float().mean()), **record, "labels": len(labels),
                  "train_words": len(y["train"])}
        if any("-" in t for t in labels):
            flat, pred_tags, start = [labels[int(p)] for p in pred], [], 0
            for i in kept["test"]:
                pred_tags.append(flat[start:start + len(tags["test"][i])])
                start += len(tags["test"][i])
            result["f1"] = 100 * entity_f1([tags["test"][i] for i in kept["test"]], pred_tags)["f1"]
        results[name] = result
    return {"tasks": results, "reads_previous": reads_previous, "attention": opts.attention or ctx.model.attention,
            "skipped_too_long": skipped}


TASKS = (Task(SPECS["probing"], run),)
