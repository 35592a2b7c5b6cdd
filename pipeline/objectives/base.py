"""What every objective shares: its config's common fields, the facts it declares, its output
(``ObjectiveOutput``), masking settings, and the target-only LM head.

An objective turns a ``Batch`` into ``Targets`` (model input, which positions predict, and what they predict).
The base class then runs the decoder body for hidden states, gathers the predicting positions, and runs the LM
head and cross-entropy on those alone: at 30 % masking and a 128k vocabulary the full head would be most of the
step's cost. Losses are returned as sums with their target counts so the trainer can normalise over all ranks
and micro-batches of an optimizer step.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field, replace
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel

from pipeline.data.format.index import ShardKind
from pipeline.data.format.masking import POLICIES, apply_mask_plan
from pipeline.data.loading.batch import Batch
from pipeline.model.attention import attention_inputs
from pipeline.model.flops import body_work, segment_lengths
from pipeline.model.lm_head import ChunkedLMHead, cross_entropy
from pipeline.model.moe import record, routing
from pipeline.objectives.configs import BaseConfig, MaskedConfig
from pipeline.tokenizer import Tokenizer


class ObjectiveOutput(NamedTuple):
    """One loss of an objective's forward, read by field name. A named tuple because it leaves the engine's forward
    (``TrainModule``) as it is: ZeRO-3's hooks and DeepSpeed's output hooks find tensors inside tuples, lists and
    dicts only, and rebuild a named tuple with its fields (``deepspeed.runtime.zero.utils.apply_to_tensors_only``)."""

    loss_sum: torch.Tensor  # fp32 scalar: sum of cross-entropy over the targets (differentiable)
    num_targets: torch.Tensor  # int64 scalar
    num_correct: torch.Tensor  # int64 scalar: targets whose arg-max prediction is right
    # fp32 / int64 [B]: each batch row's loss sum (detached) and targets, when the batch carries source ids (the
    # trainer logs losses per source); None otherwise and for objectives without token targets
    row_loss: torch.Tensor | None = None
    row_targets: torch.Tensor | None = None


@dataclass
class Targets:
    input_ids: torch.Tensor  # [B, L] what the model reads (masked for MLM/MNTP)
    predict_at: torch.Tensor  # bool [B, L] positions whose hidden state makes a prediction
    labels: torch.Tensor  # [B, L] the token predicted at each such position (meaningless elsewhere)


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


class MaskTokenError(ValueError):
    """A mask token the tokenizer lacks. ``what`` says how ("'<x>' is not a single token of tokenizer T"), for the
    config's message that names its own setting (``phases[i].objectives[j].mask_token``, ``eval.mask_token``)."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


def resolve_mask_id(tokenizer: Tokenizer, mask_token: str | None) -> int:
    """The id of ``mask_token`` (None: the tokenizer's mask token); the one place a mask token is resolved."""
    if mask_token is None:
        if tokenizer.mask_id is None:
            raise MaskTokenError(f"tokenizer {tokenizer.path} has no mask token; set masking.mask_token to an "
                                 "ordinary token such as '_' (LLM2Vec's choice for Llama)",
                                 f"null uses the mask token of, but there is none in tokenizer {tokenizer.path}")
        return tokenizer.mask_id
    vocab = tokenizer.hf.get_vocab()
    if mask_token not in vocab:
        raise MaskTokenError(f"masking.mask_token {mask_token!r} is not a single token of tokenizer "
                             f"{tokenizer.path}; pick a token string exactly as it appears in its vocabulary (e.g. "
                             "'_' for Llama)", f"{mask_token!r} is not a single token of tokenizer {tokenizer.path}")
    return vocab[mask_token]


@dataclass(frozen=True)
class Masking:
    """``MaskingConfig`` resolved once against the tokenizer. The random-replacement pool is copied to each device
    once (``_pools``), not from the host at every micro-step: a blocking host-to-device copy waits for the device."""

    ratio: float
    policy: str
    mask_id: int
    random_pool: torch.Tensor
    _pools: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(cls, config: MaskingConfig, tokenizer: Tokenizer) -> Masking:
        """Random replacements draw from the tokenizer's regular (non-special) ids, as data prep defines them."""
        return cls(config.ratio, config.policy, resolve_mask_id(tokenizer, config.mask_token),
                   torch.from_numpy(tokenizer.regular_ids()).long())

    def apply(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked input ids, bool targets) from the batch's precomputed plan."""
        device = batch.input_ids.device
        if device not in self._pools:
            self._pools[device] = self.random_pool.to(device)
        return apply_mask_plan(batch.input_ids, batch.mask_rank, batch.mask_draw, self.ratio, self.policy,
                               self.mask_id, self._pools[device])


def host_doc_ids(batch: Batch) -> np.ndarray | None:
    """The batch's document ids on the host, or None when the batch has no host copy."""
    host = batch.on_host()
    return None if host is None else host.doc_ids.numpy()


def next_token_targets(input_ids: torch.Tensor, labels_from: torch.Tensor, doc_ids: torch.Tensor,
                       is_target: torch.Tensor) -> Targets:
    """Targets where position i-1 predicts token i of ``labels_from`` (CLM and MNTP).

    Token i is a target only when ``is_target[i]`` and position i-1 lies in the same document: the first token of
    a document (its BOS, or a continued piece's first token) has no predecessor to predict it from.
    """
    predict_at = torch.zeros_like(is_target)
    predict_at[:, :-1] = is_target[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, 1:] >= 0)
    labels = torch.zeros_like(labels_from)
    labels[:, :-1] = labels_from[:, 1:]
    return Targets(input_ids=input_ids, predict_at=predict_at, labels=labels)


def target_loss(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: Targets, rows: bool = False,
                count: int | None = None) -> ObjectiveOutput:
    """LM head and cross-entropy on the predicting positions only (fp32 logits); a ``ChunkedLMHead`` (the trainer's,
    ``model.lm_head_chunk``) computes them a chunk of targets at a time. ``rows``: also each batch row's loss sum
    and target count (on the device: no host sync). ``count``: the number of targets when the host knows it (the
    trainer counts them on the host copy of the batch), so gathering them does not wait for the device; without
    it ``nonzero`` reads the count back (a host sync)."""
    if count is None:
        where = targets.predict_at.nonzero(as_tuple=True)
    else:  # a wrong count would silently drop or repeat targets: checked on the device, without waiting for it
        torch._assert_async(targets.predict_at.sum() == count, "the host's target count differs from the device's")
        where = targets.predict_at.nonzero_static(size=count).unbind(1)
    labels = targets.labels[where]
    if isinstance(lm_head, ChunkedLMHead):
        loss_sum, correct, *per_target = lm_head(hidden[where], labels, per_target=rows)
    else:
        loss_sum, correct, *per_target = cross_entropy(lm_head(hidden[where]).float(), labels, per_target=rows)
    num_targets = targets.predict_at.sum()
    if not rows:
        return ObjectiveOutput(loss_sum, num_targets, correct)
    row_loss = per_target[0].new_zeros(len(targets.predict_at)).index_add_(0, where[0], per_target[0])
    return ObjectiveOutput(loss_sum, num_targets, correct, row_loss, targets.predict_at.sum(-1))


class Objective(ABC):
    """One training objective: an attention mode plus a way to pick inputs and targets from a batch.

    The class declares what callers ask (``masks``, ``predicts_next``, ``causal``, ``needs_tokenizer``,
    ``shard_kind``, ``predicts_tokens``); ``attention_mode`` and ``loss_weights`` follow from the config. The
    trainer's contract, which objectives other than token prediction (contrastive ones) implement directly:
    ``attach`` adds trainable heads before the engine is built, ``num_targets(batch)`` counts targets without the
    model (as tensors on the batch's device), ``body_work(batch)`` counts what the forward's body runs (the MFU),
    and ``__call__(model, batch)`` returns the ``ObjectiveOutput`` of each named loss (``loss_weights``' names;
    ``{name: output}`` for an objective with one loss), ``num_targets`` the count of each.
    """

    name: ClassVar[str]
    causal: ClassVar[bool] = False  # reads left to right only (else its attention mode lets tokens see later ones)
    masks: ClassVar[bool] = False  # reads the batch's masking plan (its config is a ``MaskedConfig``)
    predicts_next: ClassVar[bool] = False  # token i is predicted from the hidden state at position i - 1
    needs_tokenizer: ClassVar[str] = ""  # what it needs the data's Tokenizer for ("": it does not)
    # the packed training shards, sentence-unit shards, or (query, positive, negatives) pairs shards
    shard_kind: ClassVar[ShardKind] = ShardKind.PACKED
    predicts_tokens: ClassVar[bool] = True  # its targets go through the LM head (contrastive ones count queries)

    def __init__(self, config: BaseConfig, document_masking: bool = True):
        self.config = config
        self.document_masking = document_masking

    @classmethod
    def build(cls, config: BaseConfig, tokenizer: Tokenizer | None = None, document_masking: bool = True) -> Objective:
        """The objective of ``config``; one that ``needs_tokenizer`` gets the data's tokenizer (checked here)."""
        if not cls.needs_tokenizer:
            return cls(config, document_masking)
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"objective {cls.name!r} needs the data's pipeline.tokenizer.Tokenizer (load_tokenizer(path)) "
                            f"{cls.needs_tokenizer}, got {type(tokenizer).__name__}")
        return cls.from_tokenizer(config, tokenizer, document_masking)

    @classmethod
    def from_tokenizer(cls, config: BaseConfig, tokenizer: Tokenizer, document_masking: bool) -> Objective:
        return cls(config, tokenizer, document_masking)

    @property
    def attention_mode(self) -> str:
        """The mode of ``pipeline.model.attention`` its forward pass uses."""
        return "causal" if self.causal else "bidirectional"

    @property
    def loss_weights(self) -> dict[str, float]:
        """Its losses by name (the trainer logs ``loss/<name>``), each weighted by this times the config's ``weight``."""
        return {self.name: 1.0}

    def at_phase_step(self, step: int, steps: int) -> None:
        """Take the settings of step ``step`` (from 0) of its phase of ``steps`` steps; the trainer calls it before
        each step. What changes inside a phase (a masking-ratio schedule) depends on this alone, so a resumed run
        draws what the uninterrupted one did. Objectives without a schedule keep their settings."""
        return None

    def attach(self, model: PreTrainedModel) -> None:
        """Register the objective's own trainable modules on ``model`` (called once, before DeepSpeed wraps it).
        Token objectives have none."""
        return None

    def targets(self, batch: Batch) -> Targets:
        """Token objectives define this; objectives that override ``num_targets`` and ``__call__`` (contrastive,
        several losses) need not."""
        raise NotImplementedError(f"objective {self.name!r} has no single token-target set")

    def num_targets(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Targets of each loss in ``batch`` (int64 scalars on its device) without running the model, so the
        trainer can normalise a step before backward; it counts them on the batch's host copy, where reading them
        waits for no device."""
        return {self.name: self.targets(batch).predict_at.sum()}

    def body_work(self, batch: Batch) -> torch.Tensor:
        """(tokens, attended pairs) of the decoder body's passes over ``batch`` (``pipeline.model.flops``), on the
        batch's device, for the step's model FLOPs: one pass, each document its own attention segment."""
        return body_work(segment_lengths(batch.doc_ids, self.document_masking))

    def __call__(self, model: PreTrainedModel, batch: Batch,
                 counts: dict[str, int] | None = None) -> dict[str, ObjectiveOutput]:
        """``counts``: each loss's targets in ``batch`` as the host counted them (``num_targets`` of its host copy),
        so the step waits for the device nowhere (token objectives only)."""
        targets = self.targets(batch)
        hidden = self.hidden_states(model, targets.input_ids, batch.doc_ids, batch.span_ids, host_doc_ids(batch))
        return {self.name: target_loss(model.lm_head, hidden, targets, rows=batch.source_ids is not None,
                                       count=None if counts is None else counts[self.name])}

    def hidden_states(self, model: PreTrainedModel, input_ids: torch.Tensor, doc_ids: torch.Tensor,
                      span_ids: torch.Tensor | None = None, host_doc_ids: np.ndarray | None = None) -> torch.Tensor:
        """The decoder body's last hidden states under this objective's attention mode (no LM head);
        ``host_doc_ids``: ``doc_ids`` on the host (``Batch.on_host``), for the attention's decisions."""
        attention = attention_inputs(self.attention_mode, doc_ids, span_ids, document_masking=self.document_masking,
                                     attn_implementation=model.config._attn_implementation, dtype=model.dtype,
                                     host_doc_ids=host_doc_ids)
        if not routing(model.config):
            return model.model(input_ids=input_ids, **attention).last_hidden_state
        out = model.model(input_ids=input_ids, **attention, output_router_logits=True)  # an MoE model in training
        record(model.config, out.router_logits, doc_ids >= 0)
        return out.last_hidden_state


class MaskedObjective(Objective):
    """An objective that reads the batch's masking plan (MLM, MNTP, MAGNET): its config's masking settings,
    resolved once against the tokenizer (or a ``Masking`` given directly)."""

    masks = True
    needs_tokenizer = "to resolve its mask token and random-replacement ids"

    def __init__(self, config: MaskedConfig, masking: Masking, document_masking: bool = True):
        super().__init__(config, document_masking)
        self.masking = masking

    @classmethod
    def from_tokenizer(cls, config: MaskedConfig, tokenizer: Tokenizer, document_masking: bool) -> Objective:
        masking = MaskingConfig(config.ratio, config.policy, config.mask_token)
        return cls(config, Masking.resolve(masking, tokenizer), document_masking)

    @property
    def masked_losses(self) -> list[str]:
        """Its losses whose targets the masking picks (each logged with ``mask_ratio/<loss>``)."""
        return list(self.loss_weights)

    def at_phase_step(self, step: int, steps: int) -> None:
        self.masking = replace(self.masking, ratio=self.config.ratio_at_step(step, steps))
