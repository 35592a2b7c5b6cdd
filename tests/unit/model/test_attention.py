"""The attention-mask builder: hand-written masks, and what a real tiny Llama sees under each mode and each
attention implementation (eager, SDPA, and FlexAttention's forward, which torch runs on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.model.attention import (
    FLEX,
    RULES,
    VARLEN,
    attention_inputs,
    compiled_flex,
    dense_allowed,
    flex_block_mask,
    flex_kernel_options,
    forward_tiles,
    is_no_mask,
    resolve_implementation,
    skipped_blocks,
)
from pipeline.model.build import build_model, model_spec
from pipeline.model.presets import get_preset

VOCAB = 64
IMPLEMENTATIONS = ("eager", "sdpa")


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """The same random tiny model under each attention implementation."""
    torch.manual_seed(0)
    built = {impl: build_model(model_spec("tiny", VOCAB, attn_implementation=impl)).eval() for impl in IMPLEMENTATIONS}
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
    with pytest.raises(ValueError, match="flash_attention_2.*eager, sdpa, pipeline_flex"):
        attention_inputs("causal", doc_ids, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="model.attn_implementation: 'flash'.*auto, sdpa, eager, flex"):
        resolve_implementation("flash", cuda=True)


# FlexAttention: the BlockMask from the same `allowed` rule, against SDPA on the dense mask. Rows are 300 tokens,
# so with 128-token blocks a row has 3 x 3 blocks and document masking leaves whole blocks out.
FLEX_LEN = 300
LAYOUTS = {  # name: (doc_ids of row 0, doc_ids of row 1) as (start, document) runs; -1 = padding
    "one doc": ([(0, 0)], [(0, 0)]),
    "many docs": ([(0, 0), (40, 1), (170, 2), (260, 3)], [(0, 0), (129, 1), (200, 2)]),
    "doc crossing the row end": ([(0, 0), (280, 1)], [(0, 0), (150, 1)]),  # the last document is cut at the end
    "padding": ([(0, 0), (100, 1), (230, -1)], [(0, 0), (20, -1)]),
}


def layout_batch(layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, doc ids, MAGNET span ids: two spans in each document of 30+ tokens) for a named layout."""
    doc_ids = torch.empty(2, FLEX_LEN, dtype=torch.int32)
    for row, runs in enumerate(LAYOUTS[layout]):
        for i, (start, doc) in enumerate(runs):
            doc_ids[row, start:runs[i + 1][0] if i + 1 < len(runs) else FLEX_LEN] = doc
    span_ids = torch.full_like(doc_ids, -1)
    for row in range(2):
        for doc in doc_ids[row].unique().tolist():
            where = (doc_ids[row] == doc).nonzero().flatten()
            if doc >= 0 and len(where) >= 30:
                start = int(where[0])
                span_ids[row, start + 5:start + 10] = 2 * doc
                span_ids[row, start + 20:start + 28] = 2 * doc + 1
    input_ids = torch.randint(4, VOCAB, (2, FLEX_LEN), generator=torch.Generator().manual_seed(5))
    return input_ids.masked_fill(doc_ids < 0, 0), doc_ids, span_ids


@pytest.fixture(scope="module")
def flex_models() -> dict[tuple[int, int], dict[str, torch.nn.Module]]:
    """(heads, KV heads) -> the same random model under SDPA and under FLEX: multi-head, GQA (also with a head
    count that is not a power of two, like the 1b preset's 18 / 6) and multi-query."""
    built = {}
    for heads, kv_heads in ((4, 4), (4, 2), (6, 2), (4, 1)):
        shape = replace(get_preset("tiny"), hidden_size=16 * heads, num_heads=heads, num_kv_heads=kv_heads)
        torch.manual_seed(0)
        pair = {impl: AutoModelForCausalLM.from_config(shape.to_config(VOCAB), attn_implementation=impl).eval()
                for impl in ("sdpa", FLEX)}
        pair[FLEX].load_state_dict(pair["sdpa"].state_dict())
        built[heads, kv_heads] = pair
    return built


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (4, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", list(RULES))
def test_flex_forward_equals_dense_sdpa(flex_models, mode, layout, heads):
    """The block mask passed straight to the FLEX model (also where the builder would pass is_causal) against the
    dense bool mask under SDPA: the same rule, so the same hidden states."""
    input_ids, doc_ids, span_ids = layout_batch(layout)
    models = flex_models[heads]
    for document_masking in (True, False):
        block = flex_block_mask(mode, doc_ids, span_ids, document_masking)
        dense = dense_allowed(mode, doc_ids, span_ids, document_masking)
        with torch.no_grad():
            flex = models[FLEX].model(input_ids=input_ids, attention_mask=block).last_hidden_state
            sdpa = models["sdpa"].model(input_ids=input_ids, attention_mask=dense).last_hidden_state
        torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", list(RULES))
def test_compiled_flex_kernel_equals_dense_sdpa(mode):
    """The mask_mod traces into the compiled FlexAttention kernel (inductor's CPU kernel here, Triton on CUDA):
    every mode's rule compiles and gives SDPA's output on the dense mask, with GQA and padding (~5 s a mode)."""
    _, doc_ids, span_ids = layout_batch("padding")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, FLEX_LEN, 16, generator=g) for heads in (4, 2, 2))
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=flex_block_mask(mode, doc_ids, span_ids),
                                                       enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_allowed(mode, doc_ids, span_ids),
                                                           enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_compiled_block_mask_build_equals_eager():
    """The compiled block-mask build (CUDA's default; inductor's C++ kernel here) gives the eager build's BlockMask
    for MAGNET's mask, and a new batch of the same shape reuses the compiled graph (its ids are inputs)."""
    torch._dynamo.reset()
    counters.clear()
    for layout in ("many docs", "padding"):
        _, doc_ids, span_ids = layout_batch(layout)
        eager = flex_block_mask("magnet", doc_ids, span_ids, compiled=False)
        compiled = flex_block_mask("magnet", doc_ids, span_ids, compiled=True)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(compiled, name), getattr(eager, name)), (layout, name)
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_flex_does_not_recompile_for_each_batch_width():
    """Batches of new widths (SSCL's padded views) reuse the compiled kernel once its sizes are symbolic: a
    compile per width would reach dynamo's recompile limit and fall back to eager FlexAttention."""
    torch._dynamo.reset()
    counters.clear()

    def run(width: int) -> None:
        g = torch.Generator().manual_seed(width)
        q, k, v = (torch.randn(2, heads, width, 16, generator=g) for heads in (4, 2, 2))
        doc_ids = torch.zeros(2, width, dtype=torch.int32)
        doc_ids[0, width // 2:] = 1
        doc_ids[1, width - 7:] = -1
        out = compiled_flex()(q, k, v, block_mask=flex_block_mask("causal", doc_ids), enable_gqa=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_allowed("causal", doc_ids),
                                                               enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    for width in (130, 200, 260):  # first shapes, then symbolic lengths, then symbolic block counts
        run(width)
    compiled = counters["stats"]["unique_graphs"]
    for width in (300, 390, 520, 700):
        run(width)
    assert counters["stats"]["unique_graphs"] == compiled


def test_flex_block_sparsity_counts_the_blocks_the_rule_rules_out():
    _, doc_ids, span_ids = layout_batch("many docs")
    for mode in RULES:
        block = flex_block_mask(mode, doc_ids, span_ids)
        dense = dense_allowed(mode, doc_ids, span_ids)[:, :, :, :, None]  # [B, 1, L, L, 1]
        padded = torch.nn.functional.pad(dense, (0, 0, 0, 84, 0, 84))  # 300 -> 3 blocks of 128
        blocks = padded.view(2, 1, 3, 128, 3, 128).any(5).any(3)  # [B, 1, q block, k block]: any allowed pair
        assert skipped_blocks(block) == pytest.approx(1 - blocks.float().mean().item())
        assert skipped_blocks(block) > 0, mode  # four documents in 300 tokens: blocks are skipped in every mode


def test_flex_attention_inputs():
    _, doc_ids, span_ids = layout_batch("many docs")
    kwargs = attention_inputs("magnet", doc_ids, span_ids, attn_implementation=FLEX)
    assert isinstance(kwargs["attention_mask"], BlockMask) and kwargs["attention_mask"].shape == (2, 1, 300, 300)
    single = torch.zeros(2, 16, dtype=torch.int32)  # no mask needed: SDPA's flash path, not a dense block mask
    for mode, causal in (("causal", True), ("bidirectional", False)):
        plain = attention_inputs(mode, single, attn_implementation=FLEX)  # an empty 4D mask: transformers' mask
        assert plain["is_causal"] is causal and is_no_mask(plain["attention_mask"])  # code reads nothing back


def test_the_host_copy_decides_the_mask():
    """With the host's copy of the ids, the plain-or-masked decision is made on it (the device's ids are not read:
    here they say the opposite)."""
    one_doc = torch.zeros(2, 16, dtype=torch.int32)
    padded = one_doc.clone()
    padded[:, 12:] = -1
    assert "attention_mask" not in attention_inputs("causal", padded, host_doc_ids=one_doc.numpy())
    assert attention_inputs("causal", one_doc, host_doc_ids=padded.numpy())["attention_mask"].shape == (2, 1, 16, 16)


def test_resolve_implementation():
    assert resolve_implementation("auto", cuda=True) == VARLEN  # FlexAttention's block masks for MAGNET
    assert resolve_implementation("auto", cuda=False) == "sdpa"  # torch 2.13 has no FlexAttention backward on CPU
    assert resolve_implementation("flex", cuda=False) == FLEX
    assert resolve_implementation("varlen", cuda=True) == VARLEN
    assert [resolve_implementation(s, cuda=True) for s in ("sdpa", "eager")] == ["sdpa", "eager"]


def test_fp32_on_cuda_never_resolves_to_varlen():
    """The flash varlen kernel takes bf16 / fp16 only: auto picks FlexAttention for an fp32 model on CUDA, and an
    explicit varlen there is refused with the fix."""
    assert resolve_implementation("auto", cuda=True, dtype=torch.float32) == FLEX
    assert resolve_implementation("auto", cuda=True, dtype=torch.float16) == VARLEN
    with pytest.raises(ValueError, match="varlen runs flash attention, which takes bf16 or fp16, but the model is "
                                         "float32; set model.dtype: bf16"):
        resolve_implementation("varlen", cuda=True, dtype=torch.float32)


def test_flex_tiles_only_for_queries_of_a_whole_tile():
    """The sm90 forward tiles are passed only for queries of at least BLOCK_M rows: shorter ones run torch's
    flex-decoding kernel, which sizes its bounds from its own block, not the override."""
    assert forward_tiles(96, 2048, torch.bfloat16) == {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3,
                                                       "fwd_num_warps": 8}
    assert forward_tiles(96, 128, torch.bfloat16) is not None
    assert forward_tiles(96, 64, torch.bfloat16) is None and forward_tiles(64, 127, torch.float16) is None
    assert forward_tiles(96, 2048, torch.float32) is None and forward_tiles(80, 2048, torch.bfloat16) is None


def test_flex_model_without_block_mask_is_sdpa(flex_models):
    """A FLEX model takes HF's SDPA path for everything that is not a block mask (no mask, 2D padding masks)."""
    models = flex_models[4, 2]
    input_ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, 7:] = 0
    with torch.no_grad():
        for kwargs in ({}, {"is_causal": False}, {"attention_mask": padding}):
            flex = models[FLEX].model(input_ids=input_ids, **kwargs).last_hidden_state
            sdpa = models["sdpa"].model(input_ids=input_ids, **kwargs).last_hidden_state
            assert torch.equal(flex, sdpa), kwargs


@pytest.fixture(scope="module")
def gemma2_models() -> dict[str, torch.nn.Module]:
    """A tiny random Gemma 2 under eager (HF's reference for the softcap) and under FLEX, with weights large
    enough (init std 0.5, softcap 1) that the softcap changes the hidden states."""
    torch.manual_seed(0)
    built = {impl: AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attn_logit_softcapping=1.0,
        initializer_range=0.5), attn_implementation=impl).eval() for impl in ("eager", FLEX)}
    built[FLEX].load_state_dict(built["eager"].state_dict())
    return built


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
@pytest.mark.parametrize("needs_mask", [True, False], ids=["block mask", "no mask"])
def test_flex_applies_gemma2_softcap(gemma2_models, mode, needs_mask):
    """FLEX equals eager on Gemma 2 both where the builder passes a block mask (packed documents, padding) and
    where it passes only ``is_causal`` (which HF's SDPA refuses for a softcapped model)."""
    input_ids, doc_ids = packed_batch()
    docs = doc_ids if needs_mask else torch.zeros_like(doc_ids)
    out = {impl: hidden(model, input_ids, docs, mode) for impl, model in gemma2_models.items()}
    eager_attention = [layer.self_attn for layer in gemma2_models["eager"].model.layers]
    for attention in eager_attention:
        attention.attn_logit_softcapping = None
    uncapped = hidden(gemma2_models["eager"], input_ids, docs, mode)
    for attention in eager_attention:
        attention.attn_logit_softcapping = 1.0
    assert (uncapped - out["eager"]).abs().max() > 0.1  # the softcap matters on these weights
    torch.testing.assert_close(out[FLEX], out["eager"], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch 2.13 has no FlexAttention backward on CPU (NotImplementedError); needs CUDA")
@pytest.mark.parametrize("mode", list(RULES))
def test_flex_backward_equals_dense_sdpa_on_cuda(mode):
    """Gradients of every parameter through the compiled FlexAttention kernel equal SDPA's on the dense mask."""
    input_ids, doc_ids, span_ids = (t.cuda() for t in layout_batch("many docs"))
    shape = replace(get_preset("tiny"), num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    models = {impl: AutoModelForCausalLM.from_config(shape.to_config(VOCAB), attn_implementation=impl).cuda()
              for impl in ("sdpa", FLEX)}
    models[FLEX].load_state_dict(models["sdpa"].state_dict())
    masks = {"sdpa": dense_allowed(mode, doc_ids, span_ids), FLEX: flex_block_mask(mode, doc_ids, span_ids)}
    grads = {}
    for impl, model in models.items():
        model.model(input_ids=input_ids, attention_mask=masks[impl]).last_hidden_state.square().mean().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[FLEX].keys() == grads["sdpa"].keys() and grads["sdpa"]
    for name, grad in grads["sdpa"].items():
        torch.testing.assert_close(grads[FLEX][name], grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="FlexAttention's kernel_options apply to its Triton kernels on CUDA only")
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_flex_kernel_options_keep_the_result_on_cuda(head_dim):
    """The forward tiles of ``flex_kernel_options`` (on sm90 in bf16; None elsewhere) give SDPA's output and
    gradients on the dense mask, at each head_dim they are set for (96: the 1b preset's)."""
    _, doc_ids, span_ids = (t.cuda() for t in layout_batch("many docs"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, FLEX_LEN, head_dim, generator=g, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for heads in (6, 2, 2))
    assert (flex_kernel_options(q) is not None) == (torch.cuda.get_device_capability() == (9, 0))
    block, dense = flex_block_mask("magnet", doc_ids, span_ids), dense_allowed("magnet", doc_ids, span_ids)
    out = compiled_flex()(q, k, v, block_mask=block, enable_gqa=True, kernel_options=flex_kernel_options(q))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    got_grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
