"""MAGNET's language-modelling view (Khosla et al., ACL 2025): one forward pass, two losses.

The input x^m keeps the span tokens in place and MNTP-masks the context tokens (the sample's precomputed plan,
restricted to context). Under the MAGNET mask (context sees all context of its document and never a span; span
tokens see all context and the span tokens at or before them) the same hidden states give

- ``mntp``: each masked context token i predicted from the context position i - 1 (LLM2Vec's shift);
- ``msg`` (missing-span generation): each span token l + 1 predicted from position l, so a span's first token is
  predicted from the context token before it and the rest autoregressively.

Both sets of predicting positions are disjoint (a label is either context or span), so the LM head runs once per
target. Ablations: ``mntp_weight: 0`` reads the unmasked text (masking would only hide context from MSG);
``msg_weight: 0`` ignores the spans, so every token is context and the objective is MNTP under bidirectional
attention (identical to ``mntp`` at the same ratio).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from pipeline.data.format.sample import UNMASKABLE
from pipeline.data.loading.batch import Batch
from pipeline.objectives.base import (
    MaskedObjective,
    ObjectiveOutput,
    Targets,
    host_doc_ids,
    next_token_targets,
    target_loss,
)


@dataclass
class MagnetView:
    input_ids: torch.Tensor  # [B, L] x^m: span tokens in place, context masked by the plan
    span_ids: torch.Tensor  # [B, L] span index, -1 on context (all -1 when MSG is off)
    targets: dict[str, Targets]  # "mntp" and/or "msg", the active losses


def context_ranks(mask_rank: torch.Tensor, in_span: torch.Tensor) -> torch.Tensor:
    """The plan's ranks restricted to context tokens, renumbered 0..n-1 per row (span tokens never masked).

    The plan ranks are a uniformly random permutation of the maskable tokens, so their order among the context
    tokens is one too: masking at ratio p then selects round(p * maskable context tokens), as MNTP does.
    """
    rank = mask_rank.masked_fill(in_span, int(UNMASKABLE))
    dense = rank.argsort(-1).argsort(-1).to(rank.dtype)  # ranks are distinct except the UNMASKABLE ones
    return torch.where(rank == int(UNMASKABLE), rank, dense)

class Magnet(MaskedObjective):
    name = "magnet"
    predicts_next = True

    @property
    def loss_weights(self) -> dict[str, float]:
        c = self.config
        return {n: w for n, w in (("mntp", c.mntp_weight), ("msg", c.msg_weight)) if w > 0}

    @property
    def masked_losses(self) -> list[str]:
        """MNTP's: the MSG targets are the spans, never masked."""
        return [n for n in self.loss_weights if n == "mntp"]

    @property
    def attention_mode(self) -> str:
        """MAGNET's mask; plain bidirectional attention when MSG is off (no spans to hide)."""
        if "msg" not in self.loss_weights:
            return "bidirectional"
        return "magnet_own_span" if self.config.own_span_only else "magnet"

    def view(self, batch: Batch, check: bool = True) -> MagnetView:
        """x^m, the span ids the mask reads, and the targets of each active loss; checks the batch's spans unless
        ``check`` is off (they were checked on the batch's host copy: the check reads values back)."""
        if "msg" in self.loss_weights:
            if check:
                check_spans(batch)
            span_ids = batch.span_ids
        else:
            span_ids = torch.full_like(batch.span_ids, -1)
        in_span = span_ids >= 0
        targets = {}
        if "mntp" in self.loss_weights:
            input_ids, masked = self.masking.apply(replace(batch, mask_rank=context_ranks(batch.mask_rank, in_span)))
            mntp = next_token_targets(input_ids, batch.input_ids, batch.doc_ids, masked)
            mntp.predict_at &= ~in_span  # a span token's state never predicts context: context is the encoder's job
            targets["mntp"] = mntp
        else:
            input_ids = batch.input_ids
        if "msg" in self.loss_weights:
            targets["msg"] = next_token_targets(input_ids, batch.input_ids, batch.doc_ids, in_span)
        return MagnetView(input_ids, span_ids, targets)

    def num_targets(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {name: t.predict_at.sum() for name, t in self.view(batch).targets.items()}

    def __call__(self, model: PreTrainedModel, batch: Batch,
                 counts: dict[str, int] | None = None) -> dict[str, ObjectiveOutput]:
        """``counts`` as the base class's; given, they came from ``num_targets`` of the host copy, which checked
        the spans."""
        view = self.view(batch, check=counts is None)
        hidden = self.hidden_states(model, view.input_ids, batch.doc_ids, view.span_ids, host_doc_ids(batch))
        return {name: target_loss(model.lm_head, hidden, t, rows=batch.source_ids is not None,
                                  count=None if counts is None else counts[name])
                for name, t in view.targets.items()}


def check_spans(batch: Batch) -> None:
    """MSG needs spans, and spans only over document tokens; say which samples are wrong and what to do."""
    over_padding = ((batch.span_ids >= 0) & (batch.doc_ids < 0)).any(-1)
    corrupt, has_spans = torch.stack([over_padding.any(), (batch.span_ids >= 0).any()]).tolist()  # one host sync
    if corrupt:
        keys = [k for k, bad in zip(batch.keys, over_padding.tolist()) if bad]
        raise ValueError(f"samples {keys}: a MAGNET span overlaps padding; the shards are corrupt or were not "
                         "written by data_prep/build_shards.py (check them with data_prep/inspect_shards.py)")
    if not has_spans:
        raise ValueError(f"samples {batch.keys} have no MAGNET spans, so the MSG loss has no target: the shards were "
                         "built with --span-fraction 0, from documents shorter than --span-min + 1 tokens, or are "
                         "sentence-unit shards; rebuild packed shards with --span-fraction > 0 (e.g. 0.15), or turn "
                         "MSG off with msg_weight: 0")
