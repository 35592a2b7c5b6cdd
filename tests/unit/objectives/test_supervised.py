"""LLM2Vec's supervised stage: pairs shards (layout, bad rows, determinism, K jobs), pooling as encode() pools, the
loss against a transcription of LLM2Vec's HardNegativeNLLLoss, the collision mask on real rows, Matryoshka against
sentence-transformers' own MatryoshkaLoss, GradCache against one big batch (CPU, with dropout replayed, with and
without Matryoshka) and under ZeRO-3 on 2 ranks, and the export record's instruction format."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, ZERO3, rendezvous, tiny_llama

from pipeline.config import ConfigError
from pipeline.data.format.index import load_index
from pipeline.data.format.instructions import format_instruction, instructed_rows, text_hash
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.loading.batch import collate
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.data.prep.pairs_sample import write_pairs_sample
from pipeline.experiment import load_experiment
from pipeline.export.record import from_experiment
from pipeline.objectives import Supervised, SupervisedConfig
from pipeline.objectives.infonce import Matryoshka, info_nce
from pipeline.train.grad_cache import GradCache, split_ranges, token_ranges

PAIRS = os.path.join(REPO, "data", "sample", "pairs")
TOKENIZER = os.path.join(REPO, "data", "sample", "tokenizer")
WIDTH = 40


def build(output: str, inputs: tuple[str, ...], **kw) -> str:
    cfg = dict(tokenizer=TOKENIZER, output=output, seq_len=WIDTH, pairs=True, progress=False,
               instructions=os.path.join(PAIRS, "instructions.json"), samples_per_shard=50) | kw
    run_job(BuildConfig(inputs=inputs, **cfg))
    return output


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory) -> str:
    return build(str(tmp_path_factory.mktemp("pairs") / "shards"), (os.path.join(PAIRS, "*.jsonl"),))


def samples(directory: str) -> list:
    return [s for info in load_index(directory).shards for s in ShardReader(info.path)]


def test_sample_set_is_the_documented_rule_of_the_training_split(tmp_path):
    """data/sample/pairs is what data_prep/make_pairs_sample.py makes from the sample corpus, byte for byte; its
    rows share texts as SQuAD's do (a row's negative is the next row's positive)."""
    for path in write_pairs_sample(REPO, str(tmp_path)):
        with open(path, "rb") as ours, open(os.path.join(PAIRS, os.path.basename(path)), "rb") as shipped:
            assert ours.read() == shipped.read(), path
    with open(os.path.join(PAIRS, "replies.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 128 and sum(a["negative"] == b["positive"] for a, b in zip(rows, rows[1:])) > 100


def test_pairs_shards_layout_and_pooling_as_encode(pair_dir, tokenizer):
    index = load_index(pair_dir)
    assert index.pairs["slots"] == 3 and index.seq_len == 3 * WIDTH and index.num_samples == 256
    assert {t: n for f in index.jobs[0]["files"] for t, n in f["tasks"].items()} == {"continuations": 128,
                                                                                     "replies": 128}
    # each task in its own shards, named as their source: the loader knows every row's task from the manifest
    assert index.sources == ("continuations", "replies") and index.pairs["sources"] == "task"
    assert {name: c["samples"] for name, c in index.source_counts().items()} == {"continuations": 128, "replies": 128}
    with open(os.path.join(PAIRS, "replies.jsonl")) as f:
        row = json.loads(f.readline())
    sample = next(s for s in samples(pair_dir) if s.key == "f000001s00000000")  # replies is the second input
    sample.validate(index.seq_len)
    instruction = format_instruction("{instruction}: ", "Given a line of a play, retrieve the line that answers it")
    texts, prefixes = [row["query"], row["positive"], row["negative"]], [instruction, "", ""]
    head, tail = [tokenizer.bos_id], [tokenizer.eos_id]
    for s, (ids, start, end) in enumerate(instructed_rows(tokenizer, texts, prefixes, WIDTH, head, tail)):
        seg, pool = sample.segments[s], sample.pool_spans[s]
        assert sample.input_ids[seg[0]:seg[1]].tolist() == ids and (seg[0] == s * WIDTH)
        assert pool.tolist() == [s * WIDTH + start, s * WIDTH + end]
    pooled = tokenizer.hf.decode(sample.input_ids[sample.pool_spans[0, 0]:sample.pool_spans[0, 1]].tolist())
    assert pooled.strip() in row["query"] and "retrieve" not in pooled  # the instruction is not pooled
    assert sample.text_hash.tolist() == [text_hash(t) for t in texts]
    assert text_hash(row["positive"]) == text_hash(row["positive"])  # the hash ignores the instruction
    assert sample.mask_rank is None and sample.mask_draw is None and len(sample.spans) == 0


def test_bad_rows_are_counted_with_file_and_line_and_k_jobs_equal_one(tmp_path, pair_dir, capsys):
    bad = tmp_path / "mixed.jsonl"
    rows = [{"query": "q one", "positive": "p one", "negative": ["n one", "n two"], "instruction": "Find it"},
            {"query": "q two", "positive": "", "negative": "n"},
            "not json",
            {"query": "q three", "positive": "p", "negative": 5},
            {"query": "q four", "positive": "p four", "negative": "n four", "task": "no-such-task"}]
    bad.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    summary = run_job(BuildConfig(inputs=(str(bad),), tokenizer=TOKENIZER, output=str(tmp_path / "bad"),
                                  seq_len=WIDTH, pairs=True, progress=False, max_bad_fraction=1.0,
                                  instructions=os.path.join(PAIRS, "instructions.json")))
    assert summary.samples == 1 and summary.bad_by_reason == {"bad_pair": 2, "not_json": 1, "no_instruction": 1}
    err = capsys.readouterr().err
    assert f"{bad}:2: positive is missing, empty or not a string" in err and f"{bad}:5: task 'no-such-task'" in err
    one = samples(str(tmp_path / "bad"))[0]
    assert one.pool_spans[0, 0] > 1 and one.text_hash[2] == text_hash("n one")  # its own instruction; first negative
    # two jobs (each input file to one of them) write the samples of one job, byte for byte
    two = str(tmp_path / "two")
    for k in range(2):
        build(two, (os.path.join(PAIRS, "*.jsonl"),), num_jobs=2, job_index=k)

    def digest(directory):
        return {s.key: hashlib.sha256(b"".join(getattr(s, f).tobytes() for f in s.fields())).hexdigest()
                for s in samples(directory)}

    assert digest(two) == digest(pair_dir)
    again = build(str(tmp_path / "again"), (os.path.join(PAIRS, "*.jsonl"),))
    assert [s["sha256"] for s in load_index(again).jobs[0]["shards"]] == \
        [s["sha256"] for s in load_index(pair_dir).jobs[0]["shards"]]


def test_pairs_refuse_sources_before_any_work(tmp_path):
    """A pairs row's source is its task (data.pair_mixture mixes them): --pairs with --source-field or
    --source-default is refused before the output exists."""
    for kw in ({"source_field": "meta.source"}, {"source_default": "echo"}):
        with pytest.raises(BuildError, match="--pairs takes no --source-field / --source-default"):
            build(str(tmp_path / "refused"), (os.path.join(PAIRS, "*.jsonl"),), **kw)
    assert not (tmp_path / "refused").exists()


def hard_negative_nll(q, p, n, scale):
    """LLM2Vec's HardNegativeNLLLoss (llm2vec/loss/HardNegativeNLLLoss.py), transcribed: candidates are all
    positives then all negatives, cosine x scale, cross-entropy with label i, mean over queries."""
    docs = torch.cat([p, n])
    scores = scale * F.normalize(q, dim=-1) @ F.normalize(docs, dim=-1).T
    return F.cross_entropy(scores, torch.arange(len(q)))


def test_loss_is_hard_negative_nll_and_collisions_leave_only_their_query():
    g = torch.Generator().manual_seed(0)
    q, p, n = (torch.randn(6, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out = info_nce(q, p, 50.0, negatives=n)
    assert out.loss_sum.item() / 6 == pytest.approx(hard_negative_nll(q, p, n, 50.0).item(), rel=1e-6)
    assert int(out.num_targets) == 6
    # row 0's positive is row 3's hard negative (column 6 + 3) and row 5's positive (column 5)
    hashes = torch.arange(6) * 10
    neg_hashes = torch.arange(6) * 10 + 1
    hashes[5], neg_hashes[3] = hashes[0], hashes[0]
    masked = info_nce(q, p, 50.0, negatives=n, key_hashes=hashes, negative_hashes=neg_hashes)
    logits = 50.0 * F.normalize(q, dim=-1) @ F.normalize(torch.cat([p, n]), dim=-1).T
    logits[0, [5, 9]] = float("-inf")  # query 0 loses both; query 5 loses column 0 (query 0's positive) alike
    logits[5, [0, 9]] = float("-inf")
    ref = F.cross_entropy(logits, torch.arange(6), reduction="sum")
    assert masked.loss_sum.item() == pytest.approx(ref.item(), rel=1e-6) and masked.loss_sum < out.loss_sum


MATRYOSHKA = Matryoshka(dims=(64, 24, 8), weights=(1.0, 0.5, 0.25))  # tiny_llama's hidden size is 64


class GivenRows(torch.nn.Module):
    """A sentence-transformers module whose embeddings are rows of a given table (``features["row"]``), so its
    losses run on exactly the embeddings ours do."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, features: dict) -> dict:
        return {**features, "sentence_embedding": self.table[features["row"]]}

    def get_embedding_dimension(self) -> int:
        return self.table.shape[1]


def test_matryoshka_equals_sentence_transformers_matryoshka_loss(pair_dir, tokenizer):
    """sentence-transformers' MatryoshkaLoss around its MultipleNegativesRankingLoss (scale 50, cosine; the anchor,
    positive and negative columns) on the embeddings the objective pooled from real pairs rows: the same loss per
    query and the same gradient with respect to every embedding, to 1e-6 in fp64 (the formulas), and the loss to
    1e-6 of itself in fp32 (the training precision; the libraries sum in other orders)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    batch = real_batch(pair_dir, [f"f000000s{i:08d}" for i in range(6)])
    objective = Supervised(SupervisedConfig(mask_collisions=False, matryoshka=MATRYOSHKA))
    with torch.no_grad():
        embedded = objective.embed(tiny_llama(tokenizer).eval(), batch)  # [6 x 3, 64]: query, positive, negative
    results = {}
    for dtype in (torch.float64, torch.float32):
        ours, theirs = (embedded.to(dtype).clone().requires_grad_() for _ in range(2))
        out = objective.loss(ours, [batch])
        (out.loss_sum / out.num_targets).backward()
        model = SentenceTransformer(modules=[GivenRows(theirs)], device="cpu")
        reference = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model, scale=50.0), list(MATRYOSHKA.dims),
                                   list(MATRYOSHKA.weights))
        loss = reference([{"row": torch.arange(slot, 18, 3)} for slot in range(3)], None)
        loss.backward()
        results[dtype] = (out.loss_sum.item() / 6, loss.item(), (ours.grad - theirs.grad).abs().max().item(),
                          theirs.grad.abs().max().item())
        print(f"{dtype}: loss {results[dtype][0]:.12g} (ours) vs {results[dtype][1]:.12g} (sentence-transformers), "
              f"largest gradient difference {results[dtype][2]:.3g} of {results[dtype][3]:.3g}")
    ours64, theirs64, difference64, largest64 = results[torch.float64]
    assert abs(ours64 - theirs64) <= 1e-6 and difference64 <= 1e-6 and largest64 > 1e-3
    ours32, theirs32, _, _ = results[torch.float32]
    assert ours32 == pytest.approx(theirs32, rel=1e-6, abs=0)
    plain = Supervised(SupervisedConfig(mask_collisions=False)).loss(embedded, [batch])
    assert plain.loss_sum.item() / 6 < ours32  # the cut dims' terms were added


def real_batch(directory: str, keys: list[str]):
    by_key = {s.key: s for s in samples(directory)}
    return collate([by_key[k] for k in keys])


def test_objective_pools_each_text_alone_and_masks_real_collisions(pair_dir, tokenizer):
    """The [B, 3W] rows unpack to texts, each embedded as if alone (its own tokens, bidirectional, mean over the
    pool span); on consecutive replies rows the next row's positive (this row's negative) is masked for it."""
    keys = [f"f000001s{i:08d}" for i in range(4)]
    batch = real_batch(pair_dir, keys)
    model = tiny_llama(tokenizer).eval()
    objective = Supervised(SupervisedConfig())
    with torch.no_grad():
        e = objective.embed(model, batch).view(4, 3, -1)
        for b in range(4):
            for s in range(3):
                start, end = batch.pool_spans[b, s].tolist()
                seg = torch.nonzero(batch.doc_ids[b] == s).flatten()
                ids = batch.input_ids[b, seg]
                n = len(ids)
                hidden = model.model(input_ids=ids[None], attention_mask=torch.zeros(1, 1, n, n)).last_hidden_state
                a, z = start - int(seg[0]), end - int(seg[0])
                torch.testing.assert_close(e[b, s], hidden[0, a:z].mean(0), atol=1e-5, rtol=1e-5)
    hashes = batch.text_hash
    assert all(hashes[i, 2] == hashes[i + 1, 1] for i in range(3))  # the sample set's collisions
    with torch.no_grad():
        plain = Supervised(SupervisedConfig(mask_collisions=False))(model, batch)["supervised"]
        masked = objective(model, batch)["supervised"]
        q, p, n = e[:, 0], e[:, 1], e[:, 2]
        logits = 50.0 * F.normalize(q, dim=-1) @ F.normalize(torch.cat([p, n]), dim=-1).T
        for i in range(3):
            logits[i + 1, 4 + i] = float("-inf")
    assert plain.loss_sum.item() == pytest.approx(4 * hard_negative_nll(q, p, n, 50.0).item(), rel=1e-5)
    assert masked.loss_sum.item() == pytest.approx(F.cross_entropy(logits, torch.arange(4), reduction="sum").item(),
                                                   rel=1e-5)


def token_chunks(batch, budget: int) -> list:
    """``batch``'s rows in chunks of at most ``budget`` real tokens, as the step cuts them (``grad_cache: {tokens:
    N}``)."""
    return [batch.rows(b, e) for b, e in token_ranges((batch.doc_ids >= 0).sum(-1).tolist(), budget)]


def cached_and_reference(tokenizer, batch, dropout: float, replay: bool = True, reference: str = "graph",
                         matryoshka: Matryoshka | None = None, budget: int | None = None, **config):
    """(loss, grads) of GradCache over chunks of ``batch``'s rows (3 of 2 rows, or cut by a token ``budget``) and
    of the reference: ``graph`` keeps the chunks' graphs (the same RNG sequence) and runs one backward, ``one``
    embeds the whole batch in one pass."""
    objective = Supervised(SupervisedConfig(matryoshka=matryoshka, **config))
    chunks = ([collate_rows(batch, list(range(i, i + 2))) for i in range(0, 6, 2)] if budget is None
              else token_chunks(batch, budget))
    results = []
    for mode in ("cached", reference):
        model = tiny_llama(tokenizer, attention_dropout=dropout).train()
        torch.manual_seed(7)
        if mode == "cached":
            cache = GradCache(lambda m, model=model: objective.embed(model, chunks[m]), len(chunks),
                              lambda e: objective.loss(e, chunks).loss_sum, replay_rng=replay)
            loss = cache.cache()
            for m in range(len(chunks)):
                cache.surrogate(m).backward()
            cache.done()
        elif mode == "graph":
            e = torch.cat([objective.embed(model, c) for c in chunks])
            loss = objective.loss(e, chunks).loss_sum
            loss.backward()
        else:
            loss = objective(model, batch)["supervised"].loss_sum
            loss.backward()
        results.append((loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    return results


def collate_rows(batch, rows: list[int]):
    return replace(batch, **{f.name: getattr(batch, f.name)[rows] for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)}, keys=[batch.keys[r] for r in rows])


def assert_same(a, b, tol=1e-5):
    """Equal losses, and every parameter's gradient equal to within ``tol`` of its largest entry (fp32 sums in
    another order differ by rounding, which scale 50 magnifies in single entries)."""
    assert a[0] == pytest.approx(b[0], rel=tol)
    assert set(a[1]) == set(b[1]) and a[1]
    for name, grad in b[1].items():
        assert (a[1][name] - grad).abs().max() <= tol * grad.abs().max(), name


def test_grad_cache_equals_one_big_batch_and_replays_dropout(pair_dir, tokenizer):
    batch = real_batch(pair_dir, [f"f000000s{i:08d}" for i in range(6)])
    cached, one = cached_and_reference(tokenizer, batch, 0.0, reference="one")
    assert_same(cached, one)
    assert max(g.abs().max().item() for g in one[1].values()) > 1e-3
    # Matryoshka cuts the embeddings inside the loss, whose gradient GradCache caches at full width
    cached_m, one_m = cached_and_reference(tokenizer, batch, 0.0, reference="one", matryoshka=MATRYOSHKA)
    assert_same(cached_m, one_m)
    assert cached_m[0] > cached[0]  # the cut dims' terms were added
    cached, graph = cached_and_reference(tokenizer, batch, 0.1)
    assert_same(cached, graph)
    unreplayed, graph = cached_and_reference(tokenizer, batch, 0.1, replay=False)
    assert unreplayed[0] == pytest.approx(graph[0], rel=1e-6)  # the first pass is the reference's forward ...
    with pytest.raises(AssertionError):  # ... but the re-run draws other dropout masks: wrong gradients
        assert_same(unreplayed, graph, tol=1e-4)
    # token-budget chunks (rows of 120, 46, 75, 91, 64, 81 tokens in 160 a chunk): 4 chunks of uneven row counts,
    # each padded to its own longest text; the same gradient, with and without dropout (replayed), every run alike
    assert [len(c.keys) for c in token_chunks(batch, 160)] == [1, 2, 2, 1]
    cached, one = cached_and_reference(tokenizer, batch, 0.0, reference="one", budget=160)
    assert_same(cached, one)
    cached, graph = cached_and_reference(tokenizer, batch, 0.1, budget=160)
    assert_same(cached, graph)
    again, _ = cached_and_reference(tokenizer, batch, 0.1, budget=160)
    assert again[0] == cached[0] and all(torch.equal(g, again[1][n]) for n, g in cached[1].items())


def test_token_budget_chunks_are_sentence_transformers_mini_batches():
    """``token_ranges`` cuts as sentence-transformers' cached losses do with ``mini_batch_num_tokens`` (its own
    ``_minibatch_ranges`` on the same per-row token counts, rows above the budget alone); ``split_ranges`` then
    splits the chunk of most tokens until a rank has as many chunks as another: in order, nothing lost, deterministic."""
    from sentence_transformers.base.losses.gradcache import _minibatch_ranges
    generator = torch.Generator().manual_seed(0)
    for budget in (1, 50, 160, 300, 10_000):
        tokens = torch.randint(0, 200, (37,), generator=generator)
        mask = (torch.arange(200)[None, :] < tokens[:, None]).long()
        ranges = token_ranges(tokens.tolist(), budget)
        assert ranges == [tuple(r) for r in _minibatch_ranges({"attention_mask": mask}, 1, budget)]
        count = min(len(ranges) + 5, 37)
        split = split_ranges(ranges, tokens.tolist(), count)
        assert len(split) == count and [b for b, _ in split[1:]] == [e for _, e in split[:-1]]
        assert split[0][0] == 0 and split[-1][1] == 37 and split == split_ranges(ranges, tokens.tolist(), len(split))
        assert all(e - b == 1 or sum(tokens[b:e]) <= budget for b, e in split)
    assert split_ranges([(0, 2), (2, 5)], [5, 5, 1, 1, 9], 3) == [(0, 2), (2, 4), (4, 5)]  # the 11 tokens' chunk: 1 1 | 9
    with pytest.raises(ValueError, match="2 rows cannot make the 3 chunks another rank cut"):
        split_ranges([(0, 1), (1, 2)], [5, 5], 3)


def test_without_in_batch_negatives_each_query_scores_its_own_candidates_alone(pair_dir, tokenizer):
    """``in_batch_negatives: false`` (NV-Embed's second stage; FlagEmbedding's use_inbatch_neg=False): row i's loss is
    the InfoNCE over its positive and its own hard negative alone, computed here by hand. sentence-transformers has
    no such switch, but its MultipleNegativesRankingLoss on a batch of one row scores exactly that row's (positive,
    own negatives): the sum of MNRL (and of MatryoshkaLoss around it) over the rows one at a time equals our loss
    and its gradient, to 1e-6 in fp64. Another row's positive among a row's candidates no longer counts (the
    collision mask changes nothing on the replies rows), its own positive's text as its negative is still masked,
    and GradCache over 3 chunks equals the one batch."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    batch = real_batch(pair_dir, [f"f000001s{i:08d}" for i in range(6)])  # replies: row i's negative is i+1's positive
    own = Supervised(SupervisedConfig(in_batch_negatives=False))
    with torch.no_grad():
        embedded = own.embed(tiny_llama(tokenizer).eval(), batch).double()  # [6 x 3, 64]: query, positive, negative
    e = F.normalize(embedded.view(6, 3, -1), dim=-1)
    rows = [F.cross_entropy(50.0 * e[i, :1] @ e[i, 1:].T, torch.tensor([0]), reduction="sum").item() for i in range(6)]
    assert own.loss(embedded, [batch]).loss_sum.item() == pytest.approx(sum(rows), rel=1e-12)
    assert Supervised(SupervisedConfig()).loss(embedded, [batch]).loss_sum.item() > sum(rows) + 1  # in-batch's more
    unmasked = Supervised(SupervisedConfig(in_batch_negatives=False, mask_collisions=False))
    assert unmasked.loss(embedded, [batch]).loss_sum.item() == pytest.approx(sum(rows), rel=1e-12)
    copied = replace(batch, text_hash=batch.text_hash.clone())
    copied.text_hash[0, 2] = copied.text_hash[0, 1]  # row 0's negative has its positive's text: masked, loss 0
    assert own.loss(embedded, [copied]).loss_sum.item() == pytest.approx(sum(rows[1:]), rel=1e-12)
    for matryoshka in (None, MATRYOSHKA):
        ours, theirs = (embedded.clone().requires_grad_() for _ in range(2))
        out = Supervised(SupervisedConfig(in_batch_negatives=False, matryoshka=matryoshka)).loss(ours, [batch])
        out.loss_sum.backward()
        model = SentenceTransformer(modules=[GivenRows(theirs)], device="cpu")
        reference = MultipleNegativesRankingLoss(model, scale=50.0)
        if matryoshka is not None:
            reference = MatryoshkaLoss(model, reference, list(matryoshka.dims), list(matryoshka.weights))
        loss = sum(reference([{"row": torch.tensor([3 * i + slot])} for slot in range(3)], None) for i in range(6))
        loss.backward()
        ours_loss = out.loss_sum.item()
        print(f"matryoshka {matryoshka is not None}: loss {ours_loss:.12g} (ours) vs {loss.item():.12g} (MNRL a row at "
              f"a time), largest gradient difference {(ours.grad - theirs.grad).abs().max().item():.3g}")
        assert abs(ours_loss - loss.item()) <= 1e-6 and (ours.grad - theirs.grad).abs().max() <= 1e-6
    cached, one = cached_and_reference(tokenizer, batch, 0.0, reference="one", matryoshka=MATRYOSHKA,
                                       in_batch_negatives=False)
    assert_same(cached, one)
    with pytest.raises(ConfigError, match=r"^phases\[0\]\.objectives\[0\]\.in_batch_negatives: false leaves each "
                                          r"query its own hard negatives only, and phases\[0\]\.objectives\[0\]\."
                                          r"hard_negatives is false: no negative is left; set "):
        load_experiment(None, ["phases=[{objectives: [{name: supervised, in_batch_negatives: false, "
                               "hard_negatives: false}]}]"])


def test_config_checks_and_the_export_record(tokenizer):
    with pytest.raises(ConfigError, match=r"grad_accum 3 would make each micro-step its own contrastive batch"):
        load_experiment(None, ["train.grad_accum=3", "phases=[{objectives: [{name: supervised}]}]"])
    with pytest.raises(ConfigError, match="must be the phase's only objective"):
        load_experiment(None, ["phases=[{objectives: [{name: supervised, grad_cache: true}, {name: clm}]}]"])
    with pytest.raises(ConfigError, match="instruction_format.*must hold '{instruction}'"):
        load_experiment(None, ["phases=[{objectives: [{name: supervised, instruction_format: 'x: '}]}]"])
    for objective, bad, message in (
            ("supervised", "{dims: [16, 32]}", r"matryoshka\.dims: \[16, 32\] must descend strictly; write them "
                                               r"largest first, e.g\. \[32, 16\]$"),
            ("simcse", "{dims: [32, 16], weights: [1]}", r"matryoshka\.weights: 1 weight\(s\) for 2 dims; give one per "
                                                         r"dim, e\.g\. \[1\.0, 1\.0\], or leave weights out"),
            ("sscl", "{dims: [32, 16], weights: [1, 0]}", r"matryoshka\.weights: \[1\.0, 0\.0\] is out of range; it "
                                                          r"must be > 0$"),
            ("sscl", "{weights: [1]}", r"matryoshka\.dims: missing; list the embedding dims to train")):
        with pytest.raises(ConfigError, match=rf"^phases\[0\]\.objectives\[0\]\.{message}"):
            load_experiment(None, ["model.attention_dropout=0.1",
                                   f"phases=[{{objectives: [{{name: {objective}, matryoshka: {bad}}}]}}]"])
    for bad, message in (("{tokens: 0}", r"grad_cache\.tokens: 0 is out of range; it must be >= 1$"),
                         ("{}", r"grad_cache\.tokens: missing; give each chunk's token budget, e\.g\. "),
                         ("{token: 8}", r"grad_cache\.token: unknown key; did you mean "),
                         ("8", r"grad_cache: expected true/false, got 8 / .*expected a mapping for TokenChunks")):
        with pytest.raises(ConfigError, match=rf"^phases(\[0\]|\.0)\.objectives(\[0\]|\.0)\.{message}"):
            load_experiment(None, [f"phases=[{{objectives: [{{name: supervised, grad_cache: {bad}}}]}}]"])
    for setting, tokens in (("true", None), ("{tokens: 4096}", 4096)):
        exp = load_experiment(None, ["train.grad_accum=3", f"phases=[{{objectives: [{{name: supervised, "
                                                             f"grad_cache: {setting}}}]}}]"])
        objective = Supervised(exp.phases[0].objectives[0])
        assert (objective.grad_cache, objective.chunk_tokens) == (True, tokens)
    exp = load_experiment(None, ["train.grad_accum=3", "phases=[{objectives: [{name: supervised, grad_cache: true, "
                                 "instruction: Retrieve semantically similar text}]}]"])
    record = from_experiment(exp, tokenizer)
    assert (record.instruction, record.instruction_format, record.pooling, record.attention) == (
        "Retrieve semantically similar text", "{instruction}: ", "mean", "bidirectional")


# Rank r of 2 under ZeRO-3: 3 micro-batches of 2 rows of the pairs shards (rows 6r..6r+5), a grad-cache step with a
# chunk per micro-batch, then one with chunks of at most 160 tokens (optim.lr 1e-30: the first step leaves the fp32
# weights as they were); prints each step's chunks (engine steps) and writes the losses and the full (averaged)
# gradients at the accumulation boundaries.
ZERO3_STEP = """
import json, os, sys
import deepspeed, torch
from deepspeed.utils import safe_get_full_grad
sys.path[:0] = [os.path.join(sys.argv[4], "tests"), os.path.join(sys.argv[4], "tests/unit/objectives")]
from test_supervised import real_batch
from pipeline.experiment import load_experiment
from pipeline.tokenizer import load_tokenizer
from pipeline.train.ds_config import load_ds_config, resolve_ds_config
from pipeline.train.engine_spec import engine_spec
from pipeline.train.module import build_engine
from pipeline.train.phases import build_objectives
from pipeline.train.preflight import check_model
from pipeline.train.step import train_step
deepspeed.init_distributed(dist_backend="gloo")
rank = int(os.environ["RANK"])
exp = load_experiment(None, json.loads(sys.argv[1]))
tok = load_tokenizer(exp.data.tokenizer)
objectives = build_objectives(exp.phases[0], tok)
budget = load_experiment(None, json.loads(sys.argv[1]) + [
    "phases=[{objectives: [{name: supervised, grad_cache: {tokens: 160}}]}]"]).phases[0]
ds = resolve_ds_config(load_ds_config(sys.argv[3]), exp, 2, False)
_, engine = build_engine(ds, check_model(exp, tok, ds, cuda=False), engine_spec(exp, cuda=False),
                         [o.objective for o in objectives])
micro = [real_batch(sys.argv[2], [f"f000000s{6 * rank + i:08d}" for i in range(m, m + 2)]) for m in (0, 2, 4)]
grads, chunks = {}, []
step = engine.step
def capture():
    chunks[-1] += 1
    if engine.is_gradient_accumulation_boundary():
        for name, p in engine.module.lm.named_parameters():
            g = safe_get_full_grad(p)
            if g is not None:
                grads[name] = g.clone()
    step()
engine.step = capture
results = {}
for name, objs in (("rows", objectives), ("tokens", build_objectives(budget, tok))):
    chunks.append(0)
    result = train_step(engine, objs, {"pairs": micro}, 2, 3)
    results[name] = {"loss": result.losses["supervised"], "grads": dict(grads)}
if rank == 0:
    torch.save(results, sys.argv[5])
print("chunks", *chunks, flush=True)
os._exit(0)
"""


@pytest.mark.e2e
def test_grad_cache_under_zero3_on_two_ranks_equals_one_big_batch(pair_dir, tokenizer, init_dir, tmp_path):
    """2 ranks x micro 2 x grad_accum 3 with grad_cache, chunked by micro-batch and by 160 tokens: the logged loss
    and the gradients DeepSpeed reduces are those of one process embedding the 12 rows in one batch, without cache
    (dropout off, so the split is the only difference). The token budget cuts rank 0's rows (120, 46, 75, 91, 64,
    81 tokens) into 4 chunks and rank 1's (67, 91, 120, 95, 104, 77) into 5, so rank 0 splits one to run 5 too."""
    overrides = [f"model.init={init_dir}", f"data.tokenizer={TOKENIZER}", "train.micro_batch=2", "train.grad_accum=3",
                 "optim.grad_clip=0.0", "optim.lr=1e-30",
                 "phases=[{objectives: [{name: supervised, grad_cache: true}]}]"]
    out = str(tmp_path / "rank0.pt")
    with rendezvous(2) as rdzv:
        procs = []
        for rank in range(2):
            env = dict(os.environ, **rdzv, RANK=str(rank), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu",
                       OMP_NUM_THREADS="1", PYTHONPATH=REPO)
            procs.append(subprocess.Popen([sys.executable, "-c", ZERO3_STEP, json.dumps(overrides), pair_dir, ZERO3,
                                           REPO, out], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        for proc in procs:
            stdout, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
            assert "chunks 3 5" in stdout, stdout[-3000:]
    steps = torch.load(out)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(init_dir).train()
    batch = real_batch(pair_dir, [f"f000000s{i:08d}" for i in range(12)])
    loss = Supervised(SupervisedConfig())(model, batch)["supervised"].loss_sum / 12
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for ranks in steps.values():
        unused = {n: g for n, g in ranks["grads"].items() if n not in grads}
        assert list(unused) == ["lm_head.weight"] and not unused["lm_head.weight"].any()  # ZeRO-3 holds zeros for it
        assert_same((ranks["loss"], {n: g for n, g in ranks["grads"].items() if n in grads}), (loss.item(), grads))


@pytest.mark.e2e
def test_same_task_batches_on_two_zero3_ranks_train_as_one_rank_reading_them_whole(tmp_path, init_dir):
    """data.pair_batching: same_task through launch/train.py (issue 52 item 3; which task each batch holds and the
    mid-epoch resume: test_mixture.py's loaders): 2 ZeRO-3 ranks, each reading its rows of a global batch, gather
    them and train with the losses of one rank reading each batch whole (twice the micro-steps), so the two ranks'
    loaders agreed on every batch and its task; rank 0 prints the plan of tasks."""
    from helpers import launch_training, logged_steps

    shards = build(str(tmp_path / "pairs"), (os.path.join(PAIRS, "*.jsonl"),), seq_len=32)
    experiment = os.path.join(REPO, "experiments", "llm2vec", "supervised-smoke.yaml")
    common = [f"data.shards={shards}", f"data.pair_shards={shards}", f"model.init={init_dir}", "train.steps=4",
              "data.pair_batching=same_task", "data.pair_mixture={replies: 0.5, continuations: 0.5}",
              "train.export_hf=false", "checkpoint.every=1000"]
    two = launch_training(str(tmp_path / "two"), experiment, *common)
    launch_training(str(tmp_path / "one"), experiment, *common, "train.grad_accum=4", nproc=1)
    assert "mixture of 2 tasks over 4 steps" in two.stderr, two.stderr[-3000:]
    ranks2, rank1 = (logged_steps(str(tmp_path / run)) for run in ("two", "one"))
    assert sorted(ranks2) == sorted(rank1) == [1, 2, 3, 4]
    for step, logged in ranks2.items():
        assert logged["loss/supervised"] == pytest.approx(rank1[step]["loss/supervised"], rel=1e-5), step


@pytest.mark.slow
@pytest.mark.extended  # tests/e2e/test_llm2vec_chain.py trains this stage from SmolLM2 and checks the export's instructions
@pytest.mark.e2e
def test_smoke_twin_trains_on_two_zero3_ranks_and_its_export_formats_instructions(tmp_path, init_dir):
    """supervised-smoke.yaml through launch/train.py (GradCache, 2 x 2 x 2 rows a step): 8 finite steps, and an export
    whose record makes encode() format a bare instruction as the shards did."""
    from helpers import launch_training, logged_steps

    from pipeline.eval import encode, load_model
    shards = build(str(tmp_path / "pairs"), (os.path.join(PAIRS, "*.jsonl"),), seq_len=32)
    run = str(tmp_path / "run")
    launch_training(run, os.path.join(REPO, "experiments", "llm2vec", "supervised-smoke.yaml"),
                    f"data.shards={shards}", f"data.pair_shards={shards}", f"model.init={init_dir}")
    steps = logged_steps(run)
    assert sorted(steps) == list(range(1, 9)) and all(0 < s["loss/supervised"] < 100 for s in steps.values())
    model = load_model(os.path.join(run, "hf"))
    assert model.record.instruction_format == "{instruction}: "
    texts = ["Where is he?"]
    bare = encode(model, texts, instruction="Given a line of a play, retrieve the line that answers it")
    model.record = replace(model.record, instruction_format=None)  # instructions then are verbatim prefixes
    verbatim = encode(model, texts, instruction="Given a line of a play, retrieve the line that answers it: ")
    assert np.allclose(bare, verbatim, atol=1e-6)
