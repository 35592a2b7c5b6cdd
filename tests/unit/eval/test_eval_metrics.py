"""Every evaluation metric against a value computed by hand on a tiny input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import rankdata

from pipeline.eval.embeddings import kmeans
from pipeline.eval.metrics import (
    entities,
    entity_f1,
    mean_ci,
    mrr_at_k,
    ndcg_at_k,
    rep_n,
    rep_sen,
    spearman,
    squad_scores,
    t_quantile,
    v_measure,
)


def test_spearman_with_ties():
    # ranks of y: 1, 2, 3.5, 5, 3.5; covariance of ranks 8, variances 10 and 9.5
    assert rankdata([5, 6, 7, 8, 7]).tolist() == [1, 2, 3.5, 5, 3.5]
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(10 * 9.5))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)


def test_v_measure():
    assert v_measure([0, 0, 1, 1], ["b", "b", "a", "a"]) == pytest.approx(1.0)  # names do not matter
    assert v_measure([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0)
    # scikit-learn's documented example: homogeneity 2/3; completeness 1 - H(K|C) / H(K) with H(K|C) the entropy
    # of a 2:1 split, H(K) = ln 3
    h = 2 / 3
    c = 1 - (-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3)) / math.log(3)
    assert v_measure([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]) == pytest.approx(2 * h * c / (h + c))


def test_mrr_at_10():
    assert mrr_at_k(["a", "b", "c"], {"b": 1, "c": 1}) == 0.5  # the first relevant one counts
    assert mrr_at_k(["a", "b"], {"a": 0, "b": 2}) == 0.5  # a gain of 0 is not relevant
    ranked = [f"d{i}" for i in range(1, 12)]
    assert mrr_at_k(ranked, {"d10": 1}) == 0.1 and mrr_at_k(ranked, {"d11": 1}) == 0.0  # beyond the cut-off


def test_ndcg_at_10():
    # relevant b, c at ranks 2 and 3: DCG = 1/log2(3) + 1/log2(4); ideal = 1 + 1/log2(3)
    expected = (1 / math.log2(3) + 0.5) / (1 + 1 / math.log2(3))
    assert ndcg_at_k(["a", "b", "c"], {"b": 1, "c": 1}) == pytest.approx(expected)
    assert ndcg_at_k(["b", "a"], {"b": 1}) == pytest.approx(1.0)
    ranked = [f"d{i}" for i in range(12)]
    assert ndcg_at_k(ranked, {"d11": 1}) == 0.0  # beyond the cut-off
    assert ndcg_at_k(ranked, {"d9": 1}) == pytest.approx(1 / math.log2(11))


def test_mean_and_95_ci():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, rel=1e-6)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764451, rel=1e-6)
    assert t_quantile(0.975, 30) == pytest.approx(2.0422725, rel=1e-6)
    ci = mean_ci([1, 2, 3, 4, 5])  # s = sqrt(2.5)
    assert ci.mean == 3 and ci.n == 5
    assert ci.half_width == pytest.approx(2.7764451 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert mean_ci([7.0]).as_dict() == {"mean": 7.0, "ci95": None, "n": 1}


def test_entities_and_f1():
    assert entities(["B-PER", "I-PER", "O", "B-LOC"]) == {("PER", 0, 1), ("LOC", 3, 3)}
    # CoNLL-2003 is IOB1: I- opens an entity; B- only separates two adjacent ones of one type
    assert entities(["I-PER", "I-PER", "O", "I-LOC"]) == {("PER", 0, 1), ("LOC", 3, 3)}
    assert entities(["I-PER", "B-PER", "I-ORG"]) == {("PER", 0, 0), ("PER", 1, 1), ("ORG", 2, 2)}
    scores = entity_f1([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-ORG"]])
    assert scores == {"precision": 0.5, "recall": 0.5, "f1": 0.5}
    # a partly found entity is wrong: gold 2, predicted 3, correct 1 -> P 1/3, R 1/2, F1 0.4
    scores = entity_f1([["B-PER", "I-PER", "B-LOC"]], [["B-PER", "B-PER", "B-LOC"]])
    assert scores["f1"] == pytest.approx(0.4)


def test_rep_n_and_rep_sen():
    words = "a b a b a".split()
    assert rep_n(words, 2) == pytest.approx(0.5)  # ab ba ab ba: 2 unique of 4
    assert rep_n(words, 3) == pytest.approx(1 / 3)  # aba bab aba
    assert rep_n(words, 4) == pytest.approx(0.0)  # abab baba
    assert rep_n(["a", "b"], 3) is None
    assert rep_sen("I am here. I am here. You go.") == pytest.approx(1 / 3)
    assert rep_sen("") is None


def test_squad_scores():
    assert squad_scores(["the Eiffel Tower"], "Eiffel tower.") == (1.0, 1.0)
    em, f1 = squad_scores(["Eiffel Tower"], "Tower in Paris")  # 1 common token: P 1/3, R 1/2
    assert em == 0.0 and f1 == pytest.approx(0.4)
    assert squad_scores(["Paris", "in Paris"], "in Paris") == (1.0, 1.0)  # best gold answer counts
    assert squad_scores([], "") == (1.0, 1.0)  # unanswerable, answered with nothing
    assert squad_scores([], "Paris") == (0.0, 0.0)


def test_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [10, 0], [0, 10]], dtype=float)
    labels = np.repeat([0, 1, 2], 10)
    points = centres[labels] + rng.normal(scale=0.5, size=(30, 2))
    assert v_measure(labels, kmeans(points, 3, seed=0)) == pytest.approx(1.0)
