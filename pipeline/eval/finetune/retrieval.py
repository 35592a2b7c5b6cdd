"""Retrieval: a bi-encoder fine-tuned on query/document pairs with in-batch negatives, scored by NDCG@10.

Texts are rendered ``"Query: ..."`` / ``"Document: ..."`` (EncodEval) and mean-pooled; training minimises InfoNCE
(``pipeline.objectives.infonce.info_nce``, scale 20) of each query against the batch's documents. Each evaluation
split is a file of query/document pairs (``query``, ``document`` or ``positive``, optional ``relevance``, default
1); the candidate pool is every document of that file (EncodEval restricts pools to the qrels' documents the
same way), ranked by cosine similarity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.eval.data import DataError, Row
from pipeline.eval.encode import pool, rows_for
from pipeline.eval.finetune.protocol import FinetuneOptions, FinetuneTask, batch_rows, run_family
from pipeline.eval.forward import hidden_states, pad_id, pad_rows
from pipeline.eval.metrics import ndcg_at_k
from pipeline.eval.task import Task
from pipeline.objectives.infonce import info_nce

QUERY, DOCUMENT = ("query", "question", "anchor"), ("document", "positive", "passage", "text")


@dataclass
class RetrievalOptions(FinetuneOptions):
    scale: float = 20.0  # InfoNCE logit scale, 1 / temperature
    k: int = 10  # NDCG cut-off


@dataclass
class Pool:
    queries: list  # encoded queries
    documents: list  # encoded candidate documents
    relevance: list[dict[int, float]]  # per query: document index -> gain

    def __len__(self) -> int:
        return len(self.queries)


class Retrieval(FinetuneTask):
    family = "retrieval"
    metric = "ndcg@10"

    def encode_texts(self, texts: list[str]) -> list:
        return rows_for(self.ctx.model, texts, None, min(self.opts.max_length, self.ctx.model.max_length), "bos_eos")

    def prepare(self, rows: dict[str, list[Row]]) -> dict:
        pairs = {split: [(str(r.get(QUERY, "query")), str(r.get(DOCUMENT, "document")), r) for r in split_rows]
                 for split, split_rows in rows.items()}
        train = pairs["train"]
        out = {"train": list(zip(self.encode_texts([f"Query: {q}" for q, _, _ in train]),
                                 self.encode_texts([f"Document: {d}" for _, d, _ in train])))}
        for split in ("validation", "test"):
            queries, documents, relevance = {}, {}, []
            for q, d, row in pairs[split]:
                if q not in queries:
                    queries[q] = len(queries)
                    relevance.append({})
                documents.setdefault(d, len(documents))
                gain = row.get(("relevance", "score", "label"), "relevance", required=False)
                relevance[queries[q]][documents[d]] = float(1 if gain is None else gain)
            if len(documents) < 2:
                raise DataError(f"{rows[split][0].where if rows[split] else split}: the {split} split has "
                                f"{len(documents)} distinct documents; ranking needs a pool of at least 2")
            out[split] = Pool(self.encode_texts([f"Query: {q}" for q in queries]),
                              self.encode_texts([f"Document: {d}" for d in documents]), relevance)
        return out

    def head(self, hidden_size: int) -> nn.Module:
        return nn.Identity()  # the embedding is the pooled state itself

    def embed(self, lm, rows: list) -> torch.Tensor:
        ids, doc_ids = pad_rows([r[0] for r in rows], pad_id(self.ctx.model.tokenizer), self.ctx.model.device)
        return pool(hidden_states(lm, ids, doc_ids, self.mode), rows, "mean")

    def loss(self, lm, head: nn.Module, batch: list) -> torch.Tensor:
        if len(batch) < 2:
            raise DataError("retrieval training needs batches of at least 2 pairs (in-batch negatives); raise "
                            "batch_size or add pairs")
        out = info_nce(self.embed(lm, [q for q, _ in batch]), self.embed(lm, [d for _, d in batch]), self.opts.scale)
        return out.loss_sum / out.num_targets

    def evaluate(self, lm, head: nn.Module, pool_: Pool) -> float:
        def embed_all(rows: list) -> np.ndarray:
            emb = torch.cat([self.embed(lm, b) for b in batch_rows(rows, self.opts.eval_batch_size)]).float()
            return nn.functional.normalize(emb, dim=-1).cpu().numpy()

        sims = embed_all(pool_.queries) @ embed_all(pool_.documents).T
        ranked = np.argsort(-sims, axis=1, kind="stable")
        return 100.0 * float(np.mean([ndcg_at_k(ranked[i].tolist(), rel, self.opts.k)
                                      for i, rel in enumerate(pool_.relevance)]))


TASKS = (Task("retrieval", "retrieval", "fine-tuned bi-encoder retrieval (NDCG@10), LR x seed sweep",
              RetrievalOptions, run_family(Retrieval), lambda r: {"ir_ndcg10": r["average"]}),)
