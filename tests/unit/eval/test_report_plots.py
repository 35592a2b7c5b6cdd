"""The report's plot lines: runs share a line only when they differ in the plotted setting alone, through the mean
of their seeds; the legend names what varies; perplexities get a log axis; a continued run's CLM share counts the
run it started from."""

from __future__ import annotations

import json
import os
import shutil

from pipeline.eval.report.plots import log_scale, mean_line, series
from pipeline.eval.report.runs import Recipe, RunSummary, recipe_of
from pipeline.io import REPO
from pipeline.run_dir import RunDir


def run(name: str, objectives: set[str], clm_share: float, mask_ratio: float | None, scale: str = "210m"
        ) -> RunSummary:
    recipe = Recipe(name=name, phases="", objectives=frozenset(objectives), clm_share=clm_share,
                      mask_ratio=mask_ratio, scale=scale, steps=100)
    return RunSummary(run_dir=name, recipe=recipe, history={})


def test_runs_of_different_models_or_objectives_never_share_a_line():
    runs = [run("mlm-a", {"mlm"}, 0.0, 0.4), run("switch-a", {"clm", "mlm"}, 0.5, 0.4),
            run("mlm-b", {"mlm"}, 0.0, 0.4, scale="610m"), run("mntp-a", {"mntp"}, 0.0, 0.4),
            run("magnet-a", {"clm", "magnet"}, 0.5, 0.4)]
    points = [(r.recipe.clm_share, float(i), r) for i, r in enumerate(runs)]
    assert series(points, "clm_share") == {
        "model = 210m, objectives = magnet": [(0.5, 4.0)],
        "model = 210m, objectives = mlm": [(0.0, 0.0), (0.5, 1.0)],  # MLM and CLM -> MLM: the share varies alone
        "model = 210m, objectives = mntp": [(0.0, 3.0)],
        "model = 610m, objectives = mlm": [(0.0, 2.0)]}


def test_only_what_varies_names_the_lines():
    runs = [run("r20", {"mlm"}, 0.0, 0.2), run("r40", {"mlm"}, 0.0, 0.4), run("s20", {"clm", "mlm"}, 0.5, 0.2)]
    points = [(r.recipe.mask_ratio, 1.0, r) for r in runs]
    assert series(points, "mask_ratio") == {"clm share = 0.0": [(0.2, 1.0), (0.4, 1.0)], "clm share = 0.5": [(0.2, 1.0)]}
    assert list(series(points[:2], "mask_ratio")) == ["all runs"]


def test_perplexity_axes_are_logarithmic():
    assert log_scale("ppl") and log_scale("infill_ppl_magnet/roc") and log_scale("infill_ppl_causal/wiki")
    assert not log_scale("mlm_acc") and not log_scale("sts/stsb") and not log_scale("rep_4/wiki")


def test_seeds_of_one_setting_make_one_point_of_the_line():
    assert mean_line([(0.0, 31.0), (0.5, 48.0), (0.0, 42.0), (0.5, 49.0), (1.0, 60.0)]) == [
        (0.0, 36.5), (0.5, 48.5), (1.0, 60.0)]


def test_a_continued_run_counts_the_clm_steps_of_the_run_it_started_from(tmp_path):
    records = os.path.join(REPO, "docs", "results", "full", "runs")  # the full reproduction's real records
    for name in ("half-clm-s0", "cpt-s0"):
        os.makedirs(tmp_path / name)
        shutil.copyfile(os.path.join(records, name, "experiment.json"), tmp_path / name / "experiment.json")
    cpt = json.loads((tmp_path / "cpt-s0" / "experiment.json").read_text())
    cpt["model"]["init"] = str(tmp_path / "half-clm-s0" / "hf")  # 50 CLM steps, then these 50 MLM steps
    (tmp_path / "cpt-s0" / "experiment.json").write_text(json.dumps(cpt))
    shares = {name: recipe_of(RunDir(str(tmp_path / name)), RunDir(str(tmp_path / name)).experiment()).clm_share
              for name in ("half-clm-s0", "cpt-s0")}
    assert shares == {"half-clm-s0": 1.0, "cpt-s0": 0.5}
    shutil.rmtree(tmp_path / "half-clm-s0")  # the start run gone: only the run's own steps are known
    assert recipe_of(RunDir(str(tmp_path / "cpt-s0")), RunDir(str(tmp_path / "cpt-s0")).experiment()).clm_share == 0.0
