"""The chunked LM head loss against the unchunked one: same loss, gradients and correct counts, any chunk size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.data.loading.batch import Batch
from pipeline.model.build import build_model, model_spec
from pipeline.model.lm_head import ChunkedLMHead, chunk_lm_head, linear_cross_entropy
from pipeline.objectives import CLM, CLMConfig
from pipeline.objectives.base import next_token_targets

N, HIDDEN, VOCAB = 70, 24, 301


def problem(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, HIDDEN, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (N,), generator=g)
    labels[:10] = (hidden[:10].float() @ weight.float().T).argmax(-1)  # some right answers to count
    return hidden, weight, labels


def reference(hidden, weight, labels):
    logits = (hidden @ weight.T).float()
    loss = F.cross_entropy(logits, labels, reduction="sum")
    correct = (logits.argmax(-1) == labels).sum()
    return loss, correct


@pytest.mark.parametrize("chunk", [1, 7, 32, N - 1, N, 4 * N])  # N and more: one chunk, logits kept
def test_loss_gradients_and_counts_equal_the_unchunked_head(chunk):
    hidden, weight, labels = problem()
    ref_loss, ref_correct = reference(hidden, weight, labels)
    ref_grads = torch.autograd.grad(2.5 * ref_loss, (hidden, weight))  # a scaled loss, as the trainer's
    loss, correct = linear_cross_entropy(hidden, weight, labels, chunk)
    grads = torch.autograd.grad(2.5 * loss, (hidden, weight))
    assert loss.dtype == torch.float32 and int(correct) == int(ref_correct) >= 10
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bf16_accumulates_in_fp32():
    """In bf16 the chunked head's loss and weight gradient are at least as close to the fp32 result as the
    unchunked bf16 head's (its logits, softmax and gradient accumulation are fp32)."""
    hidden, weight, labels = problem(torch.bfloat16)
    exact_loss, _ = reference(hidden.detach().float().requires_grad_(), weight.detach().float(), labels)
    exact_w = weight.detach().float().requires_grad_()
    exact_grad = torch.autograd.grad(reference(hidden.detach().float(), exact_w, labels)[0], exact_w)[0]
    errors = {}
    for name, fn in (("unchunked", reference), ("chunked", lambda h, w, y: linear_cross_entropy(h, w, y, 16))):
        loss, _ = fn(hidden, weight, labels)
        grad = torch.autograd.grad(loss, weight)[0]
        assert grad.dtype == torch.bfloat16
        errors[name] = (abs(loss.item() - exact_loss.item()), (grad.float() - exact_grad).abs().max().item())
    assert errors["chunked"][0] <= errors["unchunked"][0] + 1e-3 * exact_loss.item()
    assert errors["chunked"][1] <= 1.5 * errors["unchunked"][1], errors


def test_without_grad():
    hidden, weight, labels = problem()
    with torch.no_grad():
        loss, correct = linear_cross_entropy(hidden, weight, labels, 16)
    ref_loss, ref_correct = reference(hidden, weight, labels)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    assert int(correct) == int(ref_correct)


def test_objective_with_the_chunked_head_equals_the_plain_head():
    """A real tiny Llama and CLM on packed rows with padding: the model's lm_head turned chunked in place gives the
    loss, count and every parameter gradient the plain head gives; without labels it is still the linear layer."""
    torch.manual_seed(0)
    model = build_model(model_spec("tiny", 64))
    input_ids = torch.randint(4, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.zeros(2, 40, dtype=torch.int32)
    doc_ids[0, 15:] = 1
    doc_ids[1, 33:] = -1
    batch = Batch(input_ids=input_ids, doc_ids=doc_ids, mask_rank=torch.zeros_like(doc_ids),
                  mask_draw=torch.zeros_like(doc_ids), span_ids=torch.full_like(doc_ids, -1), keys=["a", "b"])
    outputs, grads = {}, {}
    for name in ("plain", "chunked"):
        if name == "chunked":
            head = chunk_lm_head(model, chunk_size=9)
            assert isinstance(model.lm_head, ChunkedLMHead) and head is model.lm_head
        model.zero_grad(set_to_none=True)
        outputs[name] = CLM(CLMConfig())(model, batch)["clm"]
        outputs[name].loss_sum.backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert int(outputs["plain"].num_targets) == int(next_token_targets(
        input_ids, input_ids, doc_ids, doc_ids >= 0).predict_at.sum())
    assert int(outputs["chunked"].num_correct) == int(outputs["plain"].num_correct)
    torch.testing.assert_close(outputs["chunked"].loss_sum, outputs["plain"].loss_sum, rtol=1e-5, atol=0)
    for n, g in grads["plain"].items():
        torch.testing.assert_close(grads["chunked"][n], g, rtol=1e-5, atol=1e-6, msg=n)
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.lm_head(hidden), hidden @ model.lm_head.weight.T)


def test_bad_heads():
    model = build_model(model_spec("tiny", 64))
    with pytest.raises(ValueError, match="model.lm_head_chunk must be >= 1"):
        chunk_lm_head(model, 0)
    model.lm_head = nn.Linear(model.config.hidden_size, 64, bias=True)
    with pytest.raises(ValueError, match="bias-free nn.Linear.*model.lm_head_chunk: 0"):
        chunk_lm_head(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output GEMMs (out_dtype) of the chunked head run "
                                                          "on CUDA only; on CPU it casts bf16 products (tested above)")
def test_cuda_fp32_output_gemms_agree_with_the_cast_products():
    """On CUDA the bf16 chunked head's logits and weight-gradient sums come from fp32-output GEMMs: the loss, count
    and gradients agree with the CPU path (bf16 products cast to fp32) within bf16 rounding."""
    hidden, weight, labels = problem(torch.bfloat16)
    results = {}
    for device in ("cpu", "cuda"):
        h, w = (t.detach().to(device).requires_grad_() for t in (hidden, weight))
        loss, correct = linear_cross_entropy(h, w, labels.to(device), 16)
        results[device] = (loss, correct, *torch.autograd.grad(loss, (h, w)))
    for got, want in zip(results["cuda"], results["cpu"]):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max())
