"""MAGNET's attention mode and its MNTP + MSG objective: hand-written masks, leaks on a real tiny Llama, and each
loss against a direct reference on real packed text from the sample corpus."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import packed_text_batch
from shard_corpus import documents

from pipeline.config import from_dict
from pipeline.data.format.sample import UNMASKABLE
from pipeline.model.attention import attention_inputs, dense_allowed
from pipeline.model.build import build_model, model_spec
from pipeline.objectives import CLM, CLMConfig, Magnet, MagnetConfig, MNTPConfig, make_objective
from pipeline.objectives.magnet import context_ranks

IMPLEMENTATIONS = ("eager", "sdpa")
# positions 0..7: C S0 S0 C S1 | C S2 | pad  (documents 0 and 1, then padding)
DOC = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1]], dtype=torch.int32)
SPAN = torch.tensor([[-1, 0, 0, -1, 1, -1, 2, -1]], dtype=torch.int32)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return documents(max_chars=400)[:12]


@pytest.fixture(scope="module")
def models(tokenizer) -> dict[str, torch.nn.Module]:
    """The same random tiny Llama under each attention implementation."""
    built = {}
    for impl in IMPLEMENTATIONS:
        torch.manual_seed(0)
        built[impl] = build_model(model_spec("tiny", tokenizer.info.vocab_size, attn_implementation=impl,
                                  pad_token_id=tokenizer.pad_id)).eval()
    return built


def magnet(tokenizer, ratio: float = 0.2, **fields) -> Magnet:
    return make_objective(MagnetConfig(ratio=ratio, **fields), tokenizer)


def hidden(model, input_ids, doc_ids, span_ids, mode="magnet") -> torch.Tensor:
    kwargs = attention_inputs(mode, doc_ids, span_ids, attn_implementation=model.config._attn_implementation,
                              dtype=model.dtype)
    with torch.no_grad():
        return model.model(input_ids=input_ids, **kwargs).last_hidden_state


def test_hand_written_magnet_masks():
    docs = [[1, 0, 0, 1, 0, 0, 0, 0],  # C sees the context of its document, never a span
            [1, 1, 0, 1, 0, 0, 0, 0],  # S0 sees context and span tokens up to itself
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],  # S1 sees the earlier span S0 too (causal across spans)
            [0, 0, 0, 0, 0, 1, 0, 0],  # document 1's context sees only itself
            [0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 0, 1]]  # padding attends only to itself
    own_span = [row[:] for row in docs]
    own_span[4] = [1, 0, 0, 1, 1, 0, 0, 0]  # S1 no longer sees S0
    packed = [[1, 0, 0, 1, 0, 1, 0, 0],  # without document masking context sees every document's context
              [1, 1, 0, 1, 0, 1, 0, 0],
              [1, 1, 1, 1, 0, 1, 0, 0],
              [1, 0, 0, 1, 0, 1, 0, 0],
              [1, 1, 1, 1, 1, 1, 0, 0],
              [1, 0, 0, 1, 0, 1, 0, 0],
              [1, 1, 1, 1, 1, 1, 1, 0],
              [0, 0, 0, 0, 0, 0, 0, 1]]
    for mode, document_masking, expected in [("magnet", True, docs), ("magnet_own_span", True, own_span),
                                             ("magnet", False, packed)]:
        got = dense_allowed(mode, DOC, SPAN, document_masking=document_masking)
        assert got.shape == (1, 1, 8, 8) and got[0, 0].int().tolist() == expected, (mode, document_masking)


def test_without_spans_magnet_is_bidirectional_and_all_spans_is_causal():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]], dtype=torch.int32)
    bidirectional = dense_allowed("bidirectional", doc)
    assert torch.equal(dense_allowed("magnet", doc, torch.full_like(doc, -1)), bidirectional)
    assert torch.equal(dense_allowed("magnet", doc), bidirectional)  # no span ids: every token is context
    all_span = torch.where(doc >= 0, doc, -1)
    assert torch.equal(dense_allowed("magnet", doc, all_span), dense_allowed("causal", doc))


@pytest.mark.parametrize("mode", ["magnet", "magnet_own_span"])
def test_eager_and_sdpa_agree(models, tokenizer, texts, mode):
    batch = packed_text_batch(tokenizer, texts)
    assert (batch.doc_ids < 0).any() and (batch.span_ids >= 0).any()
    out = {impl: hidden(m, batch.input_ids, batch.doc_ids, batch.span_ids, mode) for impl, m in models.items()}
    assert torch.isfinite(out["eager"]).all()
    torch.testing.assert_close(out["eager"], out["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_span_tokens_never_leak(models, tokenizer, texts, impl):
    model = models[impl]
    batch = packed_text_batch(tokenizer, texts)

    def first_span(r: int) -> int:
        return int((batch.span_ids[r] >= 0).nonzero()[0])

    # the row with the most span tokens among those where another document shares the first span's row
    row = max((r for r in range(len(batch.span_ids)) if (batch.span_ids[r] >= 0).any()
               and (batch.doc_ids[r] != batch.doc_ids[r, first_span(r)]).any()),
              key=lambda r: int((batch.span_ids[r] >= 0).sum()))
    spans, doc, first = batch.span_ids[row], batch.doc_ids[row], first_span(row)
    # the changed span's document: later span tokens of that document see the change, nothing else does
    doc_k = doc[first]
    later_spans = (spans >= 0) & (doc == doc_k) & (torch.arange(len(spans)) >= first)
    base = hidden(model, batch.input_ids, batch.doc_ids, batch.span_ids)
    changed = batch.input_ids.clone()
    changed[row, first] = (changed[row, first] + 1 - 5) % (tokenizer.info.vocab_size - 5) + 5
    delta = (hidden(model, changed, batch.doc_ids, batch.span_ids) - base).abs().amax(-1)
    assert delta[row][~later_spans].max() == 0  # every context token and every earlier span token
    assert delta[row][later_spans].min() > 1e-4  # the changed token and the span tokens after it
    assert delta[torch.arange(len(delta)) != row].max() == 0
    # a context token of that document changes its span tokens and its context
    context = int(((spans < 0) & (doc == doc_k)).nonzero()[0])
    changed = batch.input_ids.clone()
    changed[row, context] = (changed[row, context] + 1 - 5) % (tokenizer.info.vocab_size - 5) + 5
    delta = (hidden(model, changed, batch.doc_ids, batch.span_ids) - base).abs().amax(-1)[row]
    assert delta[(doc == doc_k) & (spans >= 0)].min() > 1e-4
    assert delta[(doc == doc_k) & (spans < 0)].min() > 1e-4
    assert delta[doc != doc_k].max() == 0  # document masking


def reference_allowed(doc: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """The MAGNET mask written out pair by pair from its definition (independent of the builder)."""
    B, L = doc.shape
    ok = torch.zeros(B, 1, L, L, dtype=torch.bool)
    for b in range(B):
        for q in range(L):
            for k in range(L):
                same_doc = doc[b, q] >= 0 and doc[b, q] == doc[b, k]
                q_span, k_span = span[b, q] >= 0, span[b, k] >= 0
                rule = (not k_span) or (q_span and k <= q)
                ok[b, 0, q, k] = (same_doc and rule) or q == k
    return ok


def reference_losses(model, tokenizer, batch, ratio: float) -> dict[str, tuple[float, int]]:
    """MNTP and MSG by hand: pick the masked context tokens from the plan, run the full LM head under the
    reference mask, and sum cross-entropy at the positions before each target."""
    ids, doc, span = batch.input_ids, batch.doc_ids, batch.span_ids
    masked_input = ids.clone()
    is_masked = torch.zeros_like(ids, dtype=torch.bool)
    pool = torch.from_numpy(tokenizer.regular_ids()).long()
    for b in range(len(ids)):
        context = [i for i in range(ids.shape[1]) if span[b, i] < 0 and batch.mask_rank[b, i] != UNMASKABLE]
        k = int(ratio * len(context) + 0.5)
        for i in sorted(context, key=lambda i: int(batch.mask_rank[b, i]))[:k]:
            is_masked[b, i] = True
            draw = int(batch.mask_draw[b, i])
            if draw % 10 < 8:
                masked_input[b, i] = tokenizer.mask_id
            elif draw % 10 == 8:
                masked_input[b, i] = pool[(draw // 10) % len(pool)]
    mask = torch.zeros(reference_allowed(doc, span).shape).masked_fill(~reference_allowed(doc, span), float("-inf"))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=masked_input, attention_mask=mask).logits.double(), -1)
    out = {"mntp": [0.0, 0], "msg": [0.0, 0]}
    for b in range(len(ids)):
        for i in range(1, ids.shape[1]):
            if doc[b, i] < 0 or doc[b, i - 1] != doc[b, i]:
                continue
            if span[b, i] >= 0:
                name = "msg"
            elif is_masked[b, i] and span[b, i - 1] < 0:
                name = "mntp"
            else:
                continue
            out[name][0] -= logp[b, i - 1, ids[b, i]].item()
            out[name][1] += 1
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("seed", [0, 1])
def test_losses_equal_reference(models, tokenizer, texts, seed):
    model = models["eager"]
    batch = packed_text_batch(tokenizer, texts, seed=seed)
    objective = magnet(tokenizer, 0.2)
    out = objective(model, batch)
    ref = reference_losses(model, tokenizer, batch, 0.2)
    assert set(out) == {"mntp", "msg"} and objective.num_targets(batch) == {k: v[1] for k, v in ref.items()}
    for name, (loss, count) in ref.items():
        assert int(out[name].num_targets) == count > 0
        assert out[name].loss_sum.item() == pytest.approx(loss, rel=1e-5)


def test_masking_touches_only_context(tokenizer, texts):
    batch = packed_text_batch(tokenizer, texts)
    objective = magnet(tokenizer, 0.5)
    view = objective.view(batch)
    changed = view.input_ids != batch.input_ids
    in_span = batch.span_ids >= 0
    assert not changed[in_span].any() and changed.any()
    context = ((batch.mask_rank != int(UNMASKABLE)) & ~in_span).sum(-1)
    selected = objective.masking.apply(replace(batch, mask_rank=context_ranks(batch.mask_rank, in_span)))[1]
    assert selected.sum(-1).tolist() == torch.floor(0.5 * context.double() + 0.5).long().tolist()
    assert not selected[in_span].any()


def test_all_span_msg_equals_clm(models, tokenizer, texts):
    """With every document token in a span (no context) MAGNET's mask is causal and MSG is plain CLM."""
    batch = packed_text_batch(tokenizer, texts)
    batch = replace(batch, span_ids=batch.doc_ids.clone())  # one span per document piece, none on padding
    for model in models.values():
        out = magnet(tokenizer)(model, batch)
        clm = CLM(CLMConfig())(model, batch)["clm"]
        assert int(out["mntp"].num_targets) == 0
        assert int(out["msg"].num_targets) == int(clm.num_targets) > 0
        torch.testing.assert_close(out["msg"].loss_sum, clm.loss_sum)


def test_without_msg_it_is_mntp(models, tokenizer, texts):
    batch = packed_text_batch(tokenizer, texts, seed=2)
    objective = magnet(tokenizer, 0.2, msg_weight=0.0)
    assert objective.loss_weights == {"mntp": 1.0} and objective.attention_mode == "bidirectional"
    out = objective(models["sdpa"], batch)
    mntp = make_objective(MNTPConfig(ratio=0.2), tokenizer)(models["sdpa"], batch)["mntp"]
    assert set(out) == {"mntp"} and int(out["mntp"].num_targets) == int(mntp.num_targets)
    torch.testing.assert_close(out["mntp"].loss_sum, mntp.loss_sum)


def test_without_mntp_reads_unmasked_text(models, tokenizer, texts):
    batch = packed_text_batch(tokenizer, texts)
    objective = magnet(tokenizer, mntp_weight=0.0, msg_weight=2.0)
    assert objective.loss_weights == {"msg": 2.0}
    assert torch.equal(objective.view(batch).input_ids, batch.input_ids)
    assert set(objective(models["sdpa"], batch)) == {"msg"}


def test_own_span_only_option(tokenizer, texts):
    assert magnet(tokenizer, own_span_only=True).attention_mode == "magnet_own_span"
    assert magnet(tokenizer).attention_mode == "magnet"


def test_bad_input_is_named(tokenizer, texts):
    batch = packed_text_batch(tokenizer, texts)
    objective = magnet(tokenizer)
    no_spans = replace(batch, span_ids=torch.full_like(batch.span_ids, -1))
    with pytest.raises(ValueError, match=r"have no MAGNET spans.*--span-fraction > 0.*msg_weight: 0"):
        objective.num_targets(no_spans)
    assert magnet(tokenizer, msg_weight=0.0).num_targets(no_spans)["mntp"] > 0
    padded_row = int((batch.doc_ids < 0).any(-1).nonzero()[0])
    bad = batch.span_ids.clone()
    bad[padded_row, -1] = 7
    with pytest.raises(ValueError, match=rf"\['{batch.keys[padded_row]}'\]: a MAGNET span overlaps padding"):
        objective.num_targets(replace(batch, span_ids=bad))
    with pytest.raises(ValueError, match="mntp_weight and msg_weight must be >= 0 and not both 0"):
        from_dict(MagnetConfig, {"mntp_weight": 0.0, "msg_weight": 0.0})


def test_gradients_reach_every_weight_and_stay_finite(tokenizer, texts):
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", tokenizer.info.vocab_size, pad_token_id=tokenizer.pad_id))
    out = magnet(tokenizer)(model, packed_text_batch(tokenizer, texts))
    (out["mntp"].loss_sum + out["msg"].loss_sum).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.lm_head.weight.grad.abs().sum() > 0 and model.model.embed_tokens.weight.grad.abs().sum() > 0
