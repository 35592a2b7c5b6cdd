"""The attention-mask builder: hand-written masks, and what a real tiny Llama sees under each mode."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.attention import RULES, attention_inputs, dense_allowed
from pipeline.model.build import build_model

VOCAB = 64
IMPLEMENTATIONS = ("eager", "sdpa")


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """The same random tiny model under each attention implementation."""
    torch.manual_seed(0)
    built = {impl: build_model("tiny", VOCAB, attn_implementation=impl).eval() for impl in IMPLEMENTATIONS}
    for model in built.values():
        model.load_state_dict(built["eager"].state_dict())
    return built


def hidden(model, input_ids, doc_ids, mode, document_masking=True) -> torch.Tensor:
    kwargs = attention_inputs(mode, doc_ids, document_masking=document_masking,
                              attn_implementation=model.config._attn_implementation, dtype=model.dtype)
    with torch.no_grad():
        return model.model(input_ids=input_ids, **kwargs).last_hidden_state


def packed_batch(length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0: two documents and padding; row 1: three documents filling the row."""
    input_ids = torch.randint(4, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.zeros(2, length, dtype=torch.int32)
    doc_ids[0, 9:] = 1
    doc_ids[0, 19:] = -1
    input_ids[0, 19:] = 0
    doc_ids[1, 5:] = 1
    doc_ids[1, 14:] = 2
    return input_ids, doc_ids


def test_hand_written_masks():
    doc_ids = torch.tensor([[0, 0, 1, 1, -1]])
    causal_docs = [[1, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0],
                   [0, 0, 1, 0, 0],
                   [0, 0, 1, 1, 0],
                   [0, 0, 0, 0, 1]]  # the padding row attends only to itself
    bidirectional_docs = [[1, 1, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [0, 0, 1, 1, 0],
                          [0, 0, 1, 1, 0],
                          [0, 0, 0, 0, 1]]
    bidirectional_packed = [[1, 1, 1, 1, 0],
                            [1, 1, 1, 1, 0],
                            [1, 1, 1, 1, 0],
                            [1, 1, 1, 1, 0],
                            [0, 0, 0, 0, 1]]
    causal_packed = [[1, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0],
                     [1, 1, 1, 0, 0],
                     [1, 1, 1, 1, 0],
                     [0, 0, 0, 0, 1]]
    for mode, document_masking, expected in [("causal", True, causal_docs), ("bidirectional", True, bidirectional_docs),
                                             ("bidirectional", False, bidirectional_packed),
                                             ("causal", False, causal_packed)]:
        got = dense_allowed(mode, doc_ids, document_masking=document_masking)
        assert got.shape == (1, 1, 5, 5) and got.dtype == torch.bool
        assert got[0, 0].int().tolist() == expected, (mode, document_masking)


def test_every_query_keeps_a_key():
    doc_ids = torch.randint(-1, 3, (4, 16), generator=torch.Generator().manual_seed(0)).sort(-1).values
    for mode in RULES:
        for document_masking in (True, False):
            assert dense_allowed(mode, doc_ids, document_masking=document_masking).any(-1).all()


def test_mask_forms_per_implementation():
    _, doc_ids = packed_batch()
    eager = attention_inputs("bidirectional", doc_ids, attn_implementation="eager", dtype=torch.bfloat16)
    sdpa = attention_inputs("bidirectional", doc_ids, attn_implementation="sdpa")
    assert eager["attention_mask"].dtype == torch.bfloat16  # eager adds bool masks as 0/1: must be float
    assert sdpa["attention_mask"].dtype == torch.bool
    assert eager["attention_mask"].shape == sdpa["attention_mask"].shape == (2, 1, 24, 24)  # shared by heads
    assert torch.equal(eager["attention_mask"] == 0, sdpa["attention_mask"])


def test_no_mask_needed_passes_is_causal_explicitly():
    doc_ids = torch.zeros(2, 8, dtype=torch.int32)
    for impl in IMPLEMENTATIONS:
        assert attention_inputs("causal", doc_ids, attn_implementation=impl) == {"is_causal": True}
        assert attention_inputs("bidirectional", doc_ids, attn_implementation=impl) == {"is_causal": False}
    packed = torch.tensor([[0, 0, 1, 1]])
    assert attention_inputs("bidirectional", packed, document_masking=False) == {"is_causal": False}
    assert "attention_mask" in attention_inputs("bidirectional", packed, document_masking=True)


@pytest.mark.parametrize("mode", list(RULES))
@pytest.mark.parametrize("document_masking", [True, False])
def test_eager_and_sdpa_agree(models, mode, document_masking):
    input_ids, doc_ids = packed_batch()
    single = torch.zeros_like(doc_ids)  # no padding, one document: the mask-free path
    for docs in (doc_ids, single):
        out = {impl: hidden(m, input_ids, docs, mode, document_masking) for impl, m in models.items()}
        assert torch.isfinite(out["eager"]).all()
        torch.testing.assert_close(out["eager"], out["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_mask_free_path_equals_dense_mask(models, impl):
    model = models[impl]
    input_ids = torch.randint(4, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.zeros(2, 16, dtype=torch.int32)
    for mode in RULES:
        dense = torch.zeros(2, 1, 16, 16).masked_fill(~dense_allowed(mode, doc_ids), torch.finfo(torch.float32).min)
        with torch.no_grad():
            reference = model.model(input_ids=input_ids, attention_mask=dense).last_hidden_state
        torch.testing.assert_close(hidden(model, input_ids, doc_ids, mode), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("padded", [False, True])
def test_bidirectional_sees_the_future_causal_does_not(models, impl, padded):
    model = models[impl]
    input_ids = torch.randint(4, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.zeros(1, 12, dtype=torch.int32)
    if padded:  # the dense-mask path
        doc_ids[0, -1] = -1
    last = 10 if padded else 11
    changed = input_ids.clone()
    changed[0, last] = (input_ids[0, last] + 1 - 4) % (VOCAB - 4) + 4
    for mode, sees_future in (("bidirectional", True), ("causal", False)):
        delta = (hidden(model, input_ids, doc_ids, mode) - hidden(model, changed, doc_ids, mode))[0, 0].abs().max()
        assert (delta > 1e-4) == sees_future, (mode, float(delta))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_no_silent_causal_fallback(models, impl):
    """HF runs causal attention when it gets no mask and no is_causal=False: bidirectional must differ from that."""
    model = models[impl]
    input_ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hf_default = model.model(input_ids=input_ids).last_hidden_state
    for doc_ids in (torch.zeros(2, 10, dtype=torch.int32), torch.tensor([[0] * 5 + [1] * 5, [0] * 8 + [-1] * 2])):
        causal = hidden(model, input_ids, doc_ids, "causal", document_masking=False)
        bidirectional = hidden(model, input_ids, doc_ids, "bidirectional", document_masking=False)
        if not (doc_ids < 0).any():
            torch.testing.assert_close(causal, hf_default)
        assert (bidirectional[:, :-1] - hf_default[:, :-1]).abs().amax(-1).min() > 1e-4  # every non-last position


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", list(RULES))
def test_document_masking_blocks_other_documents(models, impl, mode):
    model = models[impl]
    input_ids, doc_ids = packed_batch()
    changed = input_ids.clone()
    changed[1, 4] += 1  # a token of document 0 in row 1 (documents: 0-4, 5-13, 14-23)
    masked = hidden(model, changed, doc_ids, mode) - hidden(model, input_ids, doc_ids, mode)
    assert masked[1, 5:].abs().max() == 0  # later documents cannot see it
    assert masked[1, 4].abs().max() > 1e-4
    assert masked[0].abs().max() == 0  # rows are independent
    unmasked = (hidden(model, changed, doc_ids, mode, document_masking=False)
                - hidden(model, input_ids, doc_ids, mode, document_masking=False))
    assert unmasked[1, 5:].abs().amax(-1).min() > 1e-4


def test_padding_rows_stay_finite(models):
    input_ids, doc_ids = packed_batch()
    for model in models.values():
        for mode in RULES:
            assert torch.isfinite(hidden(model, input_ids, doc_ids, mode)).all()


def test_bad_arguments():
    doc_ids = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown attention mode 'sideways'.*causal, bidirectional"):
        attention_inputs("sideways", doc_ids)
    with pytest.raises(ValueError, match="flash_attention_2.*eager, sdpa"):
        attention_inputs("causal", doc_ids, attn_implementation="flash_attention_2")
