"""The evaluation metrics, each small enough to check by hand (``tests/unit/eval/test_eval_metrics.py`` does).

Spearman's rho and the Student-t quantile come from scipy, the V-measure from scikit-learn, each imported where it is
used (scipy.stats and sklearn.metrics cost a rank ~1.8 CPU seconds at every start, and training rarely needs them); the rest (NDCG as
trec_eval, entity F1 as conlleval / seqeval, SQuAD's EM/F1, repetition rates) are written here in numpy, each
following the definition of the library the papers' numbers come from (named per function), so the numbers are
comparable.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.data.format.units import split_units


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho with ties given their average rank (MTEB's STS score, times 100 there); 0.0 when a series is
    constant (scipy: nan)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"correlation needs two equally long series of >= 2 values, got {len(x)} and {len(y)}")
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    from scipy import stats

    return float(stats.spearmanr(x, y).statistic)


def v_measure(labels_true: Sequence, labels_pred: Sequence) -> float:
    """Harmonic mean of homogeneity and completeness (scikit-learn's ``v_measure_score``, beta = 1; MTEB
    clustering) of labels compared as strings. A single true class and a single cluster both count as perfect."""
    if len(labels_true) != len(labels_pred):
        raise ValueError(f"v_measure: {len(labels_true)} true labels but {len(labels_pred)} predicted ones")
    from sklearn.metrics import v_measure_score

    return float(v_measure_score(np.asarray(labels_true, dtype=object).astype(str),
                                 np.asarray(labels_pred, dtype=object).astype(str)))


def ndcg_at_k(ranked: Sequence[str], relevance: dict[str, float], k: int = 10) -> float:
    """NDCG@k of one query: ``ranked`` candidate ids best first, ``relevance`` id -> gain (absent = 0). Linear
    gain and log2(rank + 1) discount, as trec_eval's ``ndcg_cut`` (BEIR, MTEB retrieval)."""
    dcg = sum(relevance.get(doc, 0.0) / math.log2(i + 2) for i, doc in enumerate(ranked[:k]))
    ideal = sorted(relevance.values(), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def mrr_at_k(ranked: Sequence[str], relevance: dict[str, float], k: int = 10) -> float:
    """Reciprocal rank of the first relevant candidate (gain > 0) among the top ``k``, 0 without one: MRR@k of one
    query (MTEB's retrieval ``mrr_at_k``)."""
    return next((1.0 / (i + 1) for i, doc in enumerate(ranked[:k]) if relevance.get(doc, 0.0) > 0), 0.0)


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: ``scipy.stats.t.ppf`` as a float."""
    from scipy import stats

    return float(stats.t.ppf(p, df))


@dataclass(frozen=True)
class MeanCI:
    mean: float
    half_width: float | None  # None with a single value (no spread to estimate)
    n: int

    def as_dict(self) -> dict:
        return {"mean": self.mean, "ci95": self.half_width, "n": self.n}


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> MeanCI:
    """Mean and the half-width of its two-sided Student-t confidence interval over seeds:
    t_{(1+c)/2, n-1} * s / sqrt(n), s the sample standard deviation (ddof 1)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        raise ValueError("mean_ci needs at least one value")
    if len(v) == 1:
        return MeanCI(float(v[0]), None, 1)
    half = t_quantile((1.0 + confidence) / 2.0, len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return MeanCI(float(v.mean()), half, len(v))


# --- sequence labelling: entity F1 as conlleval / seqeval's default mode ---------------------------------------------

def _split_tag(tag: str) -> tuple[str, str]:
    if tag == "O" or "-" not in tag:
        return "O", ""
    prefix, kind = tag.split("-", 1)
    return prefix, kind


def _chunk_end(prev: str, prev_kind: str, tag: str, kind: str) -> bool:
    return (prev in ("E", "S") or (prev in ("B", "I") and tag in ("B", "S", "O"))
            or (prev != "O" and prev_kind != kind))


def _chunk_start(prev: str, prev_kind: str, tag: str, kind: str) -> bool:
    return (tag in ("B", "S") or (prev in ("E", "S", "O") and tag in ("E", "I"))
            or (tag != "O" and prev_kind != kind))


def entities(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of each entity in a tag sequence (IOB1, IOB2, IOBES), by conlleval's chunk rules, so an
    ``I-`` after ``O`` or after another type starts an entity (CoNLL-2003 is IOB1)."""
    found, start = set(), None
    prev, prev_kind = "O", ""
    for i, tag in enumerate([*tags, "O"]):
        cur, kind = _split_tag(tag)
        if start is not None and _chunk_end(prev, prev_kind, cur, kind):
            found.add((prev_kind, start, i - 1))
            start = None
        if _chunk_start(prev, prev_kind, cur, kind):
            start = i
        prev, prev_kind = cur, kind
    return found


def entity_f1(true: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """Micro precision, recall and F1 over the entities of all sentences (seqeval's default report)."""
    if len(true) != len(pred) or any(len(t) != len(p) for t, p in zip(true, pred)):
        raise ValueError("entity_f1: true and predicted tag sequences differ in number or length")
    gold = predicted = correct = 0
    for t, p in zip(true, pred):
        te, pe = entities(t), entities(p)
        gold, predicted, correct = gold + len(te), predicted + len(pe), correct + len(te & pe)
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


# --- extractive QA: the official SQuAD v1.1/v2.0 script's answer normalisation, EM and F1 ----------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _token_f1(gold: str, pred: str) -> float:
    g, p = normalize_answer(gold).split(), normalize_answer(pred).split()
    if not g or not p:  # SQuAD v2: an empty answer scores 1 only against an empty answer
        return float(g == p)
    common = sum((Counter(g) & Counter(p)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_scores(golds: Sequence[str], pred: str) -> tuple[float, float]:
    """(exact match, F1) of one prediction: the best over the gold answers; no gold answer = unanswerable, where
    only the empty prediction is right."""
    golds = list(golds) or [""]
    return (max(float(normalize_answer(g) == normalize_answer(pred)) for g in golds),
            max(_token_f1(g, pred) for g in golds))


# --- repetition: Welleck et al.'s seq-rep-n, MAGNET's Rep-Sen ---------------------------------------------------------

def rep_n(words: Sequence[str], n: int) -> float | None:
    """1 - unique n-grams / n-grams of one continuation; None when it has fewer than n words."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else None


def rep_sen(text: str) -> float | None:
    """1 - unique sentences / sentences of one continuation (sentences as data prep splits them); None when it
    has no sentence."""
    sentences = split_units(text, "sentence")
    return 1.0 - len(set(sentences)) / len(sentences) if sentences else None
