"""SimCSE (LLM2Vec): mean pooling over text tokens, the loss against a direct per-unit reference (with and without
Matryoshka dims), dropout views, bad input, and the cross-rank gather (2 real gloo processes give the loss and
gradients of 1 process with the whole batch, with and without Matryoshka)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import (
    join_rendezvous,
    loss_and_grads,
    packed_text_batch,
    rendezvous,
    tiny_llama,
    unit_text_batch,
)
from shard_corpus import TOKENIZER, documents

from pipeline.config import ConfigError, from_tagged
from pipeline.data.format.units import split_units
from pipeline.experiment import load_experiment
from pipeline.objectives import ObjectiveConfig, SimCSE, SimCSEConfig, make_objective
from pipeline.objectives.infonce import Matryoshka
from pipeline.objectives.simcse import mean_pool
from pipeline.tokenizer import load_tokenizer


def sentences(n: int) -> list[str]:
    """Sentence units of the sample corpus, long enough to differ from each other."""
    units = [u for doc in documents(max_chars=3000) for u in split_units(doc, "sentence")]
    return [u for u in units if len(u) > 30][:n]


MATRYOSHKA = Matryoshka(dims=(64, 16), weights=(1.0, 0.5))  # tiny_llama's hidden size is 64


def reference_loss(model, units: list[list[int]], scale: float, matryoshka: Matryoshka | None = None
                   ) -> torch.Tensor:
    """Each unit alone (no padding), full bidirectional attention, mean over its text tokens (not BOS/EOS), both
    views identical (no dropout), InfoNCE by hand; with ``matryoshka``, its weighted sum over the leading dims."""
    pooled = []
    for ids in units:
        n = len(ids)
        hidden = model.model(input_ids=torch.tensor([ids]), attention_mask=torch.zeros(1, 1, n, n)).last_hidden_state
        pooled.append(hidden[0, 1:-1].mean(0))
    pooled = torch.stack(pooled).double()
    loss = 0.0
    for dim, weight in matryoshka.terms() if matryoshka else [(pooled.shape[1], 1.0)]:
        e = F.normalize(pooled[:, :dim], dim=-1)
        sim = scale * e @ e.T
        loss += weight * -sum(torch.log_softmax(sim[i], -1)[i] for i in range(len(units)))
    return loss


@pytest.mark.parametrize("matryoshka", [None, MATRYOSHKA], ids=["full", "matryoshka"])
def test_loss_equals_reference(tokenizer, matryoshka):
    texts = sentences(6)
    batch = unit_text_batch(tokenizer, texts)
    # LLM2Vec's 20 makes identical views' loss vanish
    objective = SimCSE(SimCSEConfig(scale=2.0, matryoshka=matryoshka), tokenizer)
    model = tiny_llama(tokenizer).eval()
    out = objective(model, batch)["simcse"]
    units = [batch.input_ids[i][batch.doc_ids[i] >= 0].tolist() for i in range(6)]
    assert all(u[0] == tokenizer.bos_id and u[-1] == tokenizer.eos_id for u in units)
    assert len({len(u) for u in units}) > 1  # rows have different amounts of padding
    with torch.no_grad():
        ref = reference_loss(model, units, 2.0, matryoshka)
    assert int(out.num_targets) == 6 and ref.item() > 1.0
    assert out.loss_sum.item() == pytest.approx(ref.item(), rel=1e-5)


def test_pooling_leaves_out_special_tokens_and_padding(tokenizer):
    batch = unit_text_batch(tokenizer, sentences(3))
    batch = replace(batch, doc_ids=batch.doc_ids.clone())
    batch.doc_ids[1] = -1  # a row without a unit (the loader fills the last eval round with such rows)
    objective = SimCSE(SimCSEConfig(), tokenizer)
    keep = objective.text_tokens(batch)
    for row in (0, 2):
        length = int((batch.doc_ids[row] >= 0).sum())
        assert keep[row].nonzero().flatten().tolist() == list(range(1, length - 1))
    assert not keep[1].any() and objective.num_targets(batch) == {"simcse": 2}
    hidden = torch.randn(3, batch.input_ids.shape[1], 8)
    pooled = mean_pool(hidden, keep)
    torch.testing.assert_close(pooled[0], hidden[0, keep[0]].mean(0))
    assert torch.equal(pooled[1], torch.zeros(8))


def test_dropout_makes_the_two_views(tokenizer):
    objective = SimCSE(SimCSEConfig(), tokenizer)
    model = tiny_llama(tokenizer, attention_dropout=0.3)
    batch = unit_text_batch(tokenizer, sentences(4))
    eval_loss = objective(model.eval(), batch)["simcse"].loss_sum.item()
    torch.manual_seed(1)
    train_loss = objective(model.train(), batch)["simcse"].loss_sum.item()
    torch.manual_seed(1)
    assert objective(model, batch)["simcse"].loss_sum.item() == train_loss  # the dropout masks come from torch's seed
    assert train_loss != pytest.approx(eval_loss, rel=1e-4)  # views differ: not the loss of identical views


def test_bad_input_is_named(tokenizer):
    objective = SimCSE(SimCSEConfig(), tokenizer)
    model = tiny_llama(tokenizer)
    packed = packed_text_batch(tokenizer, documents(max_chars=400)[:12])
    with pytest.raises(ValueError, match=r"simcse reads sentence units .*data_prep/build_shards.py --units"):
        objective(model, packed)
    batch = unit_text_batch(tokenizer, sentences(1))
    with pytest.raises(ValueError, match="fewer than 2 examples over all ranks.*data.unit_micro_batch"):
        objective(model, batch)
    with pytest.raises(ConfigError, match=r"temperature: unknown key; allowed keys: "
                                          r"\['name', 'weight', 'log_as', 'matryoshka', 'scale'\]"):
        from_tagged(ObjectiveConfig, {"name": "simcse", "temperature": 0.05})
    with pytest.raises(ConfigError, match=r"phases\[0\]\.objectives\[0\]\.scale: 0.0 is out of range; it must be > 0"):
        load_experiment(None, ["phases=[{objectives: [{name: simcse, scale: 0}]}]"])
    with pytest.raises(TypeError, match="needs the data's pipeline.tokenizer.Tokenizer"):
        make_objective(SimCSEConfig())


SCALE = 2.0  # identical views (no dropout) at LLM2Vec's 20 would leave a vanishing loss and gradient


def _rank(rank: int, rdzv: dict, texts: list[str], split: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_rendezvous(rank, rdzv)
    tokenizer = load_tokenizer(TOKENIZER)
    part = texts[:split] if rank == 0 else texts[split:]
    results = [loss_and_grads(SimCSE(SimCSEConfig(scale=SCALE, matryoshka=m), tokenizer),
                              tiny_llama(tokenizer).eval(), unit_text_batch(tokenizer, part)) for m in GATHERED]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


GATHERED = (None, MATRYOSHKA)  # one launch checks the gather of both losses: Matryoshka cuts the gathered rows


def test_two_ranks_equal_one_rank_with_the_whole_batch(tokenizer, tmp_path):
    """Without dropout both views are deterministic, so the split is the only difference; uneven parts (3 + 4)
    exercise the gather's padding."""
    texts = sentences(7)
    with rendezvous(2) as rdzv:
        mp.spawn(_rank, args=(rdzv, texts, 3, str(tmp_path)), nprocs=2, join=True)
    both = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    whole = [loss_and_grads(SimCSE(SimCSEConfig(scale=SCALE, matryoshka=m), tokenizer), tiny_llama(tokenizer).eval(),
                            unit_text_batch(tokenizer, texts)) for m in GATHERED]
    assert whole[1][0] > whole[0][0]  # the Matryoshka loss adds the cut dim's term
    for i, (loss, count, grads) in enumerate(whole):
        ranks = [r[i] for r in both]
        assert [r[1] for r in ranks] == [3, 4] and count == 7
        assert sum(r[0] for r in ranks) == pytest.approx(loss, rel=1e-5)
        assert set(ranks[0][2]) == set(ranks[1][2]) == set(grads) and grads
        assert max(g.abs().max().item() for g in grads.values()) > 1e-2
        for name, grad in grads.items():
            # each rank's gradient holds its queries' terms and, through the gather's backward, its keys' terms
            # from every rank's queries: their sum is the whole batch's gradient
            torch.testing.assert_close(ranks[0][2][name] + ranks[1][2][name], grad, atol=1e-6, rtol=1e-4)
