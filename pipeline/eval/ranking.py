"""Retrieval as MTEB scores it, shared by the fine-tuned bi-encoder task and the zero-shot one: the candidate pool
of a file of query/document pairs, and NDCG@k and MRR@k of the cosine ranking.

A file's rows are (query, document) pairs with an optional graded ``relevance`` (default 1); rows with the same
query merge into one query with several relevant documents, and the pool is every distinct document of the file
(EncodEval restricts pools to the qrels' documents the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.eval.data import DataError, Row
from pipeline.eval.metrics import mrr_at_k, ndcg_at_k

QUERY, DOCUMENT = ("query", "question", "anchor"), ("document", "positive", "passage", "text")


@dataclass
class Pool:
    queries: list[str]
    documents: list[str]
    relevance: list[dict[int, float]]  # per query: document index -> gain
    rows: list[Row]  # the first row of each query (its instruction, its place in the file)


def ranking_pool(rows: Sequence[Row], where: str) -> Pool:
    queries: dict[str, int] = {}
    documents: dict[str, int] = {}
    relevance: list[dict[int, float]] = []
    first: list[Row] = []
    for row in rows:
        q, d = str(row.get(QUERY, "query")), str(row.get(DOCUMENT, "document"))
        if q not in queries:
            queries[q] = len(queries)
            relevance.append({})
            first.append(row)
        documents.setdefault(d, len(documents))
        gain = row.get(("relevance", "score", "label"), "relevance", required=False)
        relevance[queries[q]][documents[d]] = float(1 if gain is None else gain)
    if len(documents) < 2:
        raise DataError(f"{where}: {len(documents)} distinct documents; ranking needs a pool of at least 2")
    return Pool(list(queries), list(documents), relevance, first)


def cosine_ranking(query_emb: np.ndarray, document_emb: np.ndarray) -> np.ndarray:
    """[queries, documents] document indices of each query, best first by cosine similarity (ties: the pool's
    order)."""
    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    return np.argsort(-(unit(query_emb) @ unit(document_emb).T), axis=1, kind="stable")


def ndcg(query_emb: np.ndarray, document_emb: np.ndarray, relevance: Sequence[dict[int, float]], k: int) -> float:
    """Mean NDCG@k x100 of ranking every document by cosine similarity to each query (ties: the pool's order)."""
    ranked = cosine_ranking(query_emb, document_emb)
    return 100.0 * float(np.mean([ndcg_at_k(ranked[i].tolist(), rel, k) for i, rel in enumerate(relevance)]))


def mrr(query_emb: np.ndarray, document_emb: np.ndarray, relevance: Sequence[dict[int, float]], k: int) -> float:
    """Mean MRR@k x100 of the same ranking as :func:`ndcg`."""
    ranked = cosine_ranking(query_emb, document_emb)
    return 100.0 * float(np.mean([mrr_at_k(ranked[i].tolist(), rel, k) for i, rel in enumerate(relevance)]))
