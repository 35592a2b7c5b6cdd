"""LLM2Vec's supervised contrastive stage: (query, positive, hard negatives) rows with task instructions.

A pairs sample (``build_shards.py --pairs``, ``pipeline/data/prep/pairs.py``) holds t = 2 + K slots of W tokens: the
instructed query, its positive and K hard negatives. The [B, t x W] rows unpack to [B x t, W], cut to the longest
slot, run once with bidirectional attention, and each slot is mean-pooled over its text tokens (``pool_spans``:
the instruction, BOS and EOS left out, exactly what ``encode()`` pools). InfoNCE on cosine similarity at
``scale`` 50 (LLM2Vec's ``loss_scale`` for this stage, tau = 0.02) makes each query pick its positive among every
positive and every hard negative of the global batch, gathered across ranks with gradient (``info_nce``: LLM2Vec's
HardNegativeNLLLoss, positives first, then negatives; one direction).

False negatives are masked (``mask_collisions``): a candidate whose text equals query i's positive (another row's
hard negative, or another row's identical positive: SQuAD-style data has many, llm2vec issue #178) leaves query
i's softmax and stays a negative for every other query. The texts are compared by the 64-bit hashes data prep
stores per slot (``text_hash``), gathered with the embeddings.

``in_batch_negatives: false`` scores each query against its own positive and hard negatives alone (no other row's
candidates, nothing gathered): the second stage of NV-Embed, which trains tasks whose other rows are no negatives
(classification, clustering, STS) this way, FlagEmbedding's ``use_inbatch_neg=False``. Each row's loss is then its
own, so GradCache and any number of ranks give the loss and gradient of one big batch as before.

``grad_cache`` makes the step's ``grad_accum`` micro-batches one contrastive batch of ``micro_batch x grad_accum x
ranks`` rows, on the memory of one micro-batch (GradCache, ``pipeline/train/grad_cache.py``): the step embeds
(:meth:`Supervised.embed`) each micro-batch without a graph, computes the loss of all of them
(:meth:`Supervised.loss`) and its gradient with respect to the embeddings, then re-runs each micro-batch with
its RNG state restored and back-propagates the cached gradient. Without it, ``grad_accum`` > 1 is refused: each
micro-step would be its own contrastive batch, with fewer negatives than the step has rows. ``grad_cache: {tokens:
N}`` cuts the chunks by a token budget instead of by micro-batch (:class:`TokenChunks`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from pipeline.data.format.index import ShardKind
from pipeline.data.loading.batch import Batch
from pipeline.model.flops import body_work, segment_lengths
from pipeline.objectives.base import Objective, ObjectiveOutput
from pipeline.objectives.configs import SupervisedConfig, TokenChunks
from pipeline.objectives.infonce import info_nce
from pipeline.objectives.simcse import mean_pool


def check_pairs(batch: Batch, objective: str) -> None:
    if batch.pool_spans is None:
        raise ValueError(f"{objective} reads (query, positive, negatives) pairs samples, but samples "
                         f"{batch.keys[:3]} are not: point data.pair_shards at shards built with "
                         f"data_prep/build_shards.py --pairs")


class Supervised(Objective):
    name = "supervised"
    shard_kind = ShardKind.PAIRS
    predicts_tokens = False

    def __init__(self, config: SupervisedConfig, document_masking: bool = True):
        super().__init__(config, document_masking)
        self.scale, self.hard_negatives = config.scale, config.hard_negatives
        self.in_batch_negatives = config.in_batch_negatives
        self.mask_collisions, self.grad_cache = config.mask_collisions, bool(config.grad_cache)
        self.chunk_tokens = config.grad_cache.tokens if isinstance(config.grad_cache, TokenChunks) else None
        self.matryoshka = config.matryoshka

    def num_targets(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One query per row."""
        return {self.name: (batch.doc_ids >= 0).any(-1).sum()}

    def body_work(self, batch: Batch) -> torch.Tensor:
        """Every slot is its own attention segment."""
        return body_work(segment_lengths(batch.doc_ids, True))

    def embed(self, model: PreTrainedModel, batch: Batch) -> torch.Tensor:
        """fp32 [B x t, d]: the pooled slots of each row in order (query, positive, negatives)."""
        check_pairs(batch, self.name)
        rows, slots = batch.pool_spans.shape[:2]
        width = batch.input_ids.shape[1] // slots
        ids = batch.input_ids.view(rows * slots, width)
        doc_ids = torch.where(batch.doc_ids.view(rows * slots, width) >= 0, 0, -1)
        longest = int((doc_ids >= 0).sum(-1).max())  # a host sync, repaid by not running the padding
        ids, doc_ids = ids[:, :longest], doc_ids[:, :longest]
        start = (torch.arange(rows * slots, device=ids.device) % slots * width)[:, None]
        spans = batch.pool_spans.view(rows * slots, 2) - start
        position = torch.arange(longest, device=ids.device)[None, :]
        keep = (position >= spans[:, :1]) & (position < spans[:, 1:])
        return mean_pool(self.hidden_states(model, ids, doc_ids), keep).float()

    def loss(self, embeddings: torch.Tensor, batches: list[Batch]) -> ObjectiveOutput:
        """The InfoNCE of the rows of ``batches`` (this rank's, in order) from their ``embed`` outputs, concatenated;
        the candidates are gathered across ranks (with in-batch negatives)."""
        slots = batches[0].pool_spans.shape[1]
        e = embeddings.view(-1, slots, embeddings.shape[-1])
        hashes = torch.cat([b.text_hash for b in batches])
        negatives = self.hard_negatives and slots > 2
        return info_nce(e[:, 0], e[:, 1], self.scale,
                        negatives=e[:, 2:].reshape(-1, e.shape[-1]) if negatives else None,
                        key_hashes=hashes[:, 1] if self.mask_collisions else None,
                        negative_hashes=hashes[:, 2:].reshape(-1) if negatives else None, matryoshka=self.matryoshka,
                        in_batch=self.in_batch_negatives)

    def __call__(self, model: PreTrainedModel, batch: Batch) -> dict[str, ObjectiveOutput]:
        return {self.name: self.loss(self.embed(model, batch), [batch])}
