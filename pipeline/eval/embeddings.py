"""Sentence-embedding tasks as MTEB scores them, on local files, without training: STS (Spearman of cosine similarity
against the gold scores, x100), clustering (V-measure of k-means with k = the number of gold labels, x100) and
zero-shot retrieval (NDCG@10 and MRR@10 x100 of the cosine ranking, ``pipeline.eval.ranking``).

STS records (``.tsv`` with a header, ``.jsonl``, or an HF dataset): STS-B (``sentence1``, ``sentence2``,
``score``), SICK (``sentence_A``, ``sentence_B``, ``relatedness_score``), MTEB (``sentence1``, ``sentence2``,
``score``). Clustering records: MTEB's layout, one set per record (``{"sentences": [...], "labels": [...]}``), or one
text and label per record (``text``/``sentence`` and ``label``), which form one set. Retrieval records: ``query``,
``positive`` (or ``document``), optional ``relevance`` and ``instruction``; the pool is every document of the file.
Queries carry their instruction (the ``instruction`` option, else the row's, else the model's recorded one) and
documents none, as LLM2Vec evaluates retrieval; a model trained without an instruction format (every objective
but ``supervised``) reads it as ``instruction_format`` joins it, LLM2Vec's ``"{instruction}: "``.
"""

from __future__ import annotations

import numpy as np

from pipeline.data.format.instructions import format_instruction
from pipeline.eval.data import DataError, Row, dataset_name, read_rows
from pipeline.eval.encode import encode
from pipeline.eval.metrics import spearman, v_measure
from pipeline.eval.ranking import mrr, ndcg, ranking_pool
from pipeline.eval.task import EvalContext, Task
from pipeline.tasks import SPECS, EmbeddingOptions

EXTS = (".tsv", ".csv", ".txt", ".jsonl", ".json")


def _embed(ctx: EvalContext, texts: list[str], opts: EmbeddingOptions, instruction: str | None = None
           ) -> np.ndarray:
    """Each distinct text is encoded once (STS files repeat sentences across pairs); ``instruction``: the option's
    unless given."""
    distinct = list(dict.fromkeys(texts))
    emb = encode(ctx.model, distinct, opts.instruction if instruction is None else instruction, opts.pooling,
                 ctx.max_tokens, opts.attention, opts.max_length, ctx.progress, opts.layout, dim=ctx.dim)
    where = {t: i for i, t in enumerate(distinct)}
    return emb[[where[t] for t in texts]]


def _float(row: Row, value, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise DataError(f"{row.where}: {what} {value!r} is not a number") from e


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return (a * b).sum(1) / norms


def sts_file(ctx: EvalContext, dataset: str, opts: EmbeddingOptions) -> dict:
    rows = read_rows(dataset, opts.split)
    rows = rows[: opts.max_examples] if opts.max_examples else rows
    if len(rows) < 2:
        raise DataError(f"{dataset}: {len(rows)} pairs; Spearman needs at least 2")
    first = [r.get(("sentence1", "sentence_A", "text1", "s1"), "first sentence") for r in rows]
    second = [r.get(("sentence2", "sentence_B", "text2", "s2"), "second sentence") for r in rows]
    gold = [_float(r, r.get(("score", "relatedness_score", "similarity", "label"), "gold score"), "score")
            for r in rows]
    emb = _embed(ctx, first + second, opts)
    sims = cosine(emb[: len(rows)], emb[len(rows):])
    return {"spearman": 100 * spearman(sims, gold), "pairs": len(rows)}


def kmeans(x: np.ndarray, k: int, seed: int, restarts: int = 10, iterations: int = 100) -> np.ndarray:
    """Cluster ids of Lloyd's k-means with k-means++ seeding; the restart with the lowest inertia wins."""
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(restarts):
        centers = [x[rng.integers(len(x))]]
        for _ in range(1, k):
            d2 = np.min(((x[:, None] - np.asarray(centers)[None]) ** 2).sum(-1), axis=1)
            centers.append(x[rng.choice(len(x), p=d2 / d2.sum())] if d2.sum() > 0 else x[rng.integers(len(x))])
        centers = np.asarray(centers)
        for _ in range(iterations):
            labels = ((x[:, None] - centers[None]) ** 2).sum(-1).argmin(1)
            moved = np.asarray([x[labels == c].mean(0) if (labels == c).any() else centers[c] for c in range(k)])
            if np.allclose(moved, centers):
                break
            centers = moved
        inertia = ((x - centers[labels]) ** 2).sum()
        if inertia < best_inertia:
            best, best_inertia = labels, inertia
    return best


def cluster_sets(rows: list[Row]) -> list[tuple[list[str], list[str], str]]:
    """(texts, labels, where) per clustering set."""
    if rows and rows[0].get(("sentences",), "sentences", required=False) is not None:
        sets = []
        for r in rows:
            texts, labels = r.get(("sentences",), "sentences"), r.get(("labels",), "labels")
            if len(texts) != len(labels):
                raise DataError(f"{r.where}: {len(texts)} sentences but {len(labels)} labels")
            sets.append((list(texts), [str(label) for label in labels], r.where))
        return sets
    return [([r.get(("text", "sentence"), "text") for r in rows],
             [str(r.get(("label", "labels", "category"), "label")) for r in rows], rows[0].where if rows else "")]


def clustering_file(ctx: EvalContext, dataset: str, opts: EmbeddingOptions) -> dict:
    rows = read_rows(dataset, opts.split)
    sets = cluster_sets(rows[: opts.max_examples] if opts.max_examples else rows)
    scores = []
    for texts, labels, where in sets:
        k = len(set(labels))
        if k < 2 or len(texts) < k:
            raise DataError(f"{where}: a clustering set needs >= 2 labels and at least as many texts, got {k} labels "
                            f"and {len(texts)} texts")
        labels_pred = kmeans(_embed(ctx, texts, opts), k, ctx.seed)
        scores.append(v_measure(labels, labels_pred))
    return {"v_measure": 100 * float(np.mean(scores)), "sets": len(sets)}


def retrieval_file(ctx: EvalContext, dataset: str, opts: EmbeddingOptions) -> dict:
    rows = read_rows(dataset, opts.split)
    pool = ranking_pool(rows[: opts.max_examples] if opts.max_examples else rows, dataset)
    queries = None  # [queries, width]: the width is encode()'s (a --dim or the record's truncate_dim cuts it)
    by_instruction: dict[str, list[int]] = {}
    for i, row in enumerate(pool.rows):
        given = opts.instruction if opts.instruction is not None else row.get(("instruction",), "instruction",
                                                                              required=False)
        by_instruction.setdefault(ctx.model.record.instruction if given is None else str(given), []).append(i)
    for instruction, which in by_instruction.items():
        if ctx.model.record.instruction_format is None:
            instruction = format_instruction(opts.instruction_format, instruction)
        embedded = _embed(ctx, [pool.queries[i] for i in which], opts, instruction or "")
        if queries is None:
            queries = np.zeros((len(pool.queries), embedded.shape[1]), dtype=np.float32)
        queries[which] = embedded
    documents = _embed(ctx, pool.documents, opts, "")
    return {"ndcg": ndcg(queries, documents, pool.relevance, opts.k),
            "mrr": mrr(queries, documents, pool.relevance, opts.k), "k": opts.k, "queries": len(pool.queries),
            "documents": len(pool.documents)}


METRICS = {"sts": "spearman", "clustering": "v_measure", "zero_shot_retrieval": "ndcg"}


def _run(family: str, per_file):
    def run(ctx: EvalContext, opts: EmbeddingOptions) -> dict:
        results = {dataset_name(s): per_file(ctx, s, opts) for s in ctx.datasets(family, opts.datasets, EXTS)}
        metric = METRICS[family]
        return {"datasets": results, "average": float(np.mean([r[metric] for r in results.values()])),
                "pooling": opts.pooling or ctx.model.record.pooling, "layout": opts.layout or ctx.model.record.layout,
                "instruction": ctx.model.record.instruction if opts.instruction is None else opts.instruction,
                "attention": opts.attention or ctx.model.attention}
    return run


TASKS = (Task(SPECS["sts"], _run("sts", sts_file)), Task(SPECS["clustering"], _run("clustering", clustering_file)),
         Task(SPECS["zero_shot_retrieval"], _run("zero_shot_retrieval", retrieval_file)))
