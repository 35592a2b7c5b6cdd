"""Every export's model card is one the Hub takes: huggingface_hub's own parser reads it (metadata, ``model-index``
into ``EvalResult``s), ``base_model`` and ``datasets`` are Hub ids or absent, a license is named, no absolute path
is written, and the usage snippet runs from a copy of the directory anywhere."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, tiny_llama
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results

from pipeline.config import ConfigError, from_dict
from pipeline.eval import encode, load_model
from pipeline.eval.config import EvalConfig
from pipeline.eval.results import EvalResults
from pipeline.eval.runner import evaluate
from pipeline.experiment import ExperimentConfig
from pipeline.export.card import metadata
from pipeline.export.hf import save_hf
from pipeline.export.model_index import eval_results, results_at
from pipeline.export.record import EncoderRecord
from pipeline.export.sentence_transformers import st_record
from pipeline.io import read_json
from pipeline.run_dir import RunDir

FIXTURES = os.path.join(REPO, "tests", "fixtures", "eval")
MNTP = EncoderRecord(attention="bidirectional", reads_previous=True, mask_token="<mask>", objectives=("mntp",))
CLM = EncoderRecord(objectives=("clm",))
SMOLLM = "HuggingFaceTB/SmolLM2-135M"
MNTP_PHASE = {"phases": [{"objectives": [{"name": "mntp", "ratio": 0.2, "mask_token": "<mask>"}]}]}


def experiment(raw: dict) -> ExperimentConfig:
    return from_dict(ExperimentConfig, raw)


def export(tokenizer, out: str, record: EncoderRecord, raw: dict | None = None, sentence_transformers=False,
           results=()) -> str:
    lm = tiny_llama(tokenizer, seed=3)
    return save_hf(lm, lm.state_dict(), tokenizer, out, record, experiment(raw or MNTP_PHASE), 7, 1024,
                   sentence_transformers, results)


def snippet(hf_dir: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", open(os.path.join(hf_dir, "README.md")).read(), re.S)
    return code


def moved(hf_dir: str, to: str) -> str:
    """A copy of ``hf_dir`` at ``to``, the original gone."""
    shutil.copytree(hf_dir, to)
    shutil.rmtree(hf_dir)
    return to


def assert_no_absolute_path(hf_dir: str, *paths: str) -> None:
    text = open(os.path.join(hf_dir, "README.md")).read()
    for path in (REPO, os.path.dirname(hf_dir), *paths):
        assert path not in text, path
    assert not re.search(r"(^|[\s`'\"(\[])/[A-Za-z]", text), text


def test_the_card_parses_with_huggingface_hub_and_names_hub_ids_only(tokenizer, tmp_path):
    hf = export(tokenizer, str(tmp_path / "run" / "hf"), MNTP)
    path = os.path.join(hf, "README.md")
    card = ModelCard.load(path)  # a local file: no network
    assert card.data.to_dict() == metadata_load(path) == {
        "library_name": "transformers", "license": "apache-2.0", "pipeline_tag": "feature-extraction",
        "tags": ["decoder-encoders", "llm2vec", "mntp"]}  # a preset start: no base_model, the project's license
    assert ModelCard(str(card)).data.to_dict() == card.data.to_dict()  # what huggingface_hub writes back
    text = card.text
    assert "from scratch (the randomly initialised `tiny` preset)" in text
    assert ("- **mntp** (300 steps, 100% of the run; bidirectional attention; data: `runs/shards/sample-128` at "
            "sequence length 128):\n  - MNTP: 20% of the tokens masked, 80% replaced by the mask token, 10% by a "
            "random token, 10% kept (mask token '<mask>'), each predicted from the position before it") in text
    assert "step 7 of 300 (1,024 tokens)" in text and "built from `data/sample/train/**/*.jsonl.zst`" in text
    assert_no_absolute_path(hf)


def test_base_model_license_and_datasets_come_from_hub_ids_only(tmp_path):
    def meta(init: str, **export_fields) -> dict:
        raw = {**MNTP_PHASE, "model": {"init": init}, "export": export_fields}
        return metadata(MNTP, experiment(raw), False).to_dict()

    local = tmp_path / "models" / "start"  # a local checkpoint without a card: nothing to say
    local.mkdir(parents=True)
    assert "base_model" not in meta(str(local)) and "license" not in meta(str(local))
    named = meta(str(local), base_model=SMOLLM, license="mit", datasets=["HuggingFaceFW/fineweb-edu"])
    assert (named["base_model"], named["license"], named["datasets"]) == (SMOLLM, "mit", ["HuggingFaceFW/fineweb-edu"])
    # snapshot_download's directory names the Hub id; the start model's card its license
    cached = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "12fd25f"
    cached.mkdir(parents=True)
    (cached / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# SmolLM2\n")
    assert {k: meta(str(cached))[k] for k in ("base_model", "license")} == {"base_model": SMOLLM,
                                                                          "license": "apache-2.0"}
    # an export of this project: its Hub ancestor and license carry on; a local path in an old card does not
    export_dir = tmp_path / "mntp" / "hf"
    export_dir.mkdir(parents=True)
    (export_dir / "README.md").write_text(f"---\nbase_model: {SMOLLM}\nlicense: other\nlicense_name: custom\n"
                                          "license_link: https://example.org/license\n---\n")
    inherited = meta(str(export_dir))
    assert (inherited["base_model"], inherited["license"], inherited["license_name"]) == (SMOLLM, "other", "custom")
    (export_dir / "README.md").write_text(f"---\nbase_model: {tmp_path}/start\n---\n")
    assert "base_model" not in meta(str(export_dir))
    (export_dir / "README.md").write_text("---\nbase_model: runs/sample-tiny-clm/hf\n---\n")
    assert "base_model" not in meta(str(export_dir))


@pytest.mark.parametrize("field, value, message", [
    ("base_model", "runs/sample-tiny-clm/hf", "export.base_model: 'runs/sample-tiny-clm/hf' is not a Hub id"),
    ("repo_id", "me/my model", "export.repo_id: 'me/my model' is not a Hub id"),
    ("datasets", ["data/sample"], "export.datasets.0: 'data/sample' is a local path, which the Hub cannot link"),
    ("license", "Apache 2.0", "export.license: 'Apache 2.0' is not a Hub license id"),
    # issue 51, item 6: a pattern passed these; the Hub's list does not
    ("license", "apache", "export.license: 'apache' is not a Hub license id; did you mean apache-2.0"),
    ("license", "foo-bar", "export.license: 'foo-bar' is not a Hub license id; the ids are those of https://"),
])
def test_export_fields_refuse_what_the_hub_cannot_read(field, value, message, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=re.escape(message)):
        experiment({"export": {field: value}})


@pytest.mark.parametrize("license", ["apache-2.0", "llama3.1", "openrail++", "cc-by-nc-sa-4.0", "gpl", "other"])
def test_the_hubs_license_ids_pass(license):
    assert experiment({"export": {"license": license}}).export.license == license


@pytest.mark.parametrize("kind", ["encoder", "sentence-transformers", "clm"])
def test_the_usage_snippet_runs_in_a_copy_of_the_export_anywhere(tokenizer, tmp_path, monkeypatch, kind):
    """The snippet hard-coded the run's path: from a copy it failed with "Repo id must be in the form ..."."""
    record = {"encoder": MNTP, "sentence-transformers": st_record(MNTP), "clm": CLM}[kind]
    hf = export(tokenizer, str(tmp_path / "run" / "hf"), record, sentence_transformers=kind == "sentence-transformers")
    copy = moved(hf, str(tmp_path / "elsewhere" / "model"))
    assert_no_absolute_path(copy, hf)
    monkeypatch.chdir(copy)
    scope = {}
    exec(snippet(copy), scope)
    if kind == "clm":
        return  # it generated
    ours = encode(load_model(copy), scope.get("texts", ["A sentence to embed."]), instruction="")
    np.testing.assert_allclose(np.asarray(scope["embeddings"]), ours, atol=1e-5)


def test_a_configured_repo_id_is_what_the_snippet_loads(tokenizer, tmp_path):
    hf = export(tokenizer, str(tmp_path / "hf"), MNTP, {**MNTP_PHASE, "export": {"repo_id": "me/tiny-mntp"}})
    assert 'path = "me/tiny-mntp"' in snippet(hf) and ModelCard.load(os.path.join(hf, "README.md")).text.startswith(
        "\n# tiny-mntp\n")


def test_evaluation_results_become_the_model_index(tokenizer, tmp_path):
    """launch/evaluate.py's results, through huggingface_hub's own model-index parser, give back its numbers."""
    hf = export(tokenizer, str(tmp_path / "plain"), MNTP)
    results = evaluate(EvalConfig(model=hf, tasks=["sts", "clustering"], data_dir=FIXTURES, progress=False))
    assert results.write(str(tmp_path / "results.json"))
    read = EvalResults.read(str(tmp_path / "results.json"))
    card_dir = export(tokenizer, str(tmp_path / "hf"), MNTP, {**MNTP_PHASE, "name": "tiny-mntp"},
                      results=eval_results(read_json(str(tmp_path / "results.json"))))
    meta = metadata_load(os.path.join(card_dir, "README.md"))
    name, parsed = model_index_to_eval_results(meta["model-index"])
    assert name == "tiny-mntp"
    assert ModelCard.load(os.path.join(card_dir, "README.md")).data.eval_results == parsed
    got = {(r.task_type, r.dataset_type, r.metric_type, r.dataset_split): r.metric_value for r in parsed}
    want = {("sentence-similarity", name, "cos_sim_spearman", "test"): r["spearman"]
            for name, r in read.results["sts"]["datasets"].items()}
    want.update({("Clustering", name, "v_measure", "test"): r["v_measure"]
                 for name, r in read.results["clustering"]["datasets"].items()})
    assert got == want and len(want) == 4
    assert yaml.safe_load(open(os.path.join(card_dir, "README.md")).read().split("---\n")[1]) == meta


def test_an_export_shows_only_its_steps_results_read_as_it_reads(tokenizer, tmp_path):
    """results_at: a run's results files of the exported step whose model was read with the export's attention and
    its own dims (not cut by --dim); the newest file's number where two files have it."""
    hf = export(tokenizer, str(tmp_path / "plain"), MNTP)
    read = evaluate(EvalConfig(model=hf, tasks=["sts"], data_dir=FIXTURES, progress=False))
    run = RunDir(str(tmp_path / "run"))

    def write(path: str, step: int, attention: str, shift: float, written_at: int, dim: int | None = None) -> None:
        scores = {name: {**r, "spearman": r["spearman"] + shift} for name, r in read.results["sts"]["datasets"].items()}
        replace(read, model=replace(read.model, step=step, attention=attention), config=replace(read.config, dim=dim),
                results={"sts": {**read.results["sts"], "datasets": scores}}).write(path)
        os.utime(path, (written_at, written_at))  # the order of writing, whatever the clock's resolution

    write(run.eval_results("rerun", step=7), 7, "bidirectional", 3.0, 1_000)
    write(run.eval_results("causal"), 7, "causal", 1.0, 2_000)  # another reading of the same weights
    write(run.eval_results(step=6), 6, "bidirectional", 2.0, 3_000)  # another checkpoint
    write(run.eval_results(), 7, "bidirectional", 4.0, 4_000)  # the newest file of step 7
    write(run.eval_results("dim16"), 7, "bidirectional", 5.0, 5_000, dim=16)  # a Matryoshka cut: another model
    got = {r.dataset_type: r.metric_value for r in results_at(run, 7, "bidirectional")}
    assert got == {name: r["spearman"] + 4.0 for name, r in read.results["sts"]["datasets"].items()}
    assert results_at(run, 5, "bidirectional") == []


def test_the_scores_evaluators_logged_at_a_step_are_its_exports_model_index(tokenizer, tmp_path):
    """Issue 51, item 6: hf-best's card had no model-index (only ``evaluate.py --step <best>`` wrote one). What
    eval.evaluators scored at a validation step is kept with the run, so the card of that step's export (results_at,
    which export_checkpoint writes into hf-best/README.md) carries the logged eval/sts/<dataset> numbers, read as the
    export reads; a launch/evaluate.py file of the step, written later, wins."""
    from pipeline.experiment import EvaluatorConfig
    from pipeline.train.evaluators import TrainingEvaluators, evaluator_tasks

    run, lm = RunDir(str(tmp_path / "run")), tiny_llama(tokenizer, seed=3)
    sts = [os.path.join(FIXTURES, "sts", name) for name in ("stsb.tsv", "sickr.tsv")]
    evaluators = TrainingEvaluators(evaluator_tasks([EvaluatorConfig("sts", sts), EvaluatorConfig("clustering", [
        os.path.join(FIXTURES, "clustering", "mteb-topics.jsonl")])]), tokenizer, MNTP, run.path)
    scalars = evaluators.run(lm, lm, 4, torch.device("cpu"))  # the engine: what switches dropout off and on
    card_dir = export(tokenizer, run.hf_best, MNTP, results=results_at(run, 4, "bidirectional"))
    _, parsed = model_index_to_eval_results(metadata_load(os.path.join(card_dir, "README.md"))["model-index"])
    got = {(r.task_type, r.dataset_type, r.metric_type, r.dataset_split): r.metric_value for r in parsed}
    assert {k: v for k, v in got.items() if k[0] == "sentence-similarity"} == {
        ("sentence-similarity", name, "cos_sim_spearman", "test"): scalars[f"eval/sts/{name}"]
        for name in ("stsb", "sickr")}
    assert {k[:3] for k in got if k[0] == "Clustering"} == {("Clustering", "mteb-topics", "v_measure")}
    assert results_at(run, 2, "bidirectional") == results_at(run, 4, "causal") == []  # another step, another reading
    later = evaluate(EvalConfig(model=card_dir, tasks=["sts"], data_dir=FIXTURES, progress=False))
    replace(later, model=replace(later.model, step=4, attention="bidirectional"),
            results={"sts": {**later.results["sts"], "datasets": {"stsb": {**later.results["sts"]["datasets"]["stsb"],
                                                                           "spearman": 12.5}}}}
            ).write(run.eval_results(step=4))
    assert {(r.dataset_type, r.metric_value) for r in results_at(run, 4, "bidirectional")
            if r.task_type == "sentence-similarity"} == {("stsb", 12.5), ("sickr", scalars["eval/sts/sickr"])}
