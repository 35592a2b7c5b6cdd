"""Embedding distillation from a teacher whose embeddings data prep stored beside the pair shards
(``data_prep/teacher_embed.py``, ``pipeline.data.format.teacher``): EmbeddingGemma's geometric distillation.

Every slot of a pairs row (query, positive, hard negatives) is embedded as the supervised objective embeds it
(``embed_slots``), and two losses pull the student toward the teacher's row of the same sample key:

- ``distill_embedding``: per text, 1 - cosine (``embedding_loss: cosine``) or the mean squared error
  (``mse``, sentence-transformers' ``MSELoss``) between the student's embedding and the teacher's; a learned linear
  projection (``distill_projection``, attached to the model, not exported) maps the student's width to the
  teacher's when they differ. A row's loss is the mean over its texts.
- ``distill_kl``: the KL divergence KL(teacher || student) between each query's softmax, at ``temperature``, over
  its cosine similarities to every candidate (positive and negative) of the micro-batch: the teacher's in-batch
  similarity matrix against the student's own (no projection: the geometry the export will have). sentence-
  transformers' ``DistillKLDivLoss`` over in-batch candidates; ``MarginMSELoss`` is its pairwise cousin.

Both are sums over the micro-batch's queries (its padding rows left out), normalised by the step's query count
like every loss, and weighted by ``embedding_weight`` and ``kl_weight``. A separate objective rather than a
``distill:`` option of ``supervised``: it shares none of InfoNCE's settings (scale, collisions, GradCache, the
cross-rank gather), it is a phase on its own (EmbeddingGemma's) or beside ``supervised`` in one phase with weights,
and its similarity matrix is each micro-batch's: grad_accum > 1 needs no GradCache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from pipeline.data.format.index import ShardKind
from pipeline.data.format.teacher import TeacherEmbeddings, load_teacher, teacher_dim
from pipeline.data.loading.batch import Batch
from pipeline.objectives.base import Objective, ObjectiveOutput
from pipeline.objectives.configs import DistillConfig, SupervisedConfig
from pipeline.objectives.supervised import Supervised, check_pairs

PROJECTION = "distill_projection"


def embedding_term(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """[n]: each text's distance to the teacher, 1 - cosine or the mean squared error over the dims."""
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(student, teacher, dim=-1)
    return (student - teacher).pow(2).mean(-1)


def similarity_kl(student_q: torch.Tensor, student_c: torch.Tensor, teacher_q: torch.Tensor, teacher_c: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """[queries]: KL(teacher || student) of each query's softmax over its cosine similarities to the candidates."""
    def log_probs(q, c):
        return F.log_softmax(F.normalize(q, dim=-1) @ F.normalize(c, dim=-1).T / temperature, dim=-1)

    target = log_probs(teacher_q, teacher_c)
    return (target.exp() * (target - log_probs(student_q, student_c))).sum(-1)


class Distill(Objective):
    name = "distill"
    shard_kind = ShardKind.PAIRS
    predicts_tokens = False

    def __init__(self, config: DistillConfig, document_masking: bool = True):
        super().__init__(config, document_masking)
        self.teacher: TeacherEmbeddings | None = None
        self.slots = Supervised(SupervisedConfig(), document_masking)  # embeds the rows as the supervised stage does

    @property
    def loss_weights(self) -> dict[str, float]:
        c = self.config
        return {n: w for n, w in (("distill_embedding", c.embedding_weight), ("distill_kl", c.kl_weight)) if w > 0}

    def load(self, slots: int) -> TeacherEmbeddings:
        if self.teacher is None:
            self.teacher = load_teacher(self.config.teacher, slots)
        return self.teacher

    def attach(self, model: PreTrainedModel) -> None:
        """A learned projection to the teacher's width, when it differs from the model's (read from its record:
        the heads are attached before any batch)."""
        record = teacher_dim(self.config.teacher)
        d = model.config.hidden_size
        if record == d or "distill_embedding" not in self.loss_weights:
            return
        head = nn.Linear(d, record, bias=False).to(model.dtype)
        model.add_module(PROJECTION, head)
        # the HF export is the encoder itself; HF would load the projection's weights as unexpected keys
        model._keys_to_ignore_on_save = [*(model._keys_to_ignore_on_save or ()),
                                         *(f"{PROJECTION}.{k}" for k in head.state_dict())]

    def num_targets(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One query per real row, for each loss."""
        n = (batch.doc_ids >= 0).any(-1).sum()
        return dict.fromkeys(self.loss_weights, n)

    def body_work(self, batch: Batch) -> torch.Tensor:
        """As the supervised objective's: every slot its own attention segment."""
        return self.slots.body_work(batch)

    def __call__(self, model: PreTrainedModel, batch: Batch) -> dict[str, ObjectiveOutput]:
        check_pairs(batch, self.name)
        slots = batch.pool_spans.shape[1]
        real = [i for i, k in enumerate(batch.keys) if k]
        student = self.slots.embed(model, batch).view(len(batch.keys), slots, -1)[real]
        teacher = torch.from_numpy(self.load(slots).lookup([batch.keys[i] for i in real])).to(student.device)
        zero = torch.zeros((), dtype=torch.int64, device=student.device)
        n = torch.tensor(len(real), device=student.device)
        out = {}
        if "distill_embedding" in self.loss_weights:
            projected = getattr(model, PROJECTION)(student.to(model.dtype)).float() if hasattr(model, PROJECTION) \
                else student
            term = embedding_term(projected, teacher, self.config.embedding_loss).mean(-1)
            out["distill_embedding"] = ObjectiveOutput(term.sum(), n, zero)
        if "distill_kl" in self.loss_weights:
            kl = similarity_kl(student[:, 0], student[:, 1:].flatten(0, 1), teacher[:, 0], teacher[:, 1:].flatten(0, 1),
                               self.config.temperature)
            out["distill_kl"] = ObjectiveOutput(kl.sum(), n, zero)
        return out

