"""EvalResults: the committed records read and written again are the same bytes; merge keeps the older file's tasks
under the newer ones."""

from __future__ import annotations

import glob
import json
import os

from pipeline.eval.results import EvalResults

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


def test_merge_keeps_the_older_tasks_under_the_newer_and_orders_the_config_tasks():
    older = EvalResults({"tasks": ["sts"], "seed": 0}, {"run_dir": "runs/a"}, {"torch": "old"},
                        options={"sts": {"max_length": 32}}, results={"sts": {"score": 1.0}},
                        headline={"sts_avg": 1.0}, failed={"sts": {"error": "gone"}}, seconds={"sts": 2.0})
    newer = EvalResults({"tasks": ["clustering"], "seed": 0}, {"run_dir": "runs/a"}, {"torch": "new"},
                        options={"clustering": {}}, results={"clustering": {"v": 0.5}},
                        headline={"clustering_avg": 0.5}, seconds={"clustering": 3.0})
    merged = newer.merge(older, ["clustering", "probing", "sts"])
    assert merged.config == {"tasks": ["clustering", "sts"], "seed": 0} and newer.config["tasks"] == ["clustering"]
    assert merged.results == {"sts": {"score": 1.0}, "clustering": {"v": 0.5}}
    assert merged.headline == {"sts_avg": 1.0, "clustering_avg": 0.5} and merged.seconds == {"sts": 2.0, "clustering": 3.0}
    assert merged.failed == {} and merged.environment == {"torch": "new"} and "reused" not in merged.to_json()
    newer.with_task_of(older, "sts", "other.json", {"sts_avg": 1.0})
    again = newer.merge(EvalResults({}, {}, {}), ["sts", "clustering"])
    assert again.reused == {"sts": "other.json"} and again.config["tasks"] == ["sts", "clustering"]
    assert EvalResults.from_json(again.to_json()) == again and not EvalResults({}, {}, {}).write("unwritten.json")
