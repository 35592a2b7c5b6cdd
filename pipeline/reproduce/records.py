"""What an invocation leaves under RESULTS/SCALE and on the page: each study's runs' and baselines' small records
copied from OUT (``keep_records``), its block of the page (``write_page``, checked first by ``check_page``) and
``timings.json`` (``write_timings``)."""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass, replace

from pipeline.constraints import lock_identity
from pipeline.grid import SMOKE_SUFFIX
from pipeline.io import write_json_atomic
from pipeline.reproduce.curves import Curve
from pipeline.reproduce.invocation import Reproduction, variants
from pipeline.reproduce.results import SUMMARY, replace_block, study_markdown, summary_markdown
from pipeline.reproduce.stages import Stages
from pipeline.reproduce.studies import STUDIES, Study
from pipeline.run_dir import RunDir


@dataclass(frozen=True)
class Evaluated:
    """A study's evaluated numbers: each table row's headline numbers (one per seed), the runs they are of (their
    names, in the same order) and each row's curve over the chain's steps (the first seed's)."""

    headlines: dict[str, list[dict]]
    curves: dict[str, Curve]
    runs: dict[str, list[str]]


def rows(r: Reproduction, study: Study) -> tuple[tuple[str, str], ...]:
    """The study's table rows this scale has: its baselines and the runs of the scale's grids (MAGNET's table
    shows the LLM2Vec study's; gpu-short leaves the CPT chain out)."""
    names = {v.name.removesuffix(SMOKE_SUFFIX) for s in STUDIES if s.grid_for(r.mode)
             for v in variants(r, s)} | {b.name for b in study.baselines}
    return tuple((label, row) for label, row in study.rows
                 if any(is_row_run(n, row) for n in names))


def is_row_run(name: str, row: str) -> bool:
    """Whether run ``name`` (without -smoke) is of table row ``row``: the row's own run or one of its seeds (-sN)."""
    return name == row or name.startswith(row + "-s")


def missing_seed_zero(r: Reproduction) -> list[str]:
    """--seeds: the runs of the selected studies' rows that --seeds does not train (seed 0: make reproduce's) with
    neither an export under OUT nor a record of the study's results under RESULTS/SCALE/runs, as "RUN (STUDY)"."""
    made = [v.name for s in STUDIES if s.grid_for(r.mode) for v in variants(r, s)
            if not any(x.is_extra_seed(v.name) for x in STUDIES)]
    missing = []
    for study in r.studies:
        for _, row in rows(r, study):
            for name in (n for n in made if is_row_run(n.removesuffix(SMOKE_SUFFIX), row)):
                here, kept = RunDir(os.path.join(r.out, name)), RunDir(os.path.join(r.results, "runs", name))
                if not (os.path.isdir(here.hf) or os.path.isfile(kept.eval_results(study.name))):
                    missing.append(f"{name} ({study.name})")
    return missing


def keep_records(r: Reproduction, study: Study, runs: list[str]) -> None:
    """The small records of the study's runs (experiment.json, metrics.jsonl, eval results, the kept steps' too)
    under RESULTS/SCALE/runs, and its baselines' results under RESULTS/SCALE/baselines."""
    for path in runs:
        run, keep = RunDir(path), os.path.join(r.results, "runs", os.path.basename(path))
        for rel in (os.path.relpath(p, path) for p in (run.experiment_json, run.metrics, *run.all_eval_results(),
                                                       *run.step_eval_results())):
            if os.path.isfile(os.path.join(path, rel)):
                os.makedirs(os.path.dirname(os.path.join(keep, rel)), exist_ok=True)
                shutil.copyfile(os.path.join(path, rel), os.path.join(keep, rel))
    for path in glob.glob(os.path.join(r.out, "baselines", f"*-{study.name}.json")):
        os.makedirs(os.path.join(r.results, "baselines"), exist_ok=True)
        shutil.copyfile(path, os.path.join(r.results, "baselines", os.path.basename(path)))


def check_page(r: Reproduction) -> None:
    """The page holds a block for each study this invocation writes: checked before anything trains, so a wrong
    ``--page`` fails at once instead of after the first study's runs and evaluations (``write_page``)."""
    if not os.path.isfile(r.page):
        raise ValueError(f"--page {r.page}: no such file; name a copy of docs/results.md, the page whose "
                         f"'<!-- BEGIN {r.mode} STUDY -->' blocks the results are written into")
    with open(r.page) as f:
        text = f.read()
    for study in r.studies:
        replace_block(text, r.mode, study.name, "", r.page)  # raises, naming the missing block and the fix


def write_page(r: Reproduction, study: Study, evaluated: Evaluated) -> None:
    """The study's block of the page rewritten (the table rows this scale has, its numbers and its report's plots),
    and the mode's summary of every study block's verdicts."""
    target = os.path.join(r.results, study.name)
    page_dir = os.path.dirname(os.path.abspath(r.page))
    plots = [os.path.relpath(os.path.join(target, f"{name}.png"), page_dir) for name in study.plots
             if os.path.isfile(os.path.join(target, f"{name}.png"))]
    with open(r.page) as f:
        text = f.read()
    shown = replace(study, rows=rows(r, study))
    text = replace_block(text, r.mode, study.name, study_markdown(shown, evaluated.headlines, plots, r.mode,
                                                                  evaluated.curves, evaluated.runs), r.page)
    if f"<!-- BEGIN {r.mode} {SUMMARY} -->" in text:  # the mode's summary, where the page has one, counts them
        text = replace_block(text, r.mode, SUMMARY, summary_markdown(text, r.mode), r.page)
    with open(r.page, "w") as f:
        f.write(text)


def step_seconds(out: str) -> dict[str, float]:
    """Median seconds per training step of every run under ``out``, from its metrics.jsonl (the step's tokens over
    its tokens/s): the measurement behind the budget in docs/results.md."""
    found = {}
    for path in sorted(RunDir(d).metrics for d in glob.glob(os.path.join(out, "*"))
                       if os.path.isfile(RunDir(d).metrics)):
        with open(path) as f:
            records = [rec for rec in map(json.loads, f) if rec.get("perf/tokens_per_s")]
        seen = [0] + [rec["progress/tokens_seen"] for rec in records]
        times = sorted((b - a) / rec["perf/tokens_per_s"] for a, b, rec in zip(seen, seen[1:], records) if b > a)
        if times:
            found[os.path.basename(os.path.dirname(path))] = round(times[len(times) // 2], 2)
    return found


def write_timings(r: Reproduction, stages: Stages) -> dict[str, float]:
    """RESULTS/SCALE/timings.json (timings-seeds.json for --seeds, its own runs' alone): the seconds per stage over
    every invocation that wrote OUT's ledger, the runs' median step times and the lock they ran with
    (``lock_identity``); returns the seconds per stage."""
    spent = stages.spend({})
    steps = {name: s for name, s in step_seconds(r.out).items()
             if not r.seeds or any(study.is_extra_seed(name) for study in r.studies)}
    write_json_atomic(os.path.join(r.results, r.timings),
                      {"stages_s": spent, "step_seconds_median": steps, "lock": lock_identity()})
    return spent
