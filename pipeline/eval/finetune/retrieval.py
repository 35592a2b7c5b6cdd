"""Retrieval: a bi-encoder fine-tuned on query/document pairs with in-batch negatives, scored by NDCG@10.

Texts are rendered ``"Query: ..."`` / ``"Document: ..."`` (EncodEval) and mean-pooled; training minimises InfoNCE
(``pipeline.objectives.infonce.info_nce``, scale 20) of each query against the batch's documents. Each evaluation
split is a file of query/document pairs ranked as ``pipeline.eval.ranking`` does (every document of the file is a
candidate, NDCG@10 of cosine similarity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.eval.data import DataError, Row
from pipeline.eval.encode import pool, rows_for
from pipeline.eval.finetune.protocol import FinetuneTask, eval_batches, run_family
from pipeline.eval.forward import pad_id, row_states
from pipeline.eval.ranking import DOCUMENT, QUERY, ndcg, ranking_pool
from pipeline.eval.task import Task
from pipeline.objectives.infonce import info_nce
from pipeline.tasks import SPECS


@dataclass
class EncodedPool:
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
        train = [(str(r.get(QUERY, "query")), str(r.get(DOCUMENT, "document"))) for r in rows["train"]]
        out = {"train": list(zip(self.encode_texts([f"Query: {q}" for q, _ in train]),
                                 self.encode_texts([f"Document: {d}" for _, d in train])))}
        for split in ("validation", "test"):
            pool_ = ranking_pool(rows[split], rows[split][0].where if rows[split] else f"the {split} split")
            out[split] = EncodedPool(self.encode_texts([f"Query: {q}" for q in pool_.queries]),
                                     self.encode_texts([f"Document: {d}" for d in pool_.documents]), pool_.relevance)
        return out

    def head(self, hidden_size: int) -> nn.Module:
        return nn.Identity()  # the embedding is the pooled state itself

    def embed(self, lm, rows: list) -> torch.Tensor:
        return pool(row_states(lm, [r[0] for r in rows], pad_id(self.ctx.model.tokenizer), self.mode), rows, "mean")

    def loss(self, lm, head: nn.Module, batch: list) -> torch.Tensor:
        if len(batch) < 2:
            raise DataError("retrieval training needs batches of at least 2 pairs (in-batch negatives); raise "
                            "batch_size or add pairs")
        out = info_nce(self.embed(lm, [q for q, _ in batch]), self.embed(lm, [d for _, d in batch]), self.opts.scale)
        return out.loss_sum / out.num_targets

    def evaluate(self, lm, head: nn.Module, pool_: EncodedPool) -> float:
        def embed_all(rows: list) -> np.ndarray:
            out = np.zeros((len(rows), lm.config.hidden_size), dtype=np.float32)
            for which, batch in eval_batches(rows, self.opts.eval_batch_size, lambda r: len(r[0])):
                out[which] = self.embed(lm, batch).float().cpu().numpy()
            return out

        return ndcg(embed_all(pool_.queries), embed_all(pool_.documents), pool_.relevance, self.opts.k)


TASKS = (Task(SPECS["retrieval"], run_family(Retrieval)),)
