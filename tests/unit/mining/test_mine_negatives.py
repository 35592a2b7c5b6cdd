"""Hard-negative mining (pipeline/mining/): the negatives equal sentence-transformers' ``mine_hard_negatives`` on the
same model directory, corpus and settings; settings out of range stop in one line before a model is loaded; the
command writes the mined rows, its record, pair shards, and resumes."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import warm
from helpers import REPO, cpu_env, tiny_llama
from shard_corpus import TOKENIZER

from pipeline.config import from_dict
from pipeline.data.format.index import MANIFEST, load_index
from pipeline.eval import load_model
from pipeline.eval.encode import rows_for
from pipeline.eval.forward import length_batches
from pipeline.experiment import ExperimentConfig
from pipeline.export.hf import save_hf
from pipeline.export.record import EncoderRecord
from pipeline.export.sentence_transformers import st_record
from pipeline.mining.cli import Embedder, MineConfig, Task, main, mined_rows, read_pairs
from pipeline.mining.negatives import INSTALL, MiningError, MiningSettings, mine

PAIRS = os.path.join(REPO, "data", "sample", "pairs")
# (range_min, range_max, relative_margin, absolute_margin, max_score): no filter; skip the nearest two with
# NV-Retriever's 5 % margin; a window and an absolute margin with a cap
SETTINGS = [dict(), dict(range_min=2, relative_margin=0.05), dict(range_max=20, absolute_margin=0.0, max_score=0.9)]
BUDGET = 256  # encode()'s padded tokens per batch in the 2-rank test: many batches of the sample's short texts
NO_FAISS = "faiss-cpu is not installed (the mining extra, which dev includes, has it)"


@pytest.fixture(scope="module")
def st_dir(tokenizer, tmp_path_factory) -> str:
    """A seeded tiny model exported as a sentence-transformers directory (mean pooling over the text alone)."""
    lm = tiny_llama(tokenizer, seed=3)
    record = st_record(EncoderRecord(attention="bidirectional", pooling="mean", layout="bos_eos"))
    return save_hf(lm, lm.state_dict(), tokenizer, str(tmp_path_factory.mktemp("st") / "model"), record,
                   from_dict(ExperimentConfig, {}), 0, sentence_transformers=True)


def test_negatives_equal_sentence_transformers_mine_hard_negatives(st_dir):
    """On replies.jsonl (each query is the previous row's positive, so a query's own text is in the corpus) plus
    rows that repeat queries with other positives (several positives a query), for each of ``SETTINGS``, the rows
    kept and each row's negatives, in order, are those of ``mine_hard_negatives(..., corpus=the rows' positives and
    negatives, output_format="n-tuple")`` on the same directory, through either encoder: sentence-transformers'
    (the same embeddings, so the same scores and ties, bit for bit) and this project's ``encode`` (embeddings within
    ~1e-6 of its, so equal here; a near tie within that could rank the other way), called per side or as the
    command calls it (``Embedder.task``: one pass over the corpus and the queries not in it). Differences, not selections: the
    mined rows keep their file order (sentence-transformers groups a repeated query's rows together), and a row
    keeps every field of its input."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    rows = read_pairs(os.path.join(PAIRS, "replies.jsonl"))
    rows += [(f"extra:{i}", {**r, "positive": rows[i + 40][1]["positive"], "negative": []})
             for i, (_, r) in enumerate(rows[:6])]
    task = Task.of(rows)
    assert task.max_positives == 2 and sum(i >= 0 for i in task.query_in_corpus) > 100
    st = SentenceTransformer(st_dir, device="cpu")
    embedded = {}
    for encoder in ("sentence-transformers", "pipeline"):
        embed = Embedder(MineConfig((), st_dir, "", encoder=encoder, progress=False))
        embedded[encoder] = embed(task.queries, query=True), embed(task.corpus, query=False)
    embedded["pipeline, one pass"] = embed.task(task)  # the command's: the corpus and the other queries at once
    kept = []
    for kw in SETTINGS:
        settings = MiningSettings(num_negatives=3, **kw)
        reference = mine_hard_negatives(
            Dataset.from_dict({"query": [r["query"] for _, r in rows], "positive": [r["positive"] for _, r in rows]}),
            st, corpus=task.corpus, num_negatives=3, output_format="n-tuple", verbose=False, **kw)
        expected = sorted((r["query"], r["positive"], r["negative_1"], r["negative_2"], r["negative_3"])
                          for r in reference)
        for encoder, (queries, corpus) in embedded.items():
            mined = mine(queries, corpus, task.positives, task.query_in_corpus, task.max_positives, settings)
            ours = [(r["query"], r["positive"], *r["negative"]) for r in mined_rows(rows, task, mined)]
            assert sorted(ours) == expected, (encoder, kw)
        kept.append(len(expected))
    assert kept[0] == len(rows) > kept[1] > 0 and kept[2] > 0  # the filters bite, and leave rows to compare


def test_faiss_search_chooses_the_negatives_of_the_torch_search(st_dir):
    """``use_faiss`` (faiss' IndexFlatIP on the unit rows, a few queries a search) on the rows and settings of the
    test above: the same negatives, scores within float rounding, and the same candidates removed by each filter."""
    faiss = pytest.importorskip("faiss", reason=NO_FAISS)
    rows = read_pairs(os.path.join(PAIRS, "replies.jsonl"))
    rows += [(f"extra:{i}", {**r, "positive": rows[i + 40][1]["positive"], "negative": []})
             for i, (_, r) in enumerate(rows[:6])]
    task = Task.of(rows)
    embedded = Embedder(MineConfig((), st_dir, "", progress=False)).task(task)
    for kw in SETTINGS:
        torch_, faiss_ = (mine(*embedded, task.positives, task.query_in_corpus, task.max_positives,
                               MiningSettings(num_negatives=3, use_faiss=use, faiss_batch_size=7, **kw))
                          for use in (False, True))
        assert torch_.indices.tolist() == faiss_.indices.tolist() and torch_.skipped == faiss_.skipped, kw
        assert (torch_.scores - faiss_.scores).nan_to_num(posinf=0, neginf=0).abs().max() < 1e-6
    assert faiss.__version__  # the record names it


def test_use_faiss_writes_the_torch_searchs_rows_and_records_the_search(st_dir, tmp_path):
    """The command with and without ``--use-faiss`` on the sample's pairs files: the mined files are equal byte for
    byte; mining.json differs in the search it names (the miner, with faiss' version) and the setting alone."""
    faiss = pytest.importorskip("faiss", reason=NO_FAISS)
    argv = ["--input", os.path.join(PAIRS, "*.jsonl"), "--model", st_dir, "--range-min", "1", "--relative-margin",
            "0.05", "--no-progress"]
    assert main([*argv, "--output", str(tmp_path / "torch")]) == 0
    assert main([*argv, "--output", str(tmp_path / "faiss"), "--use-faiss", "--faiss-batch-size", "16"]) == 0
    records = {}
    for search in ("torch", "faiss"):
        records[search] = json.loads((tmp_path / search / "mining.json").read_text())
        for name in ("continuations.jsonl", "replies.jsonl"):
            assert records[search]["files"][name]["kept"] > 0
    for name in ("continuations.jsonl", "replies.jsonl"):
        assert (tmp_path / "torch" / name).read_bytes() == (tmp_path / "faiss" / name).read_bytes()
    assert records["torch"]["miner"].endswith("(top, n-tuple), exact torch top-k")
    assert records["faiss"]["miner"].endswith(f"(top, n-tuple), exact faiss IndexFlatIP search (faiss "
                                              f"{faiss.__version__})")
    assert records["faiss"]["settings"] == {**records["torch"]["settings"], "use_faiss": True, "faiss_batch_size": 16}
    assert {k: v for k, v in records["faiss"].items() if k != "miner" and k != "settings"} == \
        {k: v for k, v in records["torch"].items() if k != "miner" and k != "settings"}


def test_use_faiss_without_faiss_stops_in_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    """Where faiss is not installed, ``--use-faiss`` is refused before the inputs are read or a model is loaded (the
    model named does not exist), one line naming the pip install, exit 2; ``mine(use_faiss=True)`` raises it too
    (it searches with faiss, not torch's top-k again)."""
    for name in [m for m in sys.modules if m == "faiss" or m.startswith("faiss.")] or ["faiss"]:
        monkeypatch.setitem(sys.modules, name, None)  # import faiss raises ImportError, as where not installed
    argv = ["--input", os.path.join(PAIRS, "replies.jsonl"), "--model", str(tmp_path / "none"), "--output",
            str(tmp_path / "out"), "--use-faiss"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --use-faiss needs faiss-cpu, which is not installed: {INSTALL} (or pip install faiss-cpu), or leave "
        "--use-faiss out for the exact torch top-k"]
    assert INSTALL == "pip install 'decoder-encoders[mining]'" and not os.path.exists(tmp_path / "out")
    x = torch.eye(4)
    assert mine(x, x, [[0], [1], [2], [3]], [-1] * 4, 1, MiningSettings(num_negatives=1)).complete.all()
    with pytest.raises(MiningError, match=r"--use-faiss needs faiss-cpu"):
        mine(x, x, [[0], [1], [2], [3]], [-1] * 4, 1, MiningSettings(num_negatives=1, use_faiss=True))


@pytest.mark.parametrize("args, message", [
    (["--num-negatives", "0"], "--num-negatives must be >= 1, got 0"),
    (["--range-min", "3", "--range-max", "4"], "--range-max 4 leaves 1 candidates after --range-min 3, fewer than "
                                               "--num-negatives 3; raise --range-max to at least 6"),
    (["--relative-margin", "1.5"], "--relative-margin must be in [0, 1)"),
    (["--max-score", "2"], "--max-score must be a cosine in [-1, 1], got 2.0"),
    (["--min-score", "0.5", "--max-score", "0.2"], "--min-score 0.5 must be below --max-score 0.2"),
    (["--faiss-batch-size", "0"], "--faiss-batch-size must be >= 1, got 0"),
    (["--input", "@BAD.jsonl"], "BAD.jsonl:2: positive missing, empty or not text"),
    (["--input", "@NEG.jsonl"], "NEG.jsonl:1: negative missing, empty or not text"),
    (["--input", "@EMPTY.jsonl"], "EMPTY.jsonl: no rows; a pairs file holds one {\"query\", \"positive\"} object "
                                  "per line"),
    (["--input", "@NOTHING*.jsonl"], "--input 'NOTHING*.jsonl' matches no file; check the path or quote the glob"),
    (["--input", "@NOTES.txt"], "NOTES.txt: pairs are jsonl rows (.jsonl"),
    (["--input", "@a/x.jsonl", "@b/x.jsonl"], "two inputs are named x.jsonl; each is written to OUTPUT under its "
                                              "name (and is its task): rename one"),
    (["--input", "@units"], "units: not a pair shard directory (built without --pairs); pass pairs files or a "
                            "directory of build_shards.py --pairs"),
])
def test_settings_out_of_range_stop_in_one_line_before_a_model_is_loaded(tmp_path, capsys, args, message):
    """The model named does not exist: each refusal of a setting or an input comes before anything would load it
    (the model's own check comes after), one line, exit 2. ``@`` stands for the test's directory."""
    row = '{"query": "q", "positive": "p"}\n'
    for name, text in (("BAD.jsonl", row + '{"query": "q", "positive": ""}\n'), ("EMPTY.jsonl", ""),
                       ("NEG.jsonl", '{"query": "q", "positive": "p", "negative": ["n", " "]}\n'),
                       ("NOTES.txt", row), ("a/x.jsonl", row), ("b/x.jsonl", row),
                       (f"units/{MANIFEST}", json.dumps({"settings": {"units": True}}))):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    args = [a.replace("@", f"{tmp_path}/") for a in args]
    inputs = [] if "--input" in args else ["--input", os.path.join(PAIRS, "replies.jsonl")]
    assert main([*inputs, "--model", str(tmp_path / "none"), "--output", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err.replace(str(tmp_path) + "/", ""), err
    assert not os.path.exists(tmp_path / "out")


def test_mining_a_pair_shard_directory_writes_rows_record_and_shards_and_resumes(st_dir, build_shards, tmp_path,
                                                                                capsys):
    """The input is a pair shard directory (its manifest names its pairs files and tokenizer): the mined files keep
    each kept row's fields with 2 mined negatives (never its positive or query), mining.json records the miner, the
    model read (``--encoder auto``: this project's export, so its ``encode``) and every setting,
    the pair shards of the mined rows hold one sample a kept row with t = 4 texts and the record beside their
    manifest; run again, nothing is mined and the bytes stay."""
    shards = build_shards(inputs=(os.path.join(PAIRS, "*.jsonl"),), pairs=True, seq_len=32,
                          instructions=os.path.join(PAIRS, "instructions.json"))
    out, mined_shards = tmp_path / "mined", tmp_path / "shards"
    argv = ["--input", shards, "--model", st_dir, "--output", str(out), "--num-negatives", "2", "--range-min", "1",
            "--shards", str(mined_shards), "--no-progress"]
    assert main(argv) == 0
    record = json.loads((out / "mining.json").read_text())
    assert record["settings"]["range_min"] == 1 and record["settings"]["num_negatives"] == 2
    assert record["model_read"]["encoder"] == "pipeline"  # auto: the directory is this project's export (its record)
    assert record["model_read"]["record"]["layout"] == "text" and "sentence-transformers" in record["miner"]
    kept = 0
    for name in ("continuations.jsonl", "replies.jsonl"):
        given = [r for _, r in read_pairs(os.path.join(PAIRS, name))]
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert record["files"][name]["kept"] == len(rows) > 0 and record["files"][name]["rows"] == len(given)
        assert all(len(r["negative"]) == 2 and r["positive"] not in r["negative"] and r["query"] not in r["negative"]
                   for r in rows)
        kept += len(rows)
    index = load_index(str(mined_shards))
    assert index.num_samples == kept
    assert json.loads((mined_shards / "mining.json").read_text()) == record
    manifest = json.loads((mined_shards / "manifest.json").read_text())["settings"]
    assert manifest["pairs"]["slots"] == 4 and manifest["pairs"]["instructions"]  # the input shards' table
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(argv) == 0
    assert "every file is mined already" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_two_ranks_write_the_bytes_of_one_process(st_dir, tmp_path):
    """``data_prep/mine_negatives.py`` on 2 CPU ranks (forked from the warm process, torchrun's environment):
    each rank encodes every other batch of each file's texts (a small ``--max-tokens``, so there are many), rank 0
    gathers them, mines and writes; the mined files, mining.json and the pair shards equal one process's, byte for
    byte (the shards' manifest but for the mined files' mtimes, which it records), and only rank 0 reports."""
    model = load_model(st_dir)
    texts = Task.of(read_pairs(os.path.join(PAIRS, "replies.jsonl"))).corpus
    assert len(length_batches([len(r[0]) for r in rows_for(model, texts, "", 512, "text")], BUDGET)) > 4
    out, shards = tmp_path / "mined", tmp_path / "shards"
    argv = ["--input", os.path.join(PAIRS, "*.jsonl"), "--model", st_dir, "--output", str(out), "--range-min", "1",
            "--relative-margin", "0.05", "--max-tokens", str(BUDGET), "--shards", str(shards), "--tokenizer",
            TOKENIZER, "--max-text-tokens", "32", "--no-progress"]

    def written() -> dict[str, bytes]:
        files = {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
        manifest = json.loads(files.pop("shards/manifest.json"))
        assert [f.pop("mtime_ns") for f in manifest["input_files"]]  # when the mined files were written
        return files | {"manifest": manifest}

    assert main(argv) == 0
    one = written()
    assert {"mined/replies.jsonl", "mined/continuations.jsonl", "mined/mining.json", "shards/mining.json"} < set(one)
    shutil.rmtree(out), shutil.rmtree(shards)
    proc = warm.run(os.path.join(REPO, "data_prep", "mine_negatives.py"), argv, nproc=2, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert written() == one
    assert proc.stdout.count("replies.jsonl: ") == 1


def test_sentence_transformers_encoder_under_ranks_stops_in_one_line(st_dir, tmp_path, capsys, monkeypatch):
    """Its encode runs on one process: under torchrun's WORLD_SIZE the command refuses before a model is loaded."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--input", os.path.join(PAIRS, "replies.jsonl"), "--model", st_dir, "--output", str(tmp_path / "out"),
            "--encoder", "sentence-transformers"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs on one process: launch without torchrun, or pass --encoder pipeline" in err
    assert not os.path.exists(tmp_path / "out")
