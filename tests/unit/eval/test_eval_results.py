"""EvalResults: the committed records read and written again are the same bytes, and those naming absolute paths
(written before records named them relative to the results root) read all the same; merge keeps the older file's
tasks under the newer ones."""

from __future__ import annotations

import glob
import json
import os
import shutil

from pipeline.eval.config import EvalConfig
from pipeline.eval.description import ModelDescription, recorded_path
from pipeline.eval.report.runs import load_run
from pipeline.eval.results import EvalResults
from pipeline.export.record import EncoderRecord

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))


def committed_results() -> list[str]:
    """Every evaluation results file under docs/results (run directories' eval/ and the baselines)."""
    paths = glob.glob(os.path.join(REPO, "docs", "results", "**", "*.json"), recursive=True)
    return sorted(p for p in paths if "headline" in json.load(open(p)))


def test_every_committed_record_is_written_back_byte_for_byte(tmp_path):
    paths = committed_results()
    assert len(paths) > 50 and any("reused" in json.load(open(p)) for p in paths)
    for path in paths:
        out = str(tmp_path / "again.json")
        assert EvalResults.read(path).write(out)
        assert open(out, "rb").read() == open(path, "rb").read(), path


def older_record(run_dir: str) -> str:
    """The committed quick run copied to run_dir with its record as records were once written: absolute paths (of
    the run's directory then) and no config.max_tokens (added later)."""
    shutil.copytree(os.path.join(REPO, "docs", "results", "quick", "runs", "llm2vec-supervised-smoke"), run_dir)
    path = os.path.join(run_dir, "eval", "llm2vec.json")
    record = json.load(open(path))
    del record["config"]["max_tokens"]
    record["config"]["model"] = record["model"]["run_dir"] = run_dir
    record["model"]["hf_dir"] = record["model"]["tokenizer"] = os.path.join(run_dir, "hf")
    json.dump(record, open(path, "w"))
    return path


def test_a_record_with_absolute_paths_and_older_fields_reads_typed(tmp_path):
    """Records written before they named paths relative to the results root, and before config.max_tokens existed,
    read as typed results all the same (the absent field its default, left out again when written)."""
    run_dir = str(tmp_path / "runs" / "llm2vec-supervised-smoke")
    path = older_record(run_dir)
    read = EvalResults.read(path)
    assert read.model.run_dir == run_dir and read.config.model == run_dir and read.model.hf_dir.startswith(run_dir)
    assert read.model.record.objectives == ("mntp", "supervised") and read.model.step == 1
    assert read.config.tasks == ["sts", "clustering", "zero_shot_retrieval", "probing"] and read.config.batch_size == 8
    assert read.unwritten == ("config.max_tokens",) and "max_tokens" not in read.to_json()["config"]
    assert read.headline == json.load(open(path))["headline"] and read.headline["clustering_avg"] > 0
    assert load_run(run_dir).headline == read.headline  # the report's reading


def test_paths_are_recorded_relative_to_the_results_root(tmp_path):
    """Under the root: relative to it; elsewhere in the repository: relative to the repository; outside both: as
    they are."""
    root = str(tmp_path / "runs")
    assert recorded_path(os.path.join(root, "a", "hf"), root) == os.path.join("a", "hf")
    assert recorded_path(os.path.join(REPO, "runs", "real"), root) == os.path.join("runs", "real")
    assert recorded_path(str(tmp_path / "elsewhere"), root) == str(tmp_path / "elsewhere")
    config = EvalConfig(model=os.path.join(root, "a"), tasks=["sts"], data_dir=os.path.join(REPO, "data", "eval"))
    assert config.recorded(root) == EvalConfig(model="a", tasks=["sts"], data_dir=os.path.join("data", "eval"))


def results(tasks: list[str], **fields) -> EvalResults:
    model = ModelDescription(hf_dir="a/hf", run_dir="a", step=2, attention="causal", reads_previous=False,
                             record=EncoderRecord(), tokenizer="a/hf", parameters=10)
    return EvalResults(EvalConfig(model="a", tasks=tasks, data_dir="runs/real"), model, **fields)


def test_merge_keeps_the_older_tasks_under_the_newer_and_orders_the_config_tasks():
    older = results(["sts"], environment={"torch": "old"}, options={"sts": {"max_length": 32}},
                    results={"sts": {"average": 1.0, "datasets": {}}}, headline={"sts_avg": 1.0},
                    failed={"sts": {"error": "gone"}},
                    seconds={"sts": 2.0})
    newer = results(["clustering"], environment={"torch": "new"}, options={"clustering": {}},
                    results={"clustering": {"v": 0.5}}, headline={"clustering_avg": 0.5}, seconds={"clustering": 3.0})
    merged = newer.merge(older, ["clustering", "probing", "sts"])
    assert merged.config.tasks == ["clustering", "sts"] and newer.config.tasks == ["clustering"]
    assert merged.results == {"sts": {"average": 1.0, "datasets": {}}, "clustering": {"v": 0.5}}
    assert merged.headline == {"sts_avg": 1.0, "clustering_avg": 0.5} and merged.seconds == {"sts": 2.0, "clustering": 3.0}
    assert merged.failed == {} and merged.environment == {"torch": "new"} and "reused" not in merged.to_json()
    newer.with_task_of(older, "sts", "other.json")
    again = newer.merge(None, ["sts", "clustering"])
    assert again.reused == {"sts": "other.json"} and again.config.tasks == ["sts", "clustering"]
    assert again.headline == {"clustering_avg": 0.5, "sts_avg": 1.0}  # the sts spec's headline of the copied result
    assert EvalResults.from_json(again.to_json()) == again and not results([], environment={}).write("unwritten.json")
