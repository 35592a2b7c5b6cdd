"""Run the studies end to end: real data, SmolLM2 (``pipeline.model.gguf_import``), unit, span and pairs shards
(``pipeline.data.prep.build``), each grid's runs trained here through the sweep (``pipeline.sweep``, as
``launch/sweep.py --local``: finished runs skipped, unfinished ones resumed), every run and baseline without results
evaluated (``pipeline.eval.runner``), the kept checkpoints too on the study's curve tasks (``pipeline.reproduce.curves``),
then the report (``pipeline.eval.report.write``), the curves' plot and the results page. Each
step runs in this process from the repository root, its output (and its child processes', e.g. the training ranks)
appended to a log file; every step is skipped when its output exists, so the same command resumes. The stages are
functions of the invocation (:class:`Reproduction`) and its step runner (:class:`Stages`): ``prepare_inputs``, then
per study ``train_study`` -> its runs, ``evaluate_study`` -> its numbers, ``report_study``; then ``write_timings``
(:func:`reproduce` runs them in order, ``plan`` is ``--dry-run``).

The command line: ``python launch/reproduce.py [--scale full|quick|paper|gpu-short] [--seeds] [--from-records]
[--dry-run] [--device auto|cuda|cpu] [--study NAME]... [--out DIR] [--results DIR] [--page FILE]`` (or
``pipeline-reproduce ...``; ``--quick`` is ``--scale quick``). ``--seeds`` (``make reproduce-seeds``, after the scale's
run) trains the headline claims' extra seeds alone, seed 0's runs and the baselines read beside them from OUT or
from the records, so the seeds need neither the same machine nor its run directories; ``--from-records`` rewrites the page from the records alone (RESULTS/SCALE), training nothing and
evaluating only the untrained baselines that have no results there. ``make reproduce`` / ``make reproduce-quick`` / ``make reproduce-paper`` run it
after ``make real-data real-model``, ``make reproduce-gpu-short`` after ``make real-data`` (its one study reads no
SmolLM2). ``--dry-run`` resolves and checks everything the scale would run (each grid's runs as the sweep's table,
each task's options, the shards to build, the inputs a bare machine needs and their size) and prints it, writing
and training nothing. Training and evaluation run on the GPU where torch sees one (``--device`` says otherwise).

Outputs: runs under OUT (runs/reproduce, or runs/reproduce-SCALE for the other scales), and under RESULTS/SCALE
(docs/results/full, quick, paper or gpu-short) the small records: each run's experiment.json, metrics.jsonl and
eval results (its kept steps' too; each says which lock, ``pipeline.constraints``, made it), the logs, the report
plots and ``curves.png``, ``timings.json`` (seconds per stage summed over the invocations that wrote OUT, median
seconds per training step of each run, the lock); the tables go into
docs/results.md between its ``<!-- BEGIN MODE STUDY -->`` markers. The seconds are kept in OUT/timings.json, rewritten after every
step: a killed invocation's finished steps (and its total up to the last of them) still count, and a fresh OUT
starts from zero even though the committed records hold an earlier run's.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
from collections.abc import Callable

import torch

from pipeline.eval.config import EvalConfig
from pipeline.eval.report.write import write_report
from pipeline.eval.results import EvalResults
from pipeline.eval.reuse import evaluate_missing, missing_tasks
from pipeline.grid import SMOKE_SUFFIX
from pipeline.io import REPO, repo_relative
from pipeline.reproduce.curves import Curve, kept_steps, plot_curves, run_curve
from pipeline.reproduce.data import RealDataError
from pipeline.reproduce.inputs import REAL, prepare_inputs
from pipeline.reproduce.invocation import DEVICES, SCALES, Reproduction, chosen_runs, gpu_grids, reproduction
from pipeline.reproduce.plan import plan
from pipeline.reproduce.records import (
    Evaluated,
    check_page,
    is_row_run,
    keep_records,
    missing_seed_zero,
    write_page,
    write_timings,
)
from pipeline.reproduce.stages import Stages
from pipeline.reproduce.studies import SMOLLM2, STUDIES, Study
from pipeline.run_dir import RunDir
from pipeline.sweep.plan import SweepRequest, act, prepare

# This process evaluates while no training rank runs, on the 2 cores the ranks had: twice as fast as one thread.
# Fixed, not the machine's core count: fine-tuning sums in another order on another thread count (a POS score
# moved from 31.17 to 31.19), and the page's numbers should not depend on the machine.
EVAL_THREADS = 2


# The stages, in the order reproduce() runs them (the first, prepare_inputs, is pipeline.reproduce.inputs').

def train_study(r: Reproduction, stages: Stages, study: Study) -> list[str]:
    """The study's runs trained through the sweep (finished ones skipped, unfinished ones resumed); returns the
    study's run directories (names with -smoke in quick mode) that have an HF export."""
    request = SweepRequest(study.grid_for(r.mode), smoke=r.quick, only=chosen_runs(r, study), out=r.out,
                           action="local")
    stages.run(f"train_{study.name}", f"the runs of {study.grid_for(r.mode)}" + (" (twins)" if r.quick else "")
               + f" trained here into {r.out}", lambda: act(prepare(request)))
    return study_runs(r, study, r.out, lambda d: os.path.isdir(RunDir(d).hf))


def recorded_runs(r: Reproduction, study: Study) -> list[str]:
    """--from-records: the study's runs as their records under RESULTS/SCALE/runs (experiment, metrics, results)."""
    return [repo_relative(p) for p in study_runs(r, study, os.path.join(r.results, "runs"),
                                                  lambda d: os.path.isfile(RunDir(d).experiment_json))]


def study_runs(r: Reproduction, study: Study, directory: str, done: Callable[[str], bool]) -> list[str]:
    """The directories under ``directory`` of the study's table rows (a row's own name or its seeds', -smoke in
    quick mode) that are ``done``."""
    suffix = SMOKE_SUFFIX if r.quick else ""
    names = []
    for _, row in study.rows:
        names += sorted(os.path.basename(d) for d in glob.glob(os.path.join(directory, row + "*"))
                        if done(d) and os.path.basename(d).endswith(suffix)
                        and is_row_run(os.path.basename(d).removesuffix(suffix), row))
    return [os.path.join(directory, name) for name in names]


def with_seed_zero(r: Reproduction, study: Study, trained: list[str]) -> list[str]:
    """--seeds: the runs trained here (the extra seeds; OUT's seed 0 too where it has it) and every other run of the
    study's rows from its record (make reproduce's seed 0), in the study's row order."""
    found = {os.path.basename(p): p for p in recorded_runs(r, study)} | {os.path.basename(p): p for p in trained}
    names = [n for _, row in study.rows for n in sorted(found) if is_row_run(n.removesuffix(SMOKE_SUFFIX), row)]
    return [found[n] for n in names]


def is_record(r: Reproduction, path: str) -> bool:
    """Whether run directory ``path`` is a record under RESULTS/SCALE/runs (no weights: nothing to evaluate)."""
    return os.path.abspath(path).startswith(os.path.join(r.results, "runs") + os.sep)


def evaluate_study(r: Reproduction, stages: Stages, study: Study, runs: list[str]) -> Evaluated:
    """Every baseline and run of the study without its results evaluated (the kept checkpoints of each row's first
    seed on the curve tasks too; from records, the baselines alone: a record has no weights); returns the study's
    numbers."""
    for b in study.baselines:
        evaluate_model(r, stages, study, SMOLLM2, baseline_results(r, study, b.name), b.attention,
                       siblings=f"{b.name}-*.json", tasks=b.tasks(study.tasks), layout=b.layout)
    by_row = _row_runs(study, runs)
    firsts = {seeds[0] for seeds in by_row.values()}
    for path in (p for p in runs if not is_record(r, p)):
        run = RunDir(path)
        evaluate_model(r, stages, study, run.path, run.eval_results(study.name))
        for step in kept_steps(run) if study.curve_tasks and path in firsts else ():
            evaluate_model(r, stages, study, run.path, run.eval_results(study.name, step), tasks=study.curve_tasks,
                           step=step)
    headlines: dict[str, list[dict]] = {}
    for b in study.baselines:
        if os.path.isfile(path := baseline_results(r, study, b.name)):
            headlines[b.name] = [EvalResults.read(path).headline]
    curves: dict[str, Curve] = {}
    names: dict[str, list[str]] = {}
    for row, seeds in by_row.items():
        for path in seeds:
            if os.path.isfile(results := RunDir(path).eval_results(study.name)):
                headlines.setdefault(row, []).append(EvalResults.read(results).headline)
                names.setdefault(row, []).append(os.path.basename(path))
        if study.curves and seeds and (curve := run_curve(RunDir(seeds[0]), study.name)):
            curves[row] = curve
    return Evaluated(headlines, curves, names)


def unevaluated_baselines(r: Reproduction) -> list[str]:
    """The results files of the selected studies' baselines that are not there yet."""
    return [path for study in r.studies for b in study.baselines
            if not os.path.isfile(path := baseline_results(r, study, b.name))]


def baseline_results(r: Reproduction, study: Study, baseline: str) -> str:
    return os.path.join(r.baselines, f"{baseline}-{study.name}.json")


def _row_runs(study: Study, runs: list[str]) -> dict[str, list[str]]:
    """Table row -> its runs (its seeds' in order), for the rows that have any."""
    by_name = {os.path.basename(p).removesuffix(SMOKE_SUFFIX): p for p in runs}
    found = {}
    for _, row in study.rows:
        if seeds := [by_name[n] for n in sorted(n for n in by_name if is_row_run(n, row))]:
            found[row] = seeds
    return found


def evaluate_model(r: Reproduction, stages: Stages, study: Study, model: str, out: str, attention: str = "auto",
                   siblings: str = "*.json", tasks: str = "", step: int | None = None, layout: str | None = None
                   ) -> None:
    """The study's tasks that ``out`` has no results of (all of them without ``out``; none: nothing to do) on
    ``model``, evaluated into ``out`` as a step of eval_STUDY (``pipeline.eval.reuse.evaluate_missing``: a task
    that another study's results file of the same model, ``siblings`` beside ``out``, holds with the same options
    is copied from it, not run again: studies 1 and 3 both read STS; paths recorded relative to OUT). ``tasks``
    (default: the study's) and ``step`` (a kept checkpoint of the run ``model``) evaluate a point of the study's
    curves; ``layout`` is every task's (a baseline's reading: Echo)."""
    wanted = (tasks or study.tasks).split(",")
    if not (missing := missing_tasks(out, wanted)):
        return
    config = EvalConfig(model=model, tasks=wanted, data_dir=REAL,
                        overrides=[o for o in study.options[r.mode] if o.split(".", 1)[0] in wanted]
                        + [f"{t}.layout={layout}" for t in wanted if layout],
                        attention=attention, device=r.device, batch_size=8, progress=False, step=step)
    others = glob.glob(os.path.join(os.path.dirname(out), siblings))
    at = "" if step is None else f" (step {step})"
    stages.run(f"eval_{study.name}", f"{','.join(missing)} on {model}{at} into {out}",
               lambda: evaluate_missing(config, out, others, r.out))


def report_study(r: Reproduction, stages: Stages, study: Study, runs: list[str], evaluated: Evaluated) -> None:
    """The study's report and curves' plot into RESULTS/SCALE/STUDY, its runs' and baselines' records copied
    there, and its block of the page rewritten."""
    target = os.path.join(r.results, study.name)
    labels = {run: label for label, run in study.rows}

    def report_here() -> None:
        print(write_report(runs, target))
        if evaluated.curves:
            path = plot_curves({labels[row]: c for row, c in evaluated.curves.items()},
                               {labels[b.name]: h[0] for b in study.baselines
                                if b.name in labels and (h := evaluated.headlines.get(b.name))},
                               list(study.curves), os.path.join(target, "curves.png"),
                               f"{study.name}: evaluated over training steps ({r.mode} run)")
            print(path or "curves: no run has two evaluated steps")

    stages.run(f"report_{study.name}", f"the report of {len(runs)} runs into {target}", report_here)
    if not r.records:
        keep_records(r, study, [p for p in runs if not is_record(r, p)])
    write_page(r, study, evaluated)


def reproduce(r: Reproduction) -> None:
    """Every stage in order, from the repository root (where the records' relative paths point)."""
    if r.seeds and (missing := missing_seed_zero(r)):
        raise ValueError(f"--seeds trains the extra seeds alone and reads seed 0 beside them, but {', '.join(missing)}"
                         f" has neither a run under {r.out} nor a record under {repo_relative(r.results)}/runs: run "
                         f"`launch/reproduce.py --scale {r.mode}` (make reproduce) first")
    stages = Stages(r)
    with contextlib.chdir(REPO):
        if not r.records or unevaluated_baselines(r):  # records alone need no data, model or shards
            prepare_inputs(r, stages)
        for study in r.studies:
            runs = recorded_runs(r, study) if r.records else train_study(r, stages, study)
            if r.seeds:
                runs = with_seed_zero(r, study, runs)
            report_study(r, stages, study, runs, evaluate_study(r, stages, study, runs))
        if r.records:  # the records' timings.json stays the run's that made them
            print(f"wrote {r.page} from the records under {r.results}/ in {stages.spend({})['total']:.0f} s")
            return
        spent = write_timings(r, stages)
    print(f"wrote {r.page} and {r.results}/ in {stages.timings['total']:.0f} s ({spent['total']:.0f} s "
          "over all invocations)")


def set_rank_defaults(device: str) -> None:
    """What the training ranks inherit: DeepSpeed's accelerator by ``device`` (``resolve_device``) unless the user
    set it (the CPU grids declare CPU ranks, for which the sweep would otherwise choose the CPU even on a GPU node);
    on the CPU no GPU either, since the trainer takes one wherever torch sees it. Threads are the sweep's: the cores
    split among a run's ranks."""
    os.environ.setdefault("DS_ACCELERATOR", device)
    if device == "cpu" and torch.cuda.is_available():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def main(argv: list[str] | None = None) -> int:
    names = [s.name for s in STUDIES]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=SCALES, default="full",
                   help="full: the CPU grids (~1.7-4 h on 2 cores); quick: their -smoke twins and a few examples "
                        "(<= 20 min); paper: the papers' steps and batches (paper.yaml grids, one GPU); gpu-short: "
                        "the MLM-vs-CLM study alone at 210m (gpu_short.yaml, <= 8 min on one H200)")
    p.add_argument("--quick", action="store_const", const="quick", dest="scale", help="--scale quick")
    p.add_argument("--seeds", action="store_true",
                   help="after the scale's run: train and evaluate the headline claims' extra seeds alone (train.seed "
                        "1 and 2 of LLM2Vec's MNTP -> SimCSE chain and of MAGNET; make reproduce-seeds), seed 0 and "
                        "the baselines read from OUT or the records, which the page then averages")
    p.add_argument("--from-records", action="store_true",
                   help="rewrite the scale's page blocks and reports from its records under RESULTS/SCALE (each run's "
                        "experiment, metrics and results files): nothing trains; an untrained baseline without "
                        "results (e.g. Echo) is evaluated into them")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve, check and print what the scale would train and evaluate; write nothing")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where runs train and tasks evaluate: auto (default): the GPU where torch sees one, else the "
                        "CPU; cuda: fail without a GPU; cpu: the CPU even on a GPU machine (the ranks see no GPU)")
    p.add_argument("--study", action="append", choices=names,
                   help="run only this study (repeatable; default: every study the scale has)")
    p.add_argument("--out", help="run directories (default runs/reproduce for full, runs/reproduce-SCALE else)")
    p.add_argument("--results", default="docs/results", help="records, logs and plots go to RESULTS/SCALE")
    p.add_argument("--page", default="docs/results.md", help="the page whose generated blocks are rewritten")
    args = p.parse_args(argv)
    torch.set_num_threads(EVAL_THREADS)
    out = args.out or ("runs/reproduce" if args.scale == "full" else f"runs/reproduce-{args.scale}")
    try:
        r = reproduction(args.scale, out, args.results, args.page,
                         args.study or [s.name for s in STUDIES if s.grid_for(args.scale)
                                        and (s.extra_seeds or not args.seeds)], args.device,
                         args.seeds, args.from_records)
        if r.device != "cuda" and not args.dry_run and (gpu := gpu_grids(r)):
            raise ValueError(f"--scale {args.scale}: the runs of {', '.join(gpu)} declare GPU ranks (resources.gpu) "
                             f"and this run would be on the CPU (--device {args.device}); run it on a GPU machine, "
                             "or check it here with --dry-run")
        check_page(r)
        set_rank_defaults(r.device)
        plan(r) if args.dry_run else reproduce(r)
    except (RealDataError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
