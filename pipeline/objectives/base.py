"""What every objective shares: the output triple, masking settings, and the target-only LM head.

An objective turns a ``Batch`` into ``Targets`` (model input, which positions predict, and what they predict).
The base class then runs the decoder body for hidden states, gathers the predicting positions, and runs the LM
head and cross-entropy on those alone: at 30 % masking and a 128k vocabulary the full head would be most of the
step's cost. Losses are returned as sums with their target counts so the trainer can normalise over all ranks
and micro-batches of an optimizer step.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedModel

from pipeline.data.batch import Batch
from pipeline.data.masking import POLICIES, apply_mask_plan
from pipeline.model.attention import attention_inputs
from pipeline.model.lm_head import ChunkedLMHead, cross_entropy
from pipeline.tokenizer import Tokenizer


@dataclass
class ObjectiveOutput:
    loss_sum: torch.Tensor  # fp32 scalar: sum of cross-entropy over the targets (differentiable)
    num_targets: torch.Tensor  # int64 scalar
    num_correct: torch.Tensor  # int64 scalar: targets whose arg-max prediction is right


@dataclass
class Targets:
    input_ids: torch.Tensor  # [B, L] what the model reads (masked for MLM/MNTP)
    source: torch.Tensor  # bool [B, L] positions whose hidden state makes a prediction
    labels: torch.Tensor  # [B, L] the token predicted at each source position (meaningless elsewhere)


@dataclass(frozen=True)
class MaskingConfig:
    """Masking settings of MLM/MNTP. ``mask_token=None`` uses the tokenizer's mask token; otherwise it names an
    ordinary vocabulary token, e.g. "_" (LLM2Vec's choice for Llama, whose tokenizer has no mask token)."""

    ratio: float = 0.3
    policy: str = "80-10-10"
    mask_token: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"masking.policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"masking.ratio: {self.ratio} is outside (0, 1]")


def resolve_mask_id(tokenizer: Tokenizer, mask_token: str | None) -> int:
    if mask_token is None:
        if tokenizer.mask_id is None:
            raise ValueError(f"tokenizer {tokenizer.path} has no mask token; set masking.mask_token to an ordinary "
                             "token such as '_' (LLM2Vec's choice for Llama)")
        return tokenizer.mask_id
    vocab = tokenizer.hf.get_vocab()
    if mask_token not in vocab:
        raise ValueError(f"masking.mask_token {mask_token!r} is not a single token of tokenizer {tokenizer.path}; "
                         "pick a token string exactly as it appears in its vocabulary (e.g. '_' for Llama)")
    return vocab[mask_token]


@dataclass(frozen=True)
class Masking:
    """``MaskingConfig`` resolved once against the tokenizer."""

    ratio: float
    policy: str
    mask_id: int
    random_pool: torch.Tensor

    @classmethod
    def resolve(cls, config: MaskingConfig, tokenizer: Tokenizer) -> Masking:
        """Random replacements draw from the tokenizer's regular (non-special) ids, as data prep defines them."""
        return cls(config.ratio, config.policy, resolve_mask_id(tokenizer, config.mask_token),
                   torch.from_numpy(tokenizer.regular_ids()).long())

    def apply(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked input ids, bool targets) from the batch's precomputed plan."""
        return apply_mask_plan(batch.input_ids, batch.mask_rank, batch.mask_draw, self.ratio, self.policy,
                               self.mask_id, self.random_pool)


def next_token_targets(input_ids: torch.Tensor, labels_from: torch.Tensor, doc_ids: torch.Tensor,
                       is_target: torch.Tensor) -> Targets:
    """Targets where position i-1 predicts token i of ``labels_from`` (CLM and MNTP).

    Token i is a target only when ``is_target[i]`` and position i-1 lies in the same document: the first token of
    a document (its BOS, or a continued piece's first token) has no predecessor to predict it from.
    """
    source = torch.zeros_like(is_target)
    source[:, :-1] = is_target[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, 1:] >= 0)
    labels = torch.zeros_like(labels_from)
    labels[:, :-1] = labels_from[:, 1:]
    return Targets(input_ids=input_ids, source=source, labels=labels)


def target_loss(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: Targets) -> ObjectiveOutput:
    """LM head and cross-entropy on the source positions only (fp32 logits); a ``ChunkedLMHead`` (the trainer's,
    ``model.lm_head_chunk``) computes them a chunk of targets at a time."""
    labels = targets.labels[targets.source]
    if isinstance(lm_head, ChunkedLMHead):
        loss_sum, correct = lm_head(hidden[targets.source], labels)
    else:
        loss_sum, correct = cross_entropy(lm_head(hidden[targets.source]).float(), labels)
    return ObjectiveOutput(loss_sum=loss_sum, num_targets=targets.source.sum(), num_correct=correct)


class Objective(ABC):
    """One training objective: an attention mode plus a way to pick inputs and targets from a batch.

    The trainer's contract, which objectives other than token prediction (contrastive ones) implement directly:
    ``source`` names the shards it reads, ``attach`` adds trainable heads before the engine is built,
    ``num_targets(batch)`` counts targets without the model, and ``__call__(model, batch)`` returns an
    ``ObjectiveOutput`` -- or, for an objective that computes several losses from one forward pass, a dict of
    them by name, with ``num_targets`` returning a dict of the same names.
    """

    name: ClassVar[str]
    attention_mode: ClassVar[str]
    source: ClassVar[str] = "packed"  # "packed": the packed training shards; "units": sentence-unit shards

    def __init__(self, document_masking: bool = True):
        self.document_masking = document_masking

    def attach(self, model: PreTrainedModel) -> None:
        """Register the objective's own trainable modules on ``model`` (called once, before DeepSpeed wraps it).
        Token objectives have none."""
        return None

    def targets(self, batch: Batch) -> Targets:
        """Token objectives define this; objectives that override ``num_targets`` and ``__call__`` (contrastive,
        several losses) need not."""
        raise NotImplementedError(f"objective {self.name!r} has no single token-target set")

    def num_targets(self, batch: Batch) -> int:
        """Targets in ``batch`` without running the model, so the trainer can normalise a step before backward."""
        return int(self.targets(batch).source.sum())

    def __call__(self, model: PreTrainedModel, batch: Batch) -> ObjectiveOutput:
        targets = self.targets(batch)
        attention = attention_inputs(self.attention_mode, batch.doc_ids, batch.span_ids,
                                     document_masking=self.document_masking,
                                     attn_implementation=model.config._attn_implementation, dtype=model.dtype)
        hidden = model.model(input_ids=targets.input_ids, **attention).last_hidden_state
        return target_loss(model.lm_head, hidden, targets)


class MaskedObjective(Objective):
    """An objective that reads the batch's masking plan (MLM, MNTP)."""

    def __init__(self, masking: Masking, document_masking: bool = True):
        super().__init__(document_masking)
        self.masking = masking
