"""The studies over training steps (pipeline/reproduce/curves.py): a run's kept checkpoints and end placed on the
chain's steps (a continued run after its start's), the claims' verdicts at each budget on the page, the PNG."""

from __future__ import annotations

import json
import os
import shutil

from pipeline.io import REPO
from pipeline.reproduce.curves import kept_steps, over_steps, plot_curves, run_curve
from pipeline.reproduce.results import study_markdown
from pipeline.reproduce.studies import STUDIES
from pipeline.run_dir import MARKER, RunDir

RECORDS = os.path.join(REPO, "docs", "results", "full", "runs")  # the full reproduction's real experiments


def _run(tmp_path, name: str, steps: int, init: str | None = None) -> RunDir:
    os.makedirs(tmp_path / name)
    exp = json.load(open(os.path.join(RECORDS, name, "experiment.json")))
    exp["train"]["steps"] = steps
    if init:
        exp["model"]["init"] = init
    (tmp_path / name / "experiment.json").write_text(json.dumps(exp))
    return RunDir(str(tmp_path / name))


def _checkpoint(run: RunDir, step: int, complete: bool = True) -> None:
    os.makedirs(run.checkpoint(step))
    if complete:
        open(os.path.join(run.checkpoint(step), MARKER), "w").write("{}")


def _results(run: RunDir, step: int | None, stsb: float) -> None:
    """The full reproduction's results of the run, with this headline."""
    path = run.eval_results("llm2vec", step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    results = json.load(open(os.path.join(RECORDS, os.path.basename(run.path), "eval", "llm2vec.json")))
    open(path, "w").write(json.dumps({**results, "headline": {"sts/stsb": stsb}}))


def test_a_continued_runs_curve_continues_after_the_steps_of_the_run_it_started_from(tmp_path):
    mntp = _run(tmp_path, "llm2vec-mntp", 6)
    simcse = _run(tmp_path, "llm2vec-simcse", 8, init=os.path.join(mntp.path, "hf"))
    for run, steps in ((mntp, (3, 6)), (simcse, (4, 8))):
        for step in steps:
            _checkpoint(run, step)
    _checkpoint(simcse, 6, complete=False)  # half-written: never read
    _checkpoint(simcse, 2)  # kept but not evaluated: no point
    for run, step, value in ((mntp, 3, 11.0), (mntp, None, 12.0), (simcse, 4, 20.0), (simcse, None, 25.0)):
        _results(run, step, value)
    assert kept_steps(mntp) == [3] and kept_steps(simcse) == [2, 4]  # the last step is read through the export
    assert run_curve(mntp, "llm2vec") == {3: {"sts/stsb": 11.0}, 6: {"sts/stsb": 12.0}}
    # SimCSE's step 0 is the MNTP export it trained from
    assert run_curve(simcse, "llm2vec") == {6: {"sts/stsb": 12.0}, 10: {"sts/stsb": 20.0}, 14: {"sts/stsb": 25.0}}
    assert run_curve(simcse, "magnet") == {}  # another study's numbers are not this one's


def test_a_claim_over_steps_names_the_budgets_where_it_holds_and_where_it_flips():
    magnet = {48: {"rep_4/wiki": 0.10}, 96: {"rep_4/wiki": 0.12}, 144: {"rep_4/wiki": 0.30}, 240: {"rep_4/wiki": 0.2}}
    simcse = {96: {"rep_4/wiki": 0.20}, 144: {"rep_4/wiki": 0.25}, 240: {"rep_4/wiki": 0.20, "sts/stsb": 1.0}}
    assert over_steps(magnet, simcse, "rep_4/wiki", lower_is_better=True) == (
        "reproduced at 96; not reproduced at 144; tied at 240")
    assert over_steps(magnet, simcse, "sts/stsb", lower_is_better=False) == "—"  # no step has both
    mntp = {48: {"sts/stsb": 15.0}}
    supervised = {48: mntp[48], 72: {"sts/stsb": 19.0}}  # starts from MNTP's end: the same model at 48
    assert over_steps(supervised, mntp, "sts/stsb", lower_is_better=False) == "—"


def test_the_page_gives_each_claim_its_verdict_at_every_evaluated_budget():
    llm2vec = STUDIES[0]
    headlines = {"smollm2-causal": [{"sts/stsb": 30.0}], "smollm2-bidirectional": [{"sts/stsb": 10.0}],
                 "llm2vec-mntp": [{"sts/stsb": 12.0}], "llm2vec-simcse": [{"sts/stsb": 35.0}]}
    curves = {"llm2vec-mntp": {24: {"sts/stsb": 9.0}, 48: {"sts/stsb": 12.0}},
              "llm2vec-simcse": {96: {"sts/stsb": 25.0}, 240: {"sts/stsb": 35.0}}}
    page = study_markdown(llm2vec, headlines, [], "full", curves)
    rows = {line.split(" | ")[0].strip("| "): line for line in page.splitlines() if line.startswith("| ")}
    # an untrained model is the same at every step of the other side
    assert rows["MNTP + SimCSE > causal mean pooling on STS-B"].endswith(
        "| not reproduced at 96; reproduced at 240 |")
    assert rows["MNTP recovers word probing: bidirectional + MNTP > bidirectional untrained (WSJ POS)"].endswith(
        "| — |")
    assert "over steps" in page and "over steps" not in study_markdown(llm2vec, headlines, [], "full")


def test_curves_plot_a_line_per_run_and_the_untrained_models_as_levels(tmp_path):
    curves = {"MNTP + SimCSE": {96: {"sts/stsb": 25.0}, 240: {"sts/stsb": 35.0}}, "MNTP": {48: {"sts/stsb": 12.0}}}
    path = plot_curves(curves, {"causal": {"sts/stsb": 30.0}}, [("STS-B", "sts/stsb"), ("Rep-4", "rep_4/wiki")],
                       str(tmp_path / "curves.png"), "llm2vec")
    assert path == str(tmp_path / "curves.png") and os.path.getsize(path) > 10_000
    one_point = {"MNTP": {48: {"sts/stsb": 12.0}}}
    assert plot_curves(one_point, {}, [("STS-B", "sts/stsb")], str(tmp_path / "none.png"), "x") is None
    assert not os.path.exists(tmp_path / "none.png")
    shutil.rmtree(tmp_path)
