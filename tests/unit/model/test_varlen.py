"""Variable-length attention (``model.attn_implementation: varlen``): the segments built from ``doc_ids``, the
dispatch, and the numerics of every decoder family's varlen path against SDPA on the dense mask (hidden states,
loss and gradients). torch has no CPU kernel for ``varlen_attn``, so on CPU torch's own ``varlen_attn`` runs with
reference kernels registered behind its custom ops; the CUDA test runs the real flash kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import loss_and_grads as objective_loss_and_grads
from helpers import packed_text_batch
from shard_corpus import TOKENIZER
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import from_dict
from pipeline.experiment import PhaseSpec
from pipeline.model import varlen
from pipeline.model.attention import VARLEN, attention_inputs, dense_allowed, is_no_mask
from pipeline.model.build import ARCHITECTURES, build_model, model_spec
from pipeline.model.varlen import packed_segments, segment_ids
from pipeline.tokenizer import load_tokenizer
from pipeline.train.phases import build_objectives

VOCAB = 64


def _segments(cu_seqlens):
    bounds = cu_seqlens.tolist()
    return zip(bounds[:-1], bounds[1:], strict=True)


def _probabilities(q, k, causal: bool, scale: float):
    """Softmax attention weights [heads, n, n] of one segment and their log-sum-exp [heads, n]."""
    scores = q @ k.transpose(1, 2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp(), lse


def _heads(t, group: int, a: int, b: int):
    """Segment [a, b) of flattened [T, heads, head_dim] rows as [heads, n, head_dim], K/V heads repeated."""
    return t[a:b].transpose(0, 1).repeat_interleave(group, 0)


def segment_attention(query, key, value, cu_seqlens, causal: bool, scale: float | None):
    """What the flash varlen kernel computes, spelled out: softmax attention within each segment of the flattened
    [T, heads, head_dim] rows, K/V heads shared by groups of query heads. (out [T, heads, head_dim], its log-sum-exp
    [heads, T].)"""
    group, scale = query.shape[1] // key.shape[1], query.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for a, b in _segments(cu_seqlens):
        p, lse = _probabilities(_heads(query, 1, a, b), _heads(key, group, a, b), causal, scale)
        outs.append(p @ _heads(value, group, a, b))
        lses.append(lse)
    return torch.cat(outs, 1).transpose(0, 1).contiguous(), torch.cat(lses, 1)  # contiguous, as flash's


def segment_attention_backward(grad_out, query, key, value, cu_seqlens, causal: bool, scale: float | None):
    """Its gradients (dq, dk, dv) as flash attention's backward forms them from the recomputed weights:
    dS = P * (dO V^T - rowsum(dO * O)); a K/V head's gradient sums over the query heads that share it."""
    heads, kv_heads = query.shape[1], key.shape[1]
    group, scale = heads // kv_heads, query.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = (torch.zeros_like(t) for t in (query, key, value))
    for a, b in _segments(cu_seqlens):
        q, k, v, do = (_heads(t, g, a, b) for t, g in ((query, 1), (key, group), (value, group), (grad_out, 1)))
        p, _ = _probabilities(q, k, causal, scale)
        ds = p * (do @ v.transpose(1, 2) - (do * (p @ v)).sum(-1, keepdim=True))
        dq[a:b] = (ds @ k * scale).transpose(0, 1)
        for grad, full in ((dk, ds.transpose(1, 2) @ q * scale), (dv, p.transpose(1, 2) @ do)):
            grad[a:b] = full.view(kv_heads, group, b - a, -1).sum(1).transpose(0, 1)
    return dq, dk, dv


CALLS: list[dict] = []  # what the kernel was given, while the cpu_kernel fixture is on
CPU_KERNEL = {"on": False}


def _cpu_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
                 enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    if not CPU_KERNEL["on"]:
        raise NotImplementedError("varlen_attn has no CPU kernel (the tests' reference is off)")
    CALLS.append({"cu": cu_seq_q, "max": max_q, "kv_heads": key.shape[1], "enable_gqa": enable_gqa,
                  "causal": is_causal})
    # the bound the flash kernel takes: at least the longest segment (the row length: packed_segments)
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k >= int(cu_seq_q.diff().max())
    out, lse = segment_attention(query, key, value, cu_seq_q, is_causal, scale)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _cpu_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                  scale=None, window_size=None):
    return segment_attention_backward(grad_out, query, key, value, cu_seq_q, is_causal, scale)


# torch's own varlen_attn (its signature, checks and autograd) runs on CPU with these kernels behind its custom ops
torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _cpu_forward)
torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _cpu_backward)


@pytest.fixture
def cpu_kernel():
    """The reference kernels on for one test (CPU only: on CUDA the flash kernels run)."""
    CALLS.clear()
    CPU_KERNEL["on"] = True
    yield CALLS
    CPU_KERNEL["on"] = False


def packed(length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0: documents of 9 and 10 tokens, then 5 of padding; row 1: three documents filling the row."""
    input_ids = torch.randint(4, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 9 + [1] * 10 + [-1] * (length - 19), [0] * 5 + [1] * 9 + [2] * (length - 14)],
                           dtype=torch.int32)
    return input_ids.masked_fill(doc_ids < 0, 0), doc_ids


def test_segments_from_doc_ids():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [0, 1, 1, 1, 1, 2, 2]], dtype=torch.int32)
    docs = packed_segments(doc_ids, document_masking=True)  # row 0: two documents, then its padding
    # the kernel's bound is the row length on every micro-batch (a compiled layer never recompiles for it)
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 7, 8, 12, 14] and docs.max_seqlen == 7
    assert docs.cu_seqlens.dtype == torch.int32
    rows = packed_segments(doc_ids, document_masking=False)  # each row's tokens, padding apart
    assert rows.cu_seqlens.tolist() == [0, 5, 7, 14] and rows.max_seqlen == 7
    from_host = packed_segments(doc_ids.clone().fill_(-7), True, host_doc_ids=doc_ids.numpy())  # the host copy decides
    assert from_host.cu_seqlens.tolist() == docs.cu_seqlens.tolist()
    one_doc = torch.zeros(2, 7, dtype=torch.int32)
    assert packed_segments(one_doc, document_masking=True) is None  # plain attention: no segments
    assert packed_segments(doc_ids[1:], document_masking=False) is None
    padded = one_doc.clone()
    padded[1] = -1  # an all-padding row (SSCL's rows without a unit) is one padding segment
    assert packed_segments(padded, document_masking=True).cu_seqlens.tolist() == [0, 7, 14]


def test_varlen_inputs_per_mode():
    _, doc_ids = packed()
    for mode, causal in (("causal", True), ("bidirectional", False)):
        got = attention_inputs(mode, doc_ids, attn_implementation=VARLEN)
        assert set(got) == {"is_causal", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                            "attention_mask"}
        assert got["is_causal"] is causal and got["cu_seq_lens_q"] is got["cu_seq_lens_k"]
        assert got["cu_seq_lens_q"].tolist() == [0, 9, 19, 24, 29, 38, 48] and got["max_length_q"] == 24
        plain = attention_inputs(mode, torch.zeros_like(doc_ids), attn_implementation=VARLEN)
        assert plain["is_causal"] is causal and is_no_mask(plain["attention_mask"]) and len(plain) == 2
    for mode in ("magnet", "magnet_own_span"):  # segments cannot express MAGNET's masks: FlexAttention's block mask
        assert isinstance(attention_inputs(mode, doc_ids, attn_implementation=VARLEN)["attention_mask"], BlockMask)


def model_pair(model_type: str, heads: int = 4, kv_heads: int = 2) -> dict[str, torch.nn.Module]:
    """The same tiny random model of ``model_type`` under SDPA (eager for Gemma 2, which SDPA cannot softcap)
    and under VARLEN; its padding id inside the tiny vocabulary (a family's default may lie beyond it)."""
    def config():  # one each: from_config sets the implementation on the config it is given
        return AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    head_dim=8, max_position_embeddings=256, pad_token_id=0)  # in VOCAB

    reference = "eager" if model_type == "gemma2" else "sdpa"
    torch.manual_seed(0)
    pair = {impl: AutoModelForCausalLM.from_config(config(), attn_implementation=impl)
            for impl in (reference, VARLEN)}
    assert [m.config._attn_implementation for m in pair.values()] == [reference, VARLEN]
    pair[VARLEN].load_state_dict(pair[reference].state_dict())
    return pair


def loss_and_grads(model, input_ids, doc_ids, mode, document_masking=True):
    """Next-token cross-entropy over real tokens (what CLM trains on; bidirectional modes train a head on the same
    states), its hidden states and every parameter's gradient."""
    model.zero_grad()
    kwargs = attention_inputs(mode, doc_ids, document_masking=document_masking,
                              attn_implementation=model.config._attn_implementation, dtype=model.dtype)
    hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state
    logits = model.lm_head(hidden)[:, :-1]
    keep = (doc_ids[:, :-1] >= 0) & (doc_ids[:, 1:] >= 0)
    loss = F.cross_entropy(logits[keep], input_ids[:, 1:][keep])
    loss.backward()
    return loss.detach(), hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_varlen_equals_dense_sdpa_loss_and_gradients(cpu_kernel, mode, heads):
    """Llama with multi-head, GQA (6 / 2 heads, like the 1b preset's 18 / 6) and multi-query attention: the
    loss, real tokens' states and all gradients equal SDPA's on the dense mask; with and without document masking.
    The kernel gets the un-repeated K/V heads and one ``cu_seqlens`` tensor per forward, shared by the layers."""
    models = model_pair("llama", *heads)
    input_ids, doc_ids = packed()
    real = doc_ids >= 0
    for document_masking in (True, False):
        cpu_kernel.clear()
        loss, hidden, grads = loss_and_grads(models[VARLEN], input_ids, doc_ids, mode, document_masking)
        ref_loss, ref_hidden, ref_grads = loss_and_grads(models["sdpa"], input_ids, doc_ids, mode, document_masking)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(hidden[real], ref_hidden[real], atol=1e-5, rtol=1e-5)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
        assert len(cpu_kernel) == 2 and cpu_kernel[0]["cu"] is cpu_kernel[1]["cu"]  # one per layer, built once
        # torch 2.13 takes enable_gqa; 2.11 has none (flash reads the K/V heads in place without being told)
        gqa = heads[0] != heads[1] and "enable_gqa" in varlen._PARAMETERS
        assert all(c["kv_heads"] == heads[1] and c["enable_gqa"] == gqa and c["causal"] == (mode == "causal")
                   for c in cpu_kernel)


def test_torch_2_10_signature(cpu_kernel, monkeypatch):
    """torch 2.10's varlen_attn takes ``is_causal`` where 2.11 takes ``window_size``: both give the same result."""
    windowed_attn = varlen.varlen_attn
    gqa = {"enable_gqa": True} if "enable_gqa" in varlen._PARAMETERS else {}  # 2.13's; 2.11 has none

    def is_causal_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        return windowed_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=(-1, 0) if is_causal else (-1, -1), **gqa)

    model = model_pair("llama")[VARLEN]
    input_ids, doc_ids = packed()
    windowed = {mode: loss_and_grads(model, input_ids, doc_ids, mode)[0] for mode in ("causal", "bidirectional")}
    monkeypatch.setattr(varlen, "varlen_attn", is_causal_style)
    monkeypatch.setattr(varlen, "_PARAMETERS", frozenset({"is_causal", "scale"}))
    for mode, loss in windowed.items():
        assert torch.equal(loss_and_grads(model, input_ids, doc_ids, mode)[0], loss)
    assert windowed["causal"] != windowed["bidirectional"]


def test_varlen_compiles_once_for_every_segment_count(cpu_kernel):
    """Regionally compiled layers (``model.compile``; aot_eager here: dynamo's graph of torch's varlen custom op
    and its autograd, without inductor's compile time) equal eager on loss and gradients, over micro-batches of 6,
    7 and 8 segments: ``cu_seqlens``' length is marked dynamic and the kernel's bound is the row length, so the
    second and third micro-batches compile nothing."""
    compiled, eager = model_pair("llama")[VARLEN], model_pair("llama")[VARLEN]
    torch._dynamo.reset()
    counters.clear()
    for layer in compiled.model.layers:
        layer.forward = torch.compile(layer.forward, backend="aot_eager")
    input_ids, doc_ids = packed()
    graphs = []
    for split in range(3):  # row 1's last document split into 1, 2, 3 documents
        docs = doc_ids.clone()
        for k in range(split):
            docs[1, 18 + 2 * k:] = 3 + k
        got, ref = loss_and_grads(compiled, input_ids, docs, "causal"), loss_and_grads(eager, input_ids, docs, "causal")
        torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
        for name, grad in ref[2].items():
            torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-5, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert {c["max"] for c in cpu_kernel} == {24}
    assert 0 < graphs[0] == graphs[1] == graphs[2]  # no recompile


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_every_family_takes_varlen(cpu_kernel, family):
    """Each HF family of ``ARCHITECTURES`` passes the segments through its forward to the registered function
    (Gemma 2's softcap runs them as a FlexAttention block mask, against eager): real tokens' states equal the
    dense mask's in both plain modes."""
    models = model_pair(family)
    reference = next(impl for impl in models if impl != VARLEN)
    input_ids, doc_ids = packed()
    real = doc_ids >= 0
    for mode in ("causal", "bidirectional"):
        with torch.no_grad():
            out = {impl: model.model(input_ids=input_ids, **attention_inputs(
                mode, doc_ids, attn_implementation=impl, dtype=model.dtype)).last_hidden_state
                for impl, model in models.items()}
        torch.testing.assert_close(out[VARLEN][real], out[reference][real], atol=1e-5, rtol=1e-5)
    assert bool(cpu_kernel) == (family != "gemma2")


def test_objectives_train_the_same_on_varlen(cpu_kernel):
    """CLM, MLM and MNTP (the objectives varlen serves) on a real packed batch (documents crossing rows, the last
    row padded, real masking plans): each loss sum and every gradient of the tiny preset under VARLEN equal SDPA's."""
    tokenizer = load_tokenizer(TOKENIZER)
    texts = ["The river rises in the hills and flows south to the sea.", "A king, a queen, and a knight."] * 3
    batch = packed_text_batch(tokenizer, texts, seq_len=32, rows=3)
    assert (batch.doc_ids < 0).any() and (batch.doc_ids.amax(-1) > 0).any()  # padding, and packed documents
    models = {}
    for impl in ("sdpa", VARLEN):
        torch.manual_seed(0)
        models[impl] = build_model(model_spec("tiny", tokenizer.info.vocab_size, attn_implementation=impl,
                                   pad_token_id=tokenizer.pad_id))
    phase = from_dict(PhaseSpec, {"objectives": [{"name": "clm"}, {"name": "mlm", "ratio": 0.3},
                                                 {"name": "mntp", "ratio": 0.3}]})
    for weighted in build_objectives(phase, tokenizer):
        cpu_kernel.clear()
        for model in models.values():
            model.zero_grad()
        (loss, targets, grads), (ref_loss, ref_targets, ref_grads) = (
            objective_loss_and_grads(weighted.objective, models[impl], batch) for impl in (VARLEN, "sdpa"))
        assert cpu_kernel and targets == ref_targets > 0, weighted.objective.name
        assert loss == pytest.approx(ref_loss, rel=1e-6), weighted.objective.name
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_varlen_refuses_attention_dropout(cpu_kernel):
    model = model_pair("llama")[VARLEN].train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    input_ids, doc_ids = packed()
    with pytest.raises(ValueError, match="varlen attention has no attention dropout.*attn_implementation: sdpa"):
        model.model(input_ids=input_ids, **attention_inputs("causal", doc_ids, attn_implementation=VARLEN))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch.nn.attention.varlen has flash kernels on CUDA only (NotImplementedError on CPU)")
@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_varlen_kernel_equals_dense_sdpa_on_cuda(mode):
    """The real flash varlen kernel in bf16 (GQA 4 / 2, head_dim 64): loss and gradients within bf16's reach of
    SDPA on the dense mask, real tokens only."""
    models = {impl: m.cuda().to(torch.bfloat16) for impl, m in model_pair("llama").items()}
    input_ids, doc_ids = (t.cuda() for t in packed(length=300))
    real = doc_ids >= 0
    got = loss_and_grads(models[VARLEN], input_ids, doc_ids, mode)
    ref = loss_and_grads(models["sdpa"], input_ids, doc_ids, mode)
    torch.testing.assert_close(got[0], ref[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1][real], ref[1][real], atol=5e-2, rtol=5e-2)
    for name, grad in ref[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=5e-2, rtol=5e-2, msg=name)


def test_segments_are_the_dense_rule_on_real_tokens():
    """Two real tokens share a segment exactly where the dense mask lets them attend (causal: and not later),
    which is what the equality tests above stand on; ``segment_ids`` (Gemma 2's fallback) reads them back."""
    _, doc_ids = packed()
    for document_masking in (True, False):
        segments = packed_segments(doc_ids, document_masking)
        ids = segment_ids(segments.cu_seqlens, *doc_ids.shape)
        real = (doc_ids >= 0)[:, :, None] & (doc_ids >= 0)[:, None, :]
        for mode in ("causal", "bidirectional"):
            same = ids[:, :, None] == ids[:, None, :]
            if mode == "causal":
                same = same & torch.ones(24, 24, dtype=torch.bool).tril()
            assert torch.equal(same & real, dense_allowed(mode, doc_ids, document_masking=document_masking)[:, 0] & real)
