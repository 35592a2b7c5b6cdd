"""The tokenizer loader, the shipped sample tokenizer and its training (data_prep/train_tokenizer.py), on real files."""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil

import numpy as np
import pytest
import sentencepiece as spm
import zstandard
from sentencepiece import sentencepiece_model_pb2
from transformers import AutoTokenizer

from pipeline.data.prep import tokenizer_training
from pipeline.data.prep.sources import RecordStats, read_texts
from pipeline.tokenizer import load_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
SAMPLE = os.path.join(ROOT, "data", "sample")
SHIPPED = os.path.join(SAMPLE, "tokenizer")
HOLDOUT = os.path.join(SAMPLE, "validation", "chunk1", "example_holdout_0.jsonl.zst")
FORGED = "a literal <s> and </s>, a <pad> and a <mask>, an <unk>"


@pytest.fixture(scope="module")
def holdout() -> list[str]:
    return list(read_texts(HOLDOUT, "text", RecordStats()))


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer(SHIPPED)


def _hf_ids(tok, texts: list[str]) -> list[list[int]]:
    return tok.hf(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _records(path: str) -> list[dict]:
    with open(path, "rb") as f:
        return [json.loads(line) for line in zstandard.ZstdDecompressor().stream_reader(f).read().splitlines()]


def test_sample_corpus_is_slimpajama_shaped_with_whole_works_held_out():
    files = sorted(glob.glob(os.path.join(SAMPLE, "train", "chunk*", "example_train_*.jsonl.zst")))
    assert len(files) == 4
    titles = {}
    for path in [*files, HOLDOUT]:
        records = _records(path)
        assert len(records) > 40
        assert all(r["meta"]["redpajama_set_name"] == "RedPajamaBook" and r["text"].strip() for r in records)
        assert "gutenberg" not in "".join(r["text"] for r in records).lower()
        stats = RecordStats()
        assert len(list(read_texts(path, "text", stats))) == len(records) and stats.num_bad == 0
        titles[path] = {r["meta"]["title"] for r in records}
    assert titles[HOLDOUT] and not titles[HOLDOUT] & set().union(*(titles[f] for f in files))


def test_shipped_tokenizer_specials(shipped):
    info = shipped.info
    assert shipped.backend == "sentencepiece"
    assert info.vocab_size == len(shipped.hf) == 8000
    ids = (info.bos_id, info.eos_id, info.pad_id, info.mask_id)
    assert None not in ids and len(set(ids)) == 4
    assert set(ids) | {shipped.hf.unk_token_id} <= set(info.special_ids)
    assert [shipped.hf.convert_ids_to_tokens(i) for i in ids] == ["<s>", "</s>", "<pad>", "<mask>"]
    regular = shipped.regular_ids()
    assert regular.dtype == np.int32 and len(regular) == info.vocab_size - len(info.special_ids)
    assert not np.isin(regular, info.special_ids).any()
    assert json.loads(json.dumps(info.as_dict()))["special_ids"] == list(info.special_ids)


def test_sentencepiece_backend_gives_the_hf_ids_on_the_holdout(shipped, holdout):
    fast = shipped.encode_batch(holdout)
    assert fast == _hf_ids(shipped, holdout)
    assert sum(map(len, fast)) > 50_000
    assert shipped.decode(fast[0]) == holdout[0]


def test_plain_text_never_yields_special_ids(shipped, tmp_path):
    hf_only = tmp_path / "hf_only"
    shutil.copytree(SHIPPED, hf_only, ignore=shutil.ignore_patterns("tokenizer.model"))
    slow = load_tokenizer(str(hf_only))
    assert slow.backend == "hf"
    for tok in (shipped, slow):
        (ids,) = tok.encode_batch([FORGED])
        assert not set(ids) & set(tok.info.special_ids)
        assert tok.decode(ids) == FORGED
    assert slow.encode_batch([FORGED, ""]) == shipped.encode_batch([FORGED, ""])


def test_falls_back_to_hf_when_sentencepiece_differs(shipped, tmp_path, holdout):
    """A tokenizer.model that disagrees with tokenizer.json (here: no dummy prefix) must not be used."""
    other = tmp_path / "other"
    shutil.copytree(SHIPPED, other)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((other / "tokenizer.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    (other / "tokenizer.model").write_bytes(proto.SerializeToString())
    tok = load_tokenizer(str(other))
    assert tok.backend == "hf"
    assert tok.encode_batch(holdout[:3]) == shipped.encode_batch(holdout[:3])


def test_bare_sentencepiece_model(shipped, holdout):
    bare = load_tokenizer(os.path.join(SHIPPED, "tokenizer.model"))
    assert bare.backend == "sentencepiece"
    for field in ("vocab_size", "bos_id", "eos_id", "pad_id", "mask_id", "special_ids"):
        assert getattr(bare.info, field) == getattr(shipped.info, field), field
    assert bare.info.fingerprint != shipped.info.fingerprint
    texts = [" leading space", *holdout[:5]]
    assert bare.encode_batch(texts) == _hf_ids(bare, texts) == shipped.encode_batch(texts)


def test_fingerprint_follows_the_files_not_the_path(shipped, tmp_path):
    copy = tmp_path / "somewhere" / "else"
    shutil.copytree(SHIPPED, copy)
    (copy / "config.json").write_text("{}")  # a model's files beside the tokenizer are not part of it
    assert load_tokenizer(str(copy)).info.fingerprint == shipped.info.fingerprint
    renamed = tmp_path / "renamed.model"
    shutil.copy(os.path.join(SHIPPED, "tokenizer.model"), renamed)
    bare = load_tokenizer(os.path.join(SHIPPED, "tokenizer.model"))
    assert load_tokenizer(str(renamed)).info.fingerprint == bare.info.fingerprint
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"<pad>"', '"<pad>" '))
    assert load_tokenizer(str(copy)).info.fingerprint != shipped.info.fingerprint


@pytest.fixture(scope="module")
def tiny_input(tmp_path_factory, holdout) -> str:
    """The first holdout documents as .jsonl.gz plus one broken line, which is skipped."""
    path = tmp_path_factory.mktemp("input") / "tiny.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in holdout[:12])
        f.write("{broken\n")
    return str(path)


def test_train_tokenizer_is_deterministic_and_loads_with_autotokenizer(tiny_input, tmp_path, capsys):
    outputs = [tmp_path / "a", tmp_path / "deeper" / "b"]
    for out in outputs:
        tokenizer_training.main(["--input", tiny_input, "--vocab-size", "400", "--output", str(out), "--seed", "3"])
    names = sorted(os.listdir(outputs[0]))
    assert "tokenizer.model" in names and names == sorted(os.listdir(outputs[1]))
    for name in names:
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name
    captured = capsys.readouterr()
    assert "skipped 1 bad records" in captured.err and "fingerprint: " in captured.out
    hf = AutoTokenizer.from_pretrained(str(outputs[0]), local_files_only=True)
    assert len(hf) == 400 and (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert (hf.pad_token_id, hf.mask_token_id) == (3, 4)
    assert hf("To be, or not to be")["input_ids"][0] == hf.bos_token_id
    sp = spm.SentencePieceProcessor(model_file=str(outputs[0] / "tokenizer.model"))
    assert sp.encode("To be, or not to be") == hf("To be, or not to be", add_special_tokens=False)["input_ids"]


def test_load_tokenizer_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist: pass an HF tokenizer directory"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="is not a tokenizer directory: it has none of tokenizer.json"):
        load_tokenizer(str(tmp_path))
    fake = tmp_path / "fake.model"
    fake.write_bytes(b"\x00not a sentencepiece model")
    with pytest.raises(ValueError, match=r"fake.model is not a sentencepiece model .*pass a .model written by"):
        load_tokenizer(str(fake))
    broken = tmp_path / "broken"
    shutil.copytree(SHIPPED, broken)
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken: transformers cannot load this tokenizer directory"):
        load_tokenizer(str(broken))


def test_train_tokenizer_bad_inputs(tiny_input, tmp_path):
    def run(*args: str) -> str:
        with pytest.raises(SystemExit) as e:
            tokenizer_training.main(list(args))
        return str(e.value)

    out = str(tmp_path / "out")
    assert "matches no file" in run("--input", str(tmp_path / "*.jsonl"), "--vocab-size", "400", "--output", out)
    assert "no usable documents in field 'body'" in run("--input", tiny_input, "--vocab-size", "400",
                                                        "--output", out, "--text-field", "body")
    assert "Vocabulary size too high" in run("--input", tiny_input, "--vocab-size", "100000", "--output", out)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "weights.bin").write_bytes(b"x")
    assert "holds other files ['weights.bin']" in run("--input", tiny_input, "--vocab-size", "400",
                                                      "--output", str(tmp_path / "taken"))
