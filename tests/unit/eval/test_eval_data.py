"""Bad evaluation input gets a clear error naming the file (and line or field) and the fix."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.config import ConfigError
from pipeline.eval.data import DataError, find_files, read_conll, read_rows
from pipeline.eval.finetune.classification import SequenceClassification
from pipeline.eval.load import ModelError, load_model
from pipeline.eval.registry import task_options
from pipeline.eval.task import EvalContext
from pipeline.tasks import FinetuneOptions


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_missing_file_names_it_and_the_hub_fallback(tmp_path):
    with pytest.raises(DataError, match=r"sts/stsb\.tsv: no such file.*HF dataset name"):
        read_rows(str(tmp_path / "sts" / "stsb.tsv"))
    with pytest.raises(DataError, match="no .tsv files"):
        find_files(str(tmp_path), [".tsv"], "sts")


def test_wrong_column_count_names_file_and_line(tmp_path):
    path = write(tmp_path / "sst2.tsv", "sentence\tlabel\ngood film\t1\nbad\tfilm\t0\n")
    with pytest.raises(DataError, match=r"sst2\.tsv:3: 3 columns, but the header has 2 \(sentence, label\)"):
        read_rows(path)
    conll = write(tmp_path / "train.txt", "EU NNP B-NP I-ORG\nrejects VBZ B-VP\n")
    with pytest.raises(DataError, match=r"train\.txt:2: 3 columns, but the file's first token line has 4"):
        read_conll(conll)
    bad = write(tmp_path / "x.jsonl", '{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: not valid JSON"):
        read_rows(bad)


def test_missing_column_lists_the_expected_names(tmp_path):
    row = read_rows(write(tmp_path / "sts.tsv", "a\tb\nx\ty\n"))[0]
    with pytest.raises(DataError, match=r"sts\.tsv:2: no gold score column; expected one of \['score'"):
        row.get(("score", "relatedness_score"), "gold score")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from helpers import tiny_llama

    from pipeline.experiment import SAMPLE_DIR
    from pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(SAMPLE_DIR, "tokenizer"))
    out = str(tmp_path_factory.mktemp("model") / "no-tokenizer")
    tiny_llama(tok).save_pretrained(out)
    return out


def test_unseen_labels_name_the_record(tmp_path, tiny_dir):
    from pipeline.experiment import SAMPLE_DIR

    model = load_model(tiny_dir, tokenizer=os.path.join(SAMPLE_DIR, "tokenizer"))
    root = tmp_path / "classification" / "sst2"
    write(root / "train.tsv", "sentence\tlabel\ngood\t1\nbad\t0\nfine\t1\n")
    write(root / "dev.tsv", "sentence\tlabel\nok\t1\n")
    write(root / "test.tsv", "sentence\tlabel\nhm\t1\nwhat\tneutral\n")
    task = SequenceClassification(EvalContext(model, str(tmp_path), progress=False), FinetuneOptions())
    with pytest.raises(DataError, match=r"test\.tsv:3: label 'neutral' never occurs in the training data"):
        task.load("sst2")
    conll = tmp_path / "conll"
    write(conll / "train.txt", "EU NNP B-NP I-ORG\n\nPeter NNP B-NP I-PER\n")
    write(conll / "dev.txt", "EU NNP B-NP I-ORG\n")
    write(conll / "test.txt", "Paris NNP B-NP I-LOC\n")
    options = task_options(["probing"], [])["probing"]
    from pipeline.eval.probing import run

    with pytest.raises(DataError, match=r"test\.txt:1: ner label\(s\) \['I-LOC'\] never occur in the training file"):
        run(EvalContext(model, str(tmp_path), progress=False), options)


def test_model_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelError, match="has no usable tokenizer.*--tokenizer"):
        load_model(tiny_dir)
    with pytest.raises(ModelError, match="neither a run directory"):
        load_model(str(tmp_path))
    with pytest.raises(ModelError, match="no such model"):
        load_model(str(tmp_path / "nope"))
    run = tmp_path / "run"
    write(run / "experiment.json", json.dumps({"name": "x", "phases": []}))
    with pytest.raises(ModelError, match="without an hf/ export or a complete checkpoint"):
        load_model(str(run))


def test_task_options():
    opts = task_options(["classification", "sts"], ["classification.lrs=[1e-5, 2e-4]", "sts.pooling=last"])
    assert opts["classification"].lrs == [1e-5, 2e-4] and opts["sts"].pooling == "last"
    with pytest.raises(ConfigError, match="unknown task"):
        task_options(["stsb"], [])
    with pytest.raises(ConfigError, match="sts.poolin: unknown key"):
        task_options(["sts"], ["sts.poolin=last"])
    with pytest.raises(ConfigError, match="not among --tasks"):
        task_options(["sts"], ["qa.max_steps=3"])
    with pytest.raises(ConfigError, match="not allowed"):
        task_options(["probing"], ["probing.read=sideways"])
    with pytest.raises(ConfigError, match="not allowed"):
        task_options(["sts"], ["sts.pooling=max"])
    assert task_options(["probing"], ["probing.columns={pos: 1}"])["probing"].columns == {"pos": 1}
    with pytest.raises(ConfigError, match=r"probing.columns: 'pos:1' has no value; .* space after the colon: \{pos: 1\}"):
        task_options(["probing"], ["probing.columns={pos:1}"])
    with pytest.raises(ConfigError, match="probing.columns.pos: expected an integer, got 'one'"):
        task_options(["probing"], ["probing.columns={pos: one}"])
