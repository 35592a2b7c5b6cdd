"""CLM / MLM / MNTP against direct reference computations on a random tiny Llama and real packed samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import BOS, EOS, PAD, SPECIAL_IDS
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from pipeline.data.batch import Batch, collate
from pipeline.data.build_sample import PlanSettings, make_sample
from pipeline.data.format import UNMASKABLE
from pipeline.data.packing import Packer
from pipeline.model.attention import attention_inputs
from pipeline.model.build import build_model
from pipeline.objectives import CLM, MLM, MNTP, Masking, MaskingConfig, make_objective
from pipeline.objectives.base import ordinary_token_ids, resolve_mask_id

VOCAB, SEQ_LEN = 64, 32
UNDERSCORE = 4  # the "_" token of the test vocabulary


def make_tokenizer(with_mask: bool = True) -> PreTrainedTokenizerFast:
    """A real word-level tokenizer whose ids match tests/helpers.py (PAD, BOS, EOS, MASK = 0..3), then "_"."""
    words = ["<pad>", "<s>", "</s>", "<mask>", "_"] + [f"w{i}" for i in range(5, VOCAB)]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w5"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   mask_token="<mask>" if with_mask else None)


def make_batch(seed: int = 0) -> Batch:
    """Three full packed samples (several documents, some crossing sample boundaries) and one padded sample."""
    rng = np.random.default_rng(seed)
    packer = Packer(SEQ_LEN, PAD, BOS, EOS, "pad")
    packed: list[tuple[np.ndarray, np.ndarray]] = []
    while len(packed) < 3:
        packed += packer.add(rng.integers(len(SPECIAL_IDS), VOCAB, size=int(rng.integers(3, 40))).tolist())
    tail = Packer(SEQ_LEN, PAD, BOS, EOS, "pad")
    tail.add(rng.integers(len(SPECIAL_IDS), VOCAB, size=SEQ_LEN // 2).tolist())
    plan = PlanSettings(seed=seed, special_ids=np.array(SPECIAL_IDS), span_min=2, span_max=6)
    samples = [make_sample(ids, segs, 0, i, plan) for i, (ids, segs) in enumerate(packed[:3] + tail.finish())]
    return collate(samples)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny", VOCAB, attn_implementation="sdpa", pad_token_id=PAD, bos_token_id=BOS,
                       eos_token_id=EOS)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def masking(tokenizer, ratio=0.3, policy="80-10-10", mask_token=None) -> Masking:
    return Masking.resolve(MaskingConfig(ratio=ratio, policy=policy, mask_token=mask_token), tokenizer)


def attention(model, mode, batch):
    return attention_inputs(mode, batch.doc_ids, attn_implementation=model.config._attn_implementation,
                            dtype=model.dtype)


def has_same_doc_predecessor(doc_ids: torch.Tensor) -> torch.Tensor:
    prev = torch.full_like(doc_ids, -2)
    prev[:, 1:] = doc_ids[:, :-1]
    return (doc_ids >= 0) & (prev == doc_ids)


def test_batch_is_packed_and_padded():
    batch = make_batch()
    assert (batch.doc_ids[3] == -1).any() and (batch.doc_ids[:3] >= 0).all()
    assert (batch.doc_ids.amax(-1)[:3] >= 1).any()  # document boundaries inside a sample
    assert (batch.input_ids[:3, 0] != BOS).any()  # a document continued from the previous sample


def test_clm_equals_transformers_shifted_loss(model):
    batch = make_batch()
    out = CLM()(model, batch)
    labels = torch.where(has_same_doc_predecessor(batch.doc_ids), batch.input_ids, -100)
    with torch.no_grad():
        ref = model(input_ids=batch.input_ids, labels=labels, **attention(model, "causal", batch))
    n = int((labels != -100).sum())
    assert int(out.num_targets) == n
    torch.testing.assert_close(out.loss_sum.detach(), ref.loss * n)
    predicted = ref.logits[:, :-1].argmax(-1)
    assert int(out.num_correct) == int(((predicted == labels[:, 1:]) & (labels[:, 1:] != -100)).sum())


def test_mntp_equals_transformers_shifted_loss(model, tokenizer):
    batch = make_batch(1)
    objective = MNTP(masking(tokenizer, ratio=0.4, mask_token="_"))
    out = objective(model, batch)
    masked_ids, is_target = objective.masking.apply(batch)
    assert (masked_ids[is_target] == UNDERSCORE).float().mean() > 0.5  # 80 % of targets show the mask token
    labels = torch.where(is_target & has_same_doc_predecessor(batch.doc_ids), batch.input_ids, -100)
    with torch.no_grad():  # LLM2Vec: LlamaForCausalLM's own shifted loss on the masked input, bidirectional
        ref = model(input_ids=masked_ids, labels=labels, **attention(model, "bidirectional", batch))
    n = int((labels != -100).sum())
    assert int(out.num_targets) == n > 0
    torch.testing.assert_close(out.loss_sum.detach(), ref.loss * n)


def test_mlm_equals_hand_loop(model, tokenizer):
    batch = make_batch(2)
    objective = MLM(masking(tokenizer, ratio=0.3, policy="mask"))
    out = objective(model, batch)
    masked_ids, is_target = objective.masking.apply(batch)
    assert (masked_ids[is_target] == 3).all() and (masked_ids[~is_target] == batch.input_ids[~is_target]).all()
    with torch.no_grad():
        logits = model(input_ids=masked_ids, **attention(model, "bidirectional", batch)).logits
    loss, correct = 0.0, 0
    for b, i in is_target.nonzero().tolist():
        loss += -torch.log_softmax(logits[b, i].double(), -1)[batch.input_ids[b, i]].item()
        correct += int(logits[b, i].argmax() == batch.input_ids[b, i])
    assert int(out.num_targets) == int(is_target.sum()) > 0
    assert out.loss_sum.item() == pytest.approx(loss, rel=1e-5)
    assert int(out.num_correct) == correct


@pytest.mark.parametrize("name", ["clm", "mlm", "mntp"])
def test_target_only_head_equals_full_head(model, tokenizer, name):
    batch = make_batch(3)
    objective = make_objective(name, tokenizer=tokenizer, masking=None if name == "clm" else MaskingConfig())
    out = objective(model, batch)
    targets = objective.targets(batch)
    with torch.no_grad():
        logits = model(input_ids=targets.input_ids, **attention(model, objective.attention_mode, batch)).logits
    full = F.cross_entropy(logits.transpose(1, 2), targets.labels, reduction="none")
    torch.testing.assert_close(out.loss_sum.detach(), full[targets.source].sum())
    assert objective.num_targets(batch) == int(out.num_targets)


def test_targets_on_a_hand_written_batch(tokenizer):
    """Two documents [5 6 7 | 8 9 10]: with everything masked, MLM predicts all six tokens in place; CLM and MNTP
    predict 6, 7, 9, 10 from the previous position and never the first token of a document."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    batch = Batch(input_ids=ids, doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32),
                  mask_rank=torch.arange(6, dtype=torch.int32)[None], mask_draw=torch.zeros(1, 6, dtype=torch.int64),
                  span_ids=torch.full((1, 6), -1, dtype=torch.int32), keys=["hand"])
    everything = masking(tokenizer, ratio=1.0, policy="mask")
    mlm, mntp, clm = MLM(everything).targets(batch), MNTP(everything).targets(batch), CLM().targets(batch)
    assert mlm.source.tolist() == [[True] * 6] and mlm.labels.tolist() == ids.tolist()
    assert (mlm.input_ids == 3).all() and (mntp.input_ids == 3).all() and torch.equal(clm.input_ids, ids)
    for t in (mntp, clm):
        assert t.source.tolist() == [[True, True, False, True, True, False]]
        assert t.labels[t.source].tolist() == [6, 7, 9, 10]


def test_ratio_follows_the_plan(tokenizer):
    batch = make_batch(4)
    maskable = (batch.mask_rank != int(UNMASKABLE)).sum(-1)
    for ratio in (0.2, 0.5):
        source = MLM(masking(tokenizer, ratio=ratio)).targets(batch).source
        assert source.sum(-1).tolist() == torch.floor(ratio * maskable.double() + 0.5).long().tolist()


def test_padding_rows_give_no_targets_and_finite_gradients(model, tokenizer):
    batch = make_batch(5)
    padding = Batch(input_ids=torch.full_like(batch.input_ids, PAD), doc_ids=torch.full_like(batch.doc_ids, -1),
                    mask_rank=torch.full_like(batch.mask_rank, int(UNMASKABLE)), mask_draw=batch.mask_draw,
                    span_ids=batch.span_ids, keys=batch.keys)
    for objective in (CLM(), MLM(masking(tokenizer)), MNTP(masking(tokenizer))):
        model.zero_grad()
        out = objective(model, padding)
        assert int(out.num_targets) == 0 and out.loss_sum.item() == 0.0
        out.loss_sum.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad()
    MLM(masking(tokenizer))(model, batch).loss_sum.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0 and model.model.embed_tokens.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_mask_token_resolution(tokenizer):
    assert resolve_mask_id(tokenizer, None) == 3
    assert resolve_mask_id(tokenizer, "_") == UNDERSCORE
    with pytest.raises(ValueError, match="'zz' is not a single token"):
        resolve_mask_id(tokenizer, "zz")
    with pytest.raises(ValueError, match="has no mask token; set masking.mask_token"):
        resolve_mask_id(make_tokenizer(with_mask=False), None)
    pool = ordinary_token_ids(tokenizer).tolist()
    assert pool == list(range(4, VOCAB))  # random replacements never draw special tokens


def test_bad_configuration(tokenizer):
    with pytest.raises(ValueError, match="unknown objective 'nsp'; known objectives: clm, mlm, mntp"):
        make_objective("nsp")
    with pytest.raises(ValueError, match="'clm' does not mask"):
        make_objective("clm", masking=MaskingConfig())
    with pytest.raises(ValueError, match="'mlm' needs the tokenizer"):
        make_objective("mlm")
    with pytest.raises(ValueError, match="masking.policy: '90-10' is not one of 80-10-10, mask"):
        MaskingConfig(policy="90-10")
    with pytest.raises(ValueError, match=r"masking.ratio: 0.0 is outside \(0, 1\]"):
        MaskingConfig(ratio=0.0)
    objective = make_objective("mntp", tokenizer=tokenizer, masking=MaskingConfig(mask_token="_"),
                               document_masking=False)
    assert objective.masking.mask_id == UNDERSCORE and objective.document_masking is False
