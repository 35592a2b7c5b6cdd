"""SSCL: instruction-prefixed views, deterministic token edits, the loss against a direct reference (with and without
Matryoshka dims), and the cross-rank gather (2 real gloo processes give the loss and gradients of 1 process with the whole batch)."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
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
from pipeline.model.attention import attention_inputs
from pipeline.objectives import SSCL, ObjectiveConfig, SSCLConfig, make_objective
from pipeline.objectives.augment import crop, delete, edit_rng, edit_tokens, swap
from pipeline.objectives.infonce import Matryoshka
from pipeline.objectives.sscl import HEAD, INSTRUCTION
from pipeline.tokenizer import load_tokenizer


def sentences(n: int) -> list[str]:
    """Lines of the sample corpus long enough to be sentences."""
    lines = [line.strip() for doc in documents(max_chars=3000) for line in doc.split("\n")]
    return [line for line in lines if len(line) > 30][:n]


def attached(objective: SSCL, model):
    objective.attach(model)
    return model


def test_views_prefix_the_instruction(tokenizer):
    batch = unit_text_batch(tokenizer, sentences(3))
    batch = replace(batch, doc_ids=batch.doc_ids.clone())
    batch.doc_ids[1] = -1  # a row without a unit (the loader pads a batch with such rows)
    objective = SSCL(SSCLConfig(), tokenizer)
    views = objective.views(batch)
    prefix = tokenizer.encode_batch([INSTRUCTION])[0]
    unit = batch.input_ids[0][batch.doc_ids[0] >= 0].tolist()
    anchor = views.input_ids[0][views.doc_ids[0] >= 0].tolist()
    assert anchor == [unit[0], *prefix, *unit[1:]] and unit[0] == tokenizer.bos_id and unit[-1] == tokenizer.eos_id
    assert int(views.last[0]) == len(anchor) - 1 and anchor[-1] == tokenizer.eos_id  # the EOS is pooled
    assert torch.equal(views.input_ids[:3], views.input_ids[3:])  # dropout: x+ is x
    assert views.valid.tolist() == [True, False, True] and (views.doc_ids[1] == -1).all()
    assert objective.num_targets(batch) == {"sscl": 2}


def test_edits_are_deterministic_and_bounded():
    tokens = np.arange(100, 140)
    for kind in ("delete", "crop", "swap"):
        once = edit_tokens(kind, tokens, 0.2, "f000001s00000007", 0)
        assert np.array_equal(once, edit_tokens(kind, tokens, 0.2, "f000001s00000007", 0))
        others = [edit_tokens(kind, tokens, 0.2, "f000001s00000007", seed) for seed in range(1, 6)]
        assert any(not np.array_equal(once, o) for o in others)
        assert not np.array_equal(once, tokens)
        for n in (1, 2, 3):
            assert len(edit_tokens(kind, tokens[:n], 0.9, "k", 0)) >= 1  # never empty
        assert len(edit_tokens(kind, tokens[:0], 0.2, "k", 0)) == 0
    rng = edit_rng("key", 0)
    deleted = delete(tokens, 0.2, rng)
    assert set(deleted) < set(tokens) and np.all(np.diff(deleted) > 0)  # a subsequence in order
    cropped = crop(tokens, 0.2, rng)
    assert len(cropped) == 32 and np.all(np.diff(cropped) == 1)  # one contiguous window
    swapped = swap(tokens, 0.2, rng)
    assert sorted(swapped) == sorted(tokens) and not np.array_equal(swapped, tokens)
    with pytest.raises(ValueError, match="unknown token edit 'shuffle'"):
        edit_tokens("shuffle", tokens, 0.2, "k", 0)


def reference_loss(model, views_rows: list[list[int]], n: int, scale: float, matryoshka: Matryoshka | None = None
                   ) -> torch.Tensor:
    """Each view alone (no padding), full bidirectional attention, last token -> head, InfoNCE by hand; with
    ``matryoshka``, its weighted sum over the leading dims of the head's output."""
    embeddings = []
    for row in views_rows:
        ids = torch.tensor([row])
        hidden = model.model(input_ids=ids, attention_mask=torch.zeros(1, 1, len(row), len(row))).last_hidden_state
        embeddings.append(getattr(model, HEAD)(hidden[0, -1]))
    embeddings = torch.stack(embeddings).double()
    loss = 0.0
    for dim, weight in matryoshka.terms() if matryoshka else [(embeddings.shape[1], 1.0)]:
        e = F.normalize(embeddings[:, :dim], dim=-1)
        sim = scale * e[:n] @ e[n:].T
        loss += weight * -sum(torch.log_softmax(sim[i], -1)[i] for i in range(n))
    return loss


@pytest.mark.parametrize(("augment", "matryoshka"), [("delete", None), ("swap", None), ("crop", None),
                                                     ("swap", Matryoshka(dims=(64, 32, 8), weights=(1.0, 1.0, 2.0)))])
def test_loss_equals_reference(tokenizer, augment, matryoshka):
    batch = unit_text_batch(tokenizer, sentences(6))
    objective = SSCL(SSCLConfig(augment=augment, edit_ratio=0.3, scale=10.0, matryoshka=matryoshka), tokenizer)
    model = attached(objective, tiny_llama(tokenizer)).eval()
    views = objective.views(batch)
    rows = [views.input_ids[i][views.doc_ids[i] >= 0].tolist() for i in range(len(views.input_ids))]
    assert rows[:6] != rows[6:]  # the edits changed the positives
    out = objective(model, batch)["sscl"]
    with torch.no_grad():
        ref = reference_loss(model, rows, 6, 10.0, matryoshka)
    assert int(out.num_targets) == 6
    assert out.loss_sum.item() == pytest.approx(ref.item(), rel=1e-5)


def test_head_is_identity_tanh_trained_and_not_exported(tokenizer, tmp_path):
    objective = SSCL(SSCLConfig(augment="swap"), tokenizer)
    model = attached(objective, tiny_llama(tokenizer))
    head = getattr(model, HEAD)
    d = model.config.hidden_size
    assert head[0].weight.shape == (d, d) and head[0].bias.shape == (d,)
    x = torch.randn(3, d)
    torch.testing.assert_close(head(x), torch.tanh(x))
    objective(model, unit_text_batch(tokenizer, sentences(4)))["sscl"].loss_sum.backward()
    assert head[0].weight.grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any(k.startswith(HEAD) for k in keys)


def test_dropout_views_differ_only_by_dropout(tokenizer):
    objective = SSCL(SSCLConfig(), tokenizer)  # the default: augment "dropout"
    model = attached(objective, tiny_llama(tokenizer, attention_dropout=0.3))
    batch = unit_text_batch(tokenizer, sentences(4))
    views = objective.views(batch)
    attention = attention_inputs("bidirectional", views.doc_ids, attn_implementation="sdpa")
    with torch.no_grad():
        hidden = model.model(input_ids=views.input_ids, **attention).last_hidden_state
    last = hidden[torch.arange(8), views.last]
    assert (last[:4] - last[4:]).abs().amax(-1).min() > 1e-3  # same input, different dropout
    model.eval()
    with torch.no_grad():
        hidden = model.model(input_ids=views.input_ids, **attention).last_hidden_state
    torch.testing.assert_close(hidden[:4], hidden[4:])


def test_paraphrase_is_the_positive(tokenizer):
    texts = sentences(4)
    paraphrases = [" ".join(reversed(t.split())) for t in texts]
    batch = unit_text_batch(tokenizer, texts, paraphrases=paraphrases)
    objective = SSCL(SSCLConfig(augment="paraphrase"), tokenizer)
    views = objective.views(batch)
    prefix = tokenizer.encode_batch([INSTRUCTION])[0]
    for row, ids in enumerate(tokenizer.encode_batch(paraphrases)):
        positive = views.input_ids[4 + row][views.doc_ids[4 + row] >= 0].tolist()
        assert positive == [tokenizer.bos_id, *prefix, *ids[:30], tokenizer.eos_id]
    model = attached(objective, tiny_llama(tokenizer)).eval()
    assert int(objective(model, batch)["sscl"].num_targets) == 4
    with pytest.raises(ValueError, match="augment is 'paraphrase' but the unit shards carry no paraphrases.*"
                                         "--paraphrase-field"):
        objective.views(unit_text_batch(tokenizer, texts))
    empty = unit_text_batch(tokenizer, texts, paraphrases=["", *paraphrases[1:]])
    with pytest.raises(ValueError, match=rf"sample {empty.keys[0]}: its paraphrase is empty"):
        objective.views(empty)


def test_bad_input_is_named(tokenizer):
    objective = SSCL(SSCLConfig(augment="swap"), tokenizer)
    model = attached(objective, tiny_llama(tokenizer))
    packed = packed_text_batch(tokenizer, documents(max_chars=400)[:12])
    with pytest.raises(ValueError, match=r"sscl reads sentence units .*data_prep/build_shards.py --units"):
        objective(model, packed)
    batch = unit_text_batch(tokenizer, sentences(2))
    empty = replace(batch, doc_ids=torch.full_like(batch.doc_ids, -1))
    assert objective.num_targets(empty) == {"sscl": 0}
    with pytest.raises(ValueError, match="fewer than 2 examples over all ranks.*data.unit_micro_batch"):
        objective(model, empty)
    with pytest.raises(ConfigError, match=r"augment: 'backtranslate' is not allowed; choose one of \['dropout', 'delete'"):
        from_tagged(ObjectiveConfig, {"name": "sscl", "augment": "backtranslate"})
    with pytest.raises(ConfigError, match="temperature: unknown key"):
        from_tagged(ObjectiveConfig, {"name": "sscl", "temperature": 0.05})
    with pytest.raises(TypeError, match="needs the data's pipeline.tokenizer.Tokenizer"):
        make_objective(SSCLConfig(augment="swap"))


def _rank(rank: int, rdzv: dict, texts: list[str], split: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_rendezvous(rank, rdzv)
    tokenizer = load_tokenizer(TOKENIZER)
    objective = SSCL(SSCLConfig(augment="swap", edit_ratio=0.3), tokenizer)
    model = attached(objective, tiny_llama(tokenizer)).eval()
    part = unit_text_batch(tokenizer, texts[:split]) if rank == 0 else unit_text_batch(tokenizer, texts[split:],
                                                                                       first_index=split)
    torch.save(loss_and_grads(objective, model, part),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_equal_one_rank_with_the_whole_batch(tokenizer, tmp_path):
    texts = sentences(7)
    # uneven parts (3 + 4): the gather pads and trims; the keys (which seed the edits) match the whole batch's
    with rendezvous(2) as rdzv:
        mp.spawn(_rank, args=(rdzv, texts, 3, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    objective = SSCL(SSCLConfig(augment="swap", edit_ratio=0.3), tokenizer)
    model = attached(objective, tiny_llama(tokenizer)).eval()
    whole = unit_text_batch(tokenizer, texts)
    loss, count, grads = loss_and_grads(objective, model, whole)
    assert sum(r[1] for r in ranks) == count == 7
    assert sum(r[0] for r in ranks) == pytest.approx(loss, rel=1e-5)
    assert HEAD + ".0.weight" in grads and set(ranks[0][2]) == set(ranks[1][2]) == set(grads)
    for name, grad in grads.items():
        # fp32 sums in another order (the embedding's gradient adds up every position of a token): the absolute
        # tolerance scales with the gradient's size (up to ~30 here, where 1e-6 flat failed on 3 of 512k elements)
        torch.testing.assert_close(ranks[0][2][name] + ranks[1][2][name], grad, rtol=1e-4,
                                   atol=1e-6 * max(1.0, float(grad.abs().max())))
