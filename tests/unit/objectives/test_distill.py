"""Embedding distillation: the KL and cosine/MSE terms against a hand computation, the teacher's embeddings of pair
shards stored once (data_prep/teacher_embed.py) and read back by sample key, a student distilled from a fixed
teacher on the sample moving toward it, and the one-line refusals of a teacher that does not match the shards."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, tiny_llama

from pipeline.config import ConfigError, from_dict
from pipeline.data.format.index import load_index
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.format.teacher import RECORD, TeacherError, check_teacher, load_teacher
from pipeline.data.loading.batch import collate
from pipeline.experiment import ExperimentConfig
from pipeline.export.hf import save_hf
from pipeline.export.record import EncoderRecord
from pipeline.export.summary import objective_words, phases
from pipeline.mining.teacher import embed_shards, main
from pipeline.objectives import Distill, DistillConfig
from pipeline.objectives.distill import PROJECTION, embedding_term, similarity_kl
from pipeline.train.shard_checks import check_teachers

PAIRS = os.path.join(REPO, "data", "sample", "pairs")


def test_terms_equal_a_hand_computation():
    """1 - cosine, the mean squared error, and KL(teacher || student) of each query's softmax over its cosine
    similarities at temperature 0.5, written out with math on plain lists."""
    s = [[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]]
    t = [[0.0, 1.0], [0.8, 0.6], [0.0, 1.0]]
    cos = [sum(a * b for a, b in zip(x, y)) / math.hypot(*x) / math.hypot(*y) for x, y in zip(s, t)]
    mse = [sum((a - b) ** 2 for a, b in zip(x, y)) / 2 for x, y in zip(s, t)]
    st, tt = torch.tensor(s, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)
    assert embedding_term(st, tt, "cosine").tolist() == pytest.approx([1 - c for c in cos], abs=1e-12)
    assert embedding_term(st, tt, "mse").tolist() == pytest.approx(mse, abs=1e-12)

    def probs(q, cands, tau):
        def cosine(x, y):
            return sum(a * b for a, b in zip(x, y)) / math.hypot(*x) / math.hypot(*y)
        e = [math.exp(cosine(q, c) / tau) for c in cands]
        return [v / sum(e) for v in e]

    queries_s, cands_s = s[:2], [s[2], s[0], s[1]]
    queries_t, cands_t = t[:2], [t[2], t[0], t[1]]
    want = []
    for qs, qt in zip(queries_s, queries_t):
        p, q = probs(qt, cands_t, 0.5), probs(qs, cands_s, 0.5)
        want.append(sum(a * math.log(a / b) for a, b in zip(p, q)))
    got = similarity_kl(st[:2], st[[2, 0, 1]], tt[:2], tt[[2, 0, 1]], 0.5)
    assert got.tolist() == pytest.approx(want, abs=1e-12) and all(w > 0 for w in want)
    assert similarity_kl(tt[:2], tt, tt[:2], tt, 0.5).abs().max() < 1e-12  # a student equal to its teacher: 0


@pytest.fixture(scope="module")
def teacher_model(tokenizer, tmp_path_factory) -> str:
    """A seeded tiny model exported as this project's encoder (mean pooling over the text alone): the teacher."""
    lm = tiny_llama(tokenizer, seed=7)
    return save_hf(lm, lm.state_dict(), tokenizer, str(tmp_path_factory.mktemp("teacher") / "model"),
                   EncoderRecord(attention="bidirectional", pooling="mean", layout="bos_eos"),
                   from_dict(ExperimentConfig, {}), 0)


@pytest.fixture(scope="module")
def pairs(build_shards) -> str:
    return build_shards(inputs=(os.path.join(PAIRS, "*.jsonl"),), pairs=True, seq_len=32, samples_per_shard=100,
                        instructions=os.path.join(PAIRS, "instructions.json"))


@pytest.fixture(scope="module")
def teacher(pairs, teacher_model, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("embedded") / "teacher")
    assert main(["--shards", pairs, "--model", teacher_model, "--output", out, "--no-progress"]) == 0
    return out


def test_teacher_embeddings_are_stored_once_by_sample_key(pairs, teacher, teacher_model):
    """teacher.json names the teacher, its dims, pooling and normalisation and the shards' fingerprint and count;
    each text column is [N, dim] unit rows, looked up by sample key; the same job again writes the same bytes."""
    index = load_index(pairs)
    record = json.loads(open(os.path.join(teacher, RECORD)).read())
    assert record["shards_fingerprint"] == index.fingerprint and record["samples"] == index.num_samples == 256
    assert record["dim"] == 64 and record["normalized"] and record["pooling"] == "mean" and record["slots"] == 3
    assert record["teacher"]["path"] == os.path.abspath(teacher_model) and record["teacher"]["encoder"] == "pipeline"
    loaded = load_teacher(teacher, 3)
    assert loaded.embeddings.shape == (256, 3, 64)
    assert np.allclose(np.linalg.norm(loaded.embeddings, axis=-1), 1, atol=1e-5)
    samples = list(ShardReader(index.shards[1].path))[:2]  # from the second shard: keys, not positions
    rows = loaded.lookup([s.key for s in samples])
    assert np.array_equal(rows, loaded.embeddings[[loaded.rows[s.key] for s in samples]])
    assert not np.allclose(rows[0], rows[1])
    before = {n: open(os.path.join(teacher, n), "rb").read() for n in sorted(os.listdir(teacher))}
    embed_shards(pairs, teacher_model, teacher, progress=False)
    assert {n: open(os.path.join(teacher, n), "rb").read() for n in sorted(os.listdir(teacher))} == before


def student_step_losses(objective: Distill, model, batch) -> float:
    out = objective(model, batch)
    return sum(objective.loss_weights[n] * o.loss_sum / o.num_targets for n, o in out.items())


def similarity_gap(model, objective: Distill, batch, teacher_rows: torch.Tensor) -> float:
    """How far the student's query-candidate cosine matrix lies from the teacher's (Frobenius norm), each row less its
    mean: the softmax (and so the KL) sees a row up to a shift, and a tiny random student's cosines all rise at
    first (anisotropy), which the raw matrices would count as moving away."""
    with torch.no_grad():
        e = objective.slots.embed(model, batch).view(len(batch.keys), 3, -1)

    def sims(x):
        m = F.normalize(x[:, 0], dim=-1) @ F.normalize(x[:, 1:].flatten(0, 1), dim=-1).T
        return m - m.mean(-1, keepdim=True)

    return float((sims(e) - sims(teacher_rows)).norm())


@pytest.mark.parametrize("loss, dim", [("cosine", 64), ("mse", 32)])
def test_student_distilled_from_a_fixed_teacher_moves_toward_it(tokenizer, pairs, teacher, tmp_path, loss, dim):
    """12 AdamW steps on 12 rows of the sample's pairs: the loss falls by half and the student's similarity matrix
    gets closer to the teacher's. With a teacher 32 wide (its first 32 dims, re-normalised) the student's 64 dims
    go through the learned projection, which the export leaves out."""
    if dim != 64:
        cut = str(tmp_path / "teacher32")
        shutil.copytree(teacher, cut)
        for name in ("query", "positive", "negative1"):
            full = np.load(os.path.join(cut, f"{name}.npy"))[:, :dim]
            np.save(os.path.join(cut, f"{name}.npy"), full / np.linalg.norm(full, axis=-1, keepdims=True))
        record = json.loads(open(os.path.join(cut, RECORD)).read()) | {"dim": dim}
        open(os.path.join(cut, RECORD), "w").write(json.dumps(record))
        teacher = cut
    index = load_index(pairs)
    batch = collate(list(ShardReader(index.shards[0].path))[:12])
    model = tiny_llama(tokenizer, seed=0)
    objective = Distill(DistillConfig(teacher=teacher, embedding_loss=loss, temperature=0.1))
    objective.attach(model)
    assert hasattr(model, PROJECTION) == (dim != 64)
    teacher_rows = torch.from_numpy(objective.load(3).lookup(batch.keys))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    first_gap = similarity_gap(model, objective, batch, teacher_rows)
    losses = []
    for _ in range(12):
        loss_value = student_step_losses(objective, model, batch)
        optimizer.zero_grad()
        loss_value.backward()
        optimizer.step()
        losses.append(loss_value.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert similarity_gap(model, objective, batch, teacher_rows) < 0.7 * first_gap
    if dim != 64:
        assert all(k.startswith(PROJECTION) for k in model._keys_to_ignore_on_save if PROJECTION in k)


def test_a_teacher_that_does_not_match_the_shards_is_refused_in_one_line(pairs, teacher, tmp_path):
    index = load_index(pairs)
    check_teacher(teacher, index.fingerprint, index.num_samples, 3)  # the shards it embedded: accepted
    with pytest.raises(TeacherError, match=r"fingerprint .*, but data.pair_shards has .*teacher_embed.py") as e:
        check_teacher(teacher, "0" * 64, index.num_samples, 3)
    assert "\n" not in str(e.value)
    with pytest.raises(TeacherError, match="256 teacher rows, but data.pair_shards holds 255 samples"):
        check_teacher(teacher, index.fingerprint, 255, 3)
    with pytest.raises(TeacherError, match=r"negative2.npy: missing \(the shards have 4 text columns\)"):
        check_teacher(teacher, index.fingerprint, index.num_samples, 4)
    with pytest.raises(TeacherError, match="teacher.json: no teacher record; run data_prep/teacher_embed.py"):
        check_teacher(str(tmp_path), index.fingerprint, index.num_samples, 3)
    # preflight's check of the experiment (launch/train.py, before a model is built): the objective's field named
    exp = from_dict(ExperimentConfig, {"phases": [{"objectives": [{"name": "supervised"},
                                                                  {"name": "distill", "teacher": str(tmp_path)}]}]})
    with pytest.raises(ConfigError, match=r"^phases\[0\].objectives\[1\].teacher: .*teacher.json: no teacher record"):
        check_teachers(exp, index)
    check_teachers(replace(exp, phases=(replace(exp.phases[0], objectives=(DistillConfig(teacher=teacher),)),)),
                   index)
    for objective, message in (({"name": "distill"}, r"^phases\[0\].objectives\[0\].teacher: missing"),
                               ({"name": "distill", "teacher": teacher, "embedding_weight": 0, "kl_weight": 0},
                                r"^phases\[0\].objectives\[0\].embedding_weight and .*both 0")):
        with pytest.raises(ConfigError, match=message):
            from_dict(ExperimentConfig, {"phases": [{"objectives": [objective]}]})


def test_the_model_card_names_the_teacher(teacher, tmp_path):
    """The card's account of a distill phase names the teacher its record names (path, encoder, width), and says
    so when the record is not where the run read it."""
    exp = from_dict(ExperimentConfig, {"phases": [{"objectives": [{"name": "distill", "teacher": teacher,
                                                                   "embedding_loss": "mse"}]}]})
    words = phases(exp)
    assert "embedding distillation from the teacher `model` (pipeline encoder, 64 dims, mean pooling)" in words
    assert "mean squared error" in words and "temperature 0.05 (weight 1)" in words
    assert f"`{os.path.basename(tmp_path)}` (teacher.json not found at export)" in \
        objective_words(DistillConfig(teacher=str(tmp_path)))
