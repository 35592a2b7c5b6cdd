"""The evaluation tasks and the embedding API on a tiny random Llama with the shipped sample tokenizer, the shipped
fixtures (tests/fixtures/eval, real formats) and held-out shards of the sample corpus: each checked against an
independent computation where one exists, and each runnable alone."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from test_tasks import check_against_spec

from pipeline.data.format.sample import UNMASKABLE
from pipeline.data.loading.batch import Batch
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.eval import encode, load_model
from pipeline.eval.encode import pool
from pipeline.eval.finetune.protocol import linear_warmup_decay, split_train
from pipeline.eval.finetune.qa import ExtractiveQA, Question
from pipeline.eval.forward import tokenize_words
from pipeline.eval.infilling import Example, span_nll
from pipeline.eval.ranking import ndcg
from pipeline.eval.registry import TASKS, task_options
from pipeline.eval.repetition import repetition_scores
from pipeline.eval.task import EvalContext
from pipeline.experiment import SAMPLE_DIR
from pipeline.objectives import MagnetConfig, make_objective
from pipeline.tasks import FinetuneOptions, ProbingOptions
from pipeline.tokenizer import load_tokenizer

FIXTURES = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")), "fixtures", "eval")
TOKENIZER = os.path.join(SAMPLE_DIR, "tokenizer")
TINY_SWEEP = ["lrs=[1e-3, 1e-4]", "seeds=[0, 1]", "max_steps=2", "batch_size=4"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from helpers import tiny_llama

    tok = load_tokenizer(TOKENIZER)
    out = str(tmp_path_factory.mktemp("model") / "tiny")
    tiny_llama(tok).save_pretrained(out)
    tok.save(out)
    return out


def make_data_dir(root: str) -> str:
    """``root`` with the fixtures plus ``heldout/``: shards (seq_len 64) of the sample corpus' validation split."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(FIXTURES):
        os.symlink(os.path.join(FIXTURES, name), os.path.join(root, name))
    run_job(BuildConfig(inputs=(os.path.join(SAMPLE_DIR, "validation", "**", "*.jsonl.zst"),), tokenizer=TOKENIZER,
                        output=os.path.join(root, "heldout"), seq_len=64, samples_per_shard=256, progress=False))
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return make_data_dir(str(tmp_path_factory.mktemp("evaldata")))


@pytest.fixture(scope="module")
def model(hf_dir):
    return load_model(hf_dir)


def ctx_for(model, data_dir, **kw) -> EvalContext:
    return EvalContext(model, data_dir, batch_size=kw.pop("batch_size", 4), progress=False, **kw)


def run_task(name: str, model, data_dir, *overrides: str, batch_size: int = 4) -> dict:
    """Task ``name``'s result, checked against its spec (tests/unit/test_tasks.py)."""
    options = task_options([name], [f"{name}.{o}" for o in overrides])[name]
    result = TASKS[name].run(ctx_for(model, data_dir, batch_size=batch_size), options)
    check_against_spec(name, result, getattr(options, "split", None))
    return result


def test_load_model_reads_a_plain_hf_dir_as_causal(model, hf_dir):
    assert model.attention == "causal" and not model.reads_previous and model.run_dir is None
    assert load_model(hf_dir, attention="bidirectional").attention == "bidirectional"


def test_pooling_leaves_the_instruction_out():
    hidden = torch.arange(2 * 5 * 1, dtype=torch.float32).view(2, 5, 1)  # row 0: 0..4, row 1: 5..9
    rows = [([1, 7, 8, 9, 2], 2, 4), ([1, 9, 2], 1, 2)]  # (ids, text start, text end): row 0's text is 2, 3
    assert pool(hidden, rows, "mean")[:, 0].tolist() == [2.5, 6.0]
    assert pool(hidden, rows, "weighted_mean")[:, 0].tolist() == pytest.approx([(2 + 2 * 3) / 3, 6.0])
    assert pool(hidden, rows, "last")[:, 0].tolist() == [4.0, 7.0]  # the EOS of each row


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_encode_matches_a_hand_forward_and_ignores_padding(model, attention):
    texts = ["A short one.", "A much longer sentence that needs padding in its batch.", "Mid length text here."]
    instruction = "Given the sentence, find its representation:"
    batched = encode(model, texts, instruction, "mean", attention=attention)  # one padded batch
    single = np.concatenate([encode(model, [t], instruction, "mean", attention=attention)
                             for t in texts])
    np.testing.assert_allclose(batched, single, atol=1e-5)
    tok = model.tokenizer  # layout bos_eos: BOS, instruction + text tokenized as one string, EOS
    (ids,) = tok.encode_batch([instruction + texts[0]])
    skip = len(tok.encode_batch([instruction])[0])
    with torch.no_grad():
        out = model.lm.model(input_ids=torch.tensor([[tok.bos_id, *ids, tok.eos_id]]),
                             is_causal=attention == "causal").last_hidden_state[0]
    np.testing.assert_allclose(batched[0], out[1 + skip:1 + len(ids)].mean(0).numpy(), atol=1e-5)


def test_mteb_runs_the_encoder_through_its_own_evaluation(model, hf_dir):
    """mteb.evaluate on a local STS task (mteb's own mock task class holding the shipped STS-B file; no hub): the
    score is Spearman x100 of the cosine similarity of encode()'s embeddings, with the instruction MTEB's prompt
    lookup picks for the task type; with ``dim``, the embeddings' leading dims."""
    import mteb
    from datasets import Dataset, DatasetDict
    from mteb.mocks.mock_tasks.sts import MockSTSTask

    from pipeline.eval.data import read_rows
    from pipeline.eval.metrics import spearman
    from pipeline.eval.mteb_encoder import MTEBEncoder

    rows = read_rows(os.path.join(FIXTURES, "sts", "stsb.tsv"), "test")
    pairs = {c: [r.get((c,), c) for r in rows] for c in ("sentence1", "sentence2")}
    pairs["score"] = [float(r.get(("score",), "score")) / 5 for r in rows]

    class LocalSTS(MockSTSTask):
        def load_data(self, **kwargs):
            self.dataset = DatasetDict({"test": Dataset.from_dict(pairs)})
            self.data_loaded = True

    instruction = "Retrieve semantically similar text: "
    encoder = MTEBEncoder(model, instructions={"STS": instruction})
    task = LocalSTS()
    assert encoder.get_prompt_name(task.metadata, None) == "STS"
    result = mteb.evaluate(encoder, task, cache=None, show_progress_bar=False)
    (task_result,) = result.task_results
    score = task_result.scores["test"][0]
    a, b = (encode(model, pairs[c], instruction) for c in ("sentence1", "sentence2"))
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert len(rows) == 24 and score["cosine_spearman"] == pytest.approx(spearman(cos, pairs["score"]), abs=1e-6)
    assert task_result.get_score() == pytest.approx(score["main_score"])
    cut = MTEBEncoder(model, instructions={"STS": instruction}, dim=16)  # a Matryoshka model's first 16 dims
    got = cut.encode([{"text": pairs["sentence1"]}], task_metadata=task.metadata, hf_split="test", hf_subset="default")
    assert cut.mteb_model_meta.embed_dim == 16 and got.tolist() == a[:, :16].tolist()
    by_path = MTEBEncoder(hf_dir, None, device="cpu")  # MTEB's (model_name, revision, device=...) form
    assert by_path.mteb_model_meta.embed_dim == model.lm.config.hidden_size and by_path.model.hf_dir == hf_dir


def test_tokenize_words_maps_each_word_to_its_tokens(model):
    words = ["Peter", "visited", "Berlin", "."]
    ((ids, positions),) = tokenize_words(model.tokenizer, [words])
    assert ids[0] == model.tokenizer.bos_id and ids[-1] == model.tokenizer.eos_id
    for word, pos in zip(words, positions):
        assert pos and model.tokenizer.decode([ids[p] for p in pos]).strip() == word


def test_infilling_causal_span_loss_equals_hf_labels(model):
    """The causal baseline's span NLL is HF's own shifted cross-entropy with every non-span label ignored; the
    MAGNET reading equals the magnet objective's MSG loss on the same sample."""
    tok = model.tokenizer
    ids = [tok.bos_id, *tok.encode_batch(["The river rises in the hills and flows south to the sea."])[0],
           tok.eos_id]
    example = Example(ids, 4, 8, "hand")
    nll, count = span_nll(ctx_for(model, ""), [example], "causal")
    labels = torch.full((1, 8), -100)
    labels[0, 4:8] = torch.tensor(ids[4:8])
    with torch.no_grad():
        ref = model.lm(input_ids=torch.tensor([ids[:8]]), labels=labels).loss
    assert count == 4 and nll / count == pytest.approx(float(ref), rel=1e-5)

    n = len(ids)
    span = torch.full((1, n), -1, dtype=torch.int32)
    span[0, 4:8] = 0
    batch = Batch(input_ids=torch.tensor([ids]), doc_ids=torch.zeros((1, n), dtype=torch.int32),
                  mask_rank=torch.full((1, n), int(UNMASKABLE), dtype=torch.int32),
                  mask_draw=torch.zeros((1, n), dtype=torch.int64), span_ids=span, keys=["hand"])
    msg = make_objective(MagnetConfig(mntp_weight=0.0), tok)
    with torch.no_grad():
        out = msg(model.lm, batch)["msg"]
    nll, count = span_nll(ctx_for(model, ""), [example], "magnet")
    assert count == int(out.num_targets) and nll == pytest.approx(float(out.loss_sum), rel=1e-5)


def test_infilling_task(model, data_dir):
    result = run_task("infilling", model, data_dir, "generate=2")["datasets"]
    assert set(result) == {"roc", "wiki"}
    roc = result["roc"]
    assert roc["examples"] == 4 and roc["magnet"]["span_tokens"] == roc["causal"]["span_tokens"] > 0
    assert roc["samples"][0]["gold"].startswith("She followed her grandmother")  # ROC: the middle sentence
    assert roc["magnet"]["perplexity"] == pytest.approx(np.exp(roc["magnet"]["loss"]))


def test_repetition_task_and_scores(model, data_dir):
    # first text: 10 words, 4 of 9 bigrams, 5 of 8 trigrams, 5 of 7 4-grams unique, 2 equal sentences; the second
    # (3 words, 1 sentence) repeats nothing and has no 4-gram, so Rep-4 averages the first alone
    assert repetition_scores(["a b a b a. a b a b a.", "x y z"]) == {
        "rep_sen": pytest.approx(0.25), "rep_2": pytest.approx(5 / 9 / 2), "rep_3": pytest.approx(3 / 8 / 2),
        "rep_4": pytest.approx(2 / 7), "mean_words": 6.5}
    result = run_task("repetition", model, data_dir, "decoding.max_new_tokens=12", "datasets=[repetition/roc.jsonl]")
    assert result["decoding"]["do_sample"] is False and result["decoding"]["max_new_tokens"] == 12
    roc = result["datasets"]["roc"]
    assert roc["continuations"] == 4 and roc["samples"][0]["prefix"] == "Anna wanted to learn to"
    assert 0 <= roc["rep_2"] <= 1
    again = run_task("repetition", model, data_dir, "decoding.max_new_tokens=12", "datasets=[repetition/roc.jsonl]")
    assert again["datasets"]["roc"]["samples"] == roc["samples"]  # greedy: reproducible


def test_intrinsic_tasks_do_not_depend_on_the_batch_size(model, data_dir):
    a = run_task("perplexity", model, data_dir, "max_batches=3", batch_size=4)
    b = run_task("perplexity", model, data_dir, "max_batches=2", batch_size=6)
    assert a["samples"] == b["samples"] == 12
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["perplexity"] == pytest.approx(np.exp(a["loss"]))
    mlm = run_task("mlm", model, data_dir, "max_batches=2", "ratio=0.4")
    mntp = run_task("mntp", model, data_dir, "max_batches=2", "ratio=0.4")
    assert mlm["ratio"] == 0.4 and 0 < mntp["targets"] <= mlm["targets"]  # MNTP never predicts a document start


def test_embedding_tasks(model, data_dir):
    sts = run_task("sts", model, data_dir)
    assert set(sts["datasets"]) == {"stsb", "sickr", "mteb-sts12"}
    assert sts["datasets"]["stsb"]["pairs"] == 24 and -100 <= sts["average"] <= 100
    clustering = run_task("clustering", model, data_dir, "pooling=weighted_mean")
    assert clustering["datasets"]["mteb-topics"]["sets"] == 2 and 0 <= clustering["average"] <= 100


def test_zero_shot_retrieval_ranks_the_pool_with_instructed_queries(model, tmp_path):
    """The held-out plays' reply set (the rule of pipeline.data.prep.pairs_sample): NDCG@10 equals scikit-learn's on
    encode()'s embeddings of "instruction: query" against bare documents; a model recorded with the supervised
    instruction format gets the same prefix, and a query without its instruction another ranking."""
    from sklearn.metrics import ndcg_score

    from pipeline.data.prep.pairs_sample import retrieval_rows
    from pipeline.data.prep.sources import RecordStats, read_texts

    texts = list(read_texts(os.path.join(SAMPLE_DIR, "validation", "chunk1", "example_holdout_0.jsonl.zst"), "text",
                            RecordStats()))
    rows = retrieval_rows(texts, 24)["replies"]
    assert len(rows) == 24 and not {r["query"] for r in rows} & {r["positive"] for r in rows}
    os.makedirs(tmp_path / "zero_shot_retrieval")
    with open(tmp_path / "zero_shot_retrieval" / "replies.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    result = run_task("zero_shot_retrieval", model, str(tmp_path))
    got = result["datasets"]["replies"]
    assert (got["queries"], got["documents"], got["k"]) == (24, 24, 10)
    queries = encode(model, [r["query"] for r in rows], rows[0]["instruction"] + ": ")
    documents = encode(model, [r["positive"] for r in rows], "")
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    expected = 100 * ndcg_score(np.eye(24), unit(queries) @ unit(documents).T, k=10)
    assert got["ndcg"] == pytest.approx(expected, abs=1e-6) and result["average"] == got["ndcg"]
    first = [1 / (1 + int(np.argmax(order == i))) for i, order in
             enumerate(np.argsort(-(unit(queries) @ unit(documents).T), axis=1, kind="stable"))]
    assert got["mrr"] == pytest.approx(100 * np.mean([f if f >= 0.1 else 0.0 for f in first]), abs=1e-9)
    supervised = dataclasses.replace(model, record=dataclasses.replace(model.record,
                                                                       instruction_format="{instruction}: "))
    assert run_task("zero_shot_retrieval", supervised, str(tmp_path))["average"] == pytest.approx(got["ndcg"])
    bare = run_task("zero_shot_retrieval", model, str(tmp_path), 'instruction=""')["average"]
    assert bare != pytest.approx(got["ndcg"])


def test_probing_task_reads_mntp_models_one_position_earlier(model, data_dir):
    same = run_task("probing", model, data_dir, "max_epochs=2")
    assert set(same["tasks"]) == {"pos", "chunk", "ner"} and same["reads_previous"] is False
    assert "f1" in same["tasks"]["ner"] and "f1" not in same["tasks"]["pos"]
    mntp_model = dataclasses.replace(model, record=dataclasses.replace(model.record, reads_previous=True))
    shifted = run_task("probing", mntp_model, data_dir, "max_epochs=2")
    assert shifted["reads_previous"] is True
    assert same["tasks"]["chunk"]["train_words"] == 57  # the fixture's 9 training sentences
    cut = run_task("probing", model, data_dir, "max_epochs=1", "max_train_sentences=8", "columns={chunk: 2}")
    assert cut["tasks"]["chunk"]["train_words"] == 57 - 8  # the first 8


def test_probe_features_of_a_sentence_do_not_depend_on_its_batch(model, data_dir):
    """Sentences are batched by length (less padding): each keeps its own features, in the input's order."""
    from pipeline.eval.data import read_conll
    from pipeline.eval.probing import word_features

    sentences = read_conll(os.path.join(data_dir, "conll", "train.txt"))
    assert len({len(s.words) for s in sentences}) > 1  # lengths differ, so sorting reorders them
    batched, skipped = word_features(ctx_for(model, data_dir, max_tokens=64), sentences, ProbingOptions(), 0)
    alone = [word_features(ctx_for(model, data_dir), [s], ProbingOptions(), 0)[0][0]
             for s in sentences]
    assert skipped == 0 and [f.shape[0] for f in batched] == [len(s.words) for s in sentences]
    for got, want in zip(batched, alone):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("name", ["classification", "token_classification", "qa", "retrieval"])
def test_finetune_sweep_picks_the_lr_on_validation(model, data_dir, name):
    datasets = ["datasets=[sst2, mnli]"] if name == "classification" else []  # mnli: no dev file, train is split
    result = run_task(name, model, data_dir, *TINY_SWEEP, *datasets)
    for dataset in result["datasets"].values():
        runs = dataset["runs"]
        assert len(runs) == 4 and {r["steps"] for r in runs} == {2}
        mean_val = {lr: np.mean([r["validation"] for r in runs if r["lr"] == lr]) for lr in (1e-3, 1e-4)}
        assert dataset["best_lr"] == max(mean_val, key=mean_val.get)
        test = [r["test"] for r in runs if r["lr"] == dataset["best_lr"]]
        assert dataset["test"]["mean"] == pytest.approx(np.mean(test)) and dataset["test"]["n"] == 2
    assert result["attention"] == "bidirectional"


def test_sweep_helpers():
    train, val = split_train(list(range(40)))
    assert len(val) == 2 and sorted(train + val) == list(range(40))
    assert split_train(list(range(40))) == (train, val)  # seeded
    assert [round(linear_warmup_decay(s, 10, 0.1), 3) for s in (0, 1, 5, 9)] == [1.0, 1.0, 0.556, 0.111]


def test_qa_answer_decoding(model):
    task = ExtractiveQA(ctx_for(model, ""), FinetuneOptions())
    task.opts.max_answer_tokens = 2
    text = "Where?\nIn Paris today"
    offsets = [(0, 0), (0, 6), (7, 9), (10, 15), (16, 21), (0, 0)]
    q = Question([1, 5, 6, 7, 8, 2], offsets, 2, text, ["Paris"], 3, 3)
    start = torch.tensor([0.0, 9.0, 1.0, 5.0, 0.0, -9.0])
    end = torch.tensor([0.0, 9.0, 0.0, 4.0, 6.0, -9.0])
    # "Paris today" (3..4) scores 11 > "Paris" 9; the question token (1) is outside the context
    start[1] = end[1] = float("-inf")
    assert task.answer(q, start, end) == "Paris today"
    start[0], end[0] = 10.0, 10.0  # no-answer position beats every span
    assert task.answer(q, start, end) == ""


def test_every_embedding_task_and_launch_evaluate_take_a_dimension(model, hf_dir, data_dir, tmp_path, capsys):
    """``launch/evaluate.py --dim N`` (a Matryoshka model's leading dims): STS-B's score is the one of encode()'s
    embeddings cut to N, the results record N, and a width the model lacks is one line and exit 2 before any task;
    each embedding task passes the dimension to encode() (a width of 65 fails there alike)."""
    from pipeline.eval.data import read_rows
    from pipeline.eval.embeddings import cosine
    from pipeline.eval.metrics import spearman
    from pipeline.eval.runner import main as evaluate_main

    out = tmp_path / "results.json"
    argv = ["--model", hf_dir, "--tasks", "sts", "--data-dir", FIXTURES, "--set", "sts.datasets=[sts/stsb.tsv]",
            "--no-progress", "--out", str(out)]
    assert evaluate_main([*argv, "--dim", "16"]) == 0
    results = json.load(open(out))
    rows = read_rows(os.path.join(FIXTURES, "sts", "stsb.tsv"), "test")
    a, b = (encode(model, [r.get((c,), c) for r in rows]) for c in ("sentence1", "sentence2"))
    gold = [float(r.get(("score",), "score")) for r in rows]
    assert results["config"]["dim"] == 16 and results["headline"]["sts/stsb"] == pytest.approx(
        100 * spearman(cosine(a[:, :16], b[:, :16]), gold), abs=1e-6)
    assert results["headline"]["sts/stsb"] != pytest.approx(100 * spearman(cosine(a, b), gold), abs=1e-3)
    capsys.readouterr()
    assert evaluate_main([*argv, "--dim", "65"]) == 2
    assert capsys.readouterr().err.strip() == "error: --dim 65: the model's embeddings have 64 dims; pass at most 64"
    os.makedirs(tmp_path / "zero_shot_retrieval")
    with open(tmp_path / "zero_shot_retrieval" / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps({"query": f"Question {i}?", "positive": f"Answer {i}."}) + "\n" for i in range(4))
    for name, where in (("sts", data_dir), ("clustering", data_dir), ("zero_shot_retrieval", str(tmp_path))):
        with pytest.raises(ValueError, match="dim 65: the model's embeddings have 64 dims"):
            TASKS[name].run(ctx_for(model, where, dim=65), task_options([name], [])[name])
    # retrieval at a width the model has: the queries' matrix is as wide as the cut (it was the model's: a broadcast
    # error), and the ranking is the cut embeddings'
    cut = TASKS["zero_shot_retrieval"].run(ctx_for(model, str(tmp_path), dim=16),
                                           task_options(["zero_shot_retrieval"], [])["zero_shot_retrieval"])
    queries = encode(model, [f"Question {i}?" for i in range(4)], dim=16)
    documents = encode(model, [f"Answer {i}." for i in range(4)], dim=16)
    assert cut["datasets"]["pairs"]["ndcg"] == pytest.approx(ndcg(queries, documents, [{i: 1} for i in range(4)], 10))
