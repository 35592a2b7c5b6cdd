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

The command line: ``python launch/reproduce.py [--scale full|quick|paper|gpu-short] [--dry-run] [--device
auto|cuda|cpu] [--study NAME]... [--out DIR] [--results DIR] [--page FILE]`` (or ``pipeline-reproduce ...``;
``--quick`` is ``--scale quick``); ``make reproduce`` / ``make reproduce-quick`` / ``make reproduce-paper`` run it
after ``make real-data real-model``, ``make reproduce-gpu-short`` after ``make real-data`` (its one study reads no
SmolLM2). ``--dry-run`` resolves and checks everything the scale would run (each grid's runs as the sweep's table,
each task's options, the shards to build, the inputs a bare machine needs and their size) and prints it, writing
and training nothing. Training and evaluation run on the GPU where torch sees one (``--device`` says otherwise).

Outputs: runs under OUT (runs/reproduce, or runs/reproduce-SCALE for the other scales), and under RESULTS/SCALE
(docs/results/full, quick, paper or gpu-short) the small records: each run's experiment.json, metrics.jsonl and
eval results (its kept steps' too), the logs, the report plots and ``curves.png``, ``timings.json`` (seconds per
stage summed over the invocations that wrote OUT, median seconds per training step of each run); the tables go into
docs/results.md between its ``<!-- BEGIN MODE STUDY -->`` markers. The seconds are kept in OUT/timings.json, rewritten after every
step: a killed invocation's finished steps (and its total up to the last of them) still count, and a fresh OUT
starts from zero even though the committed records hold an earlier run's.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import torch

from pipeline.data.format.index import MANIFEST
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.eval.registry import TASKS, task_options
from pipeline.eval.report.write import write_report
from pipeline.eval.results import EvalResults
from pipeline.eval.runner import EvalConfig, evaluate
from pipeline.experiment import REPO, repo_relative
from pipeline.grid import SMOKE_SUFFIX, Variant, load_grid
from pipeline.io import read_json, write_json_atomic
from pipeline.model.gguf_import import import_gguf, packaged_gguf
from pipeline.reproduce.curves import Curve, kept_steps, plot_curves, run_curve
from pipeline.reproduce.data import RealDataError, extract, is_extracted
from pipeline.reproduce.results import replace_block, study_markdown
from pipeline.reproduce.studies import SMOLLM2, STUDIES, Study
from pipeline.run_dir import RunDir
from pipeline.sweep.plan import SweepRequest, act, prepare

REAL = "runs/real"
DOWNLOADS = "runs/downloads"
UNIT_SHARDS = "runs/reproduce/shards/smollm2-reviews-units-{seq_len}"  # sentence units: SimCSE, MAGNET's SSCL
SPAN_SHARDS = "runs/reproduce/shards/smollm2-reviews-spans-{seq_len}"  # packed, with MAGNET spans (trainer: none)
# what experiments/reproduce/*/grid.yaml (the CPU scales) and paper.yaml read: CPU SimCSE on units cut to 32
# tokens (Wiki1M's sentences are ~25), half the cost of 64 a step
UNIT_SEQ_LEN = {"quick": 32, "full": 32, "paper": 64}
SPAN_SEQ_LEN = {"quick": 128, "full": 128, "paper": 512}
SCALES = ("full", "quick", "paper", "gpu-short")
DEVICES = ("auto", "cuda", "cpu")
PAIR_SHARDS = "runs/reproduce/shards/smollm2-pairs-64"  # LLM2Vec's supervised stage: 3 texts of <= 64 tokens a row
# This process evaluates while no training rank runs, on the 2 cores the ranks had: twice as fast as one thread.
# Fixed, not the machine's core count: fine-tuning sums in another order on another thread count (a POS score
# moved from 31.17 to 31.19), and the page's numbers should not depend on the machine.
EVAL_THREADS = 2


@contextlib.contextmanager
def _in_repo_logged_to(log: str) -> Iterator[None]:
    """Run the body from the repository root with everything it and its child processes print appended to ``log``
    (file descriptors 1 and 2 and sys.stdout/sys.stderr), a failure's traceback too; then restore both."""
    sys.stdout.flush()
    sys.stderr.flush()
    cwd, saved = os.getcwd(), (os.dup(1), os.dup(2))
    with open(log, "a", buffering=1) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            os.chdir(REPO)
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                try:
                    yield
                except BaseException:
                    traceback.print_exc()
                    raise
        finally:
            os.chdir(cwd)
            f.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def resolve_device(device: str) -> str:
    """``--device``: "auto" is the GPU where torch sees one, else the CPU; "cuda" without a GPU is an error."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False); run on a GPU "
                         "machine or pass --device cpu")
    return device


def size_mb(path: str) -> float:
    """Bytes of a file, or of every file under a directory, in MB (10^6)."""
    if os.path.isfile(path):
        return os.path.getsize(path) / 1e6
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


@dataclass(frozen=True)
class Reproduction:
    """What one invocation reproduces, and where: the scale, its studies, the device, the run directories (OUT),
    the records (RESULTS/SCALE) and the page."""

    mode: str  # the scale
    out: str  # run directories: relative to the repository when inside it, as the records name them
    results: str  # RESULTS/SCALE
    page: str
    device: str  # resolved: cuda or cpu
    studies: tuple[Study, ...]

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @property
    def logs(self) -> str:
        return os.path.join(self.results, "logs")

    @property
    def ledger(self) -> str:
        """Every invocation's seconds per stage into OUT, summed."""
        return os.path.join(self.out, "timings.json")


def reproduction(scale: str, out: str, results: str, page: str, studies: list[str],
                 device: str = "auto") -> Reproduction:
    """The invocation checked: a known scale, studies that have a grid at it, a device torch can use."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: expected one of {', '.join(SCALES)}")
    chosen = tuple(s for s in STUDIES if s.name in studies)
    if without := [s.name for s in chosen if not s.grid_for(scale)]:
        have = [s.name for s in STUDIES if s.grid_for(scale)]
        raise ValueError(f"--study {', '.join(without)}: no {scale} grid; at --scale {scale} pass "
                         + " or ".join(f"--study {n}" for n in have) + " (or no --study)")
    return Reproduction(scale, repo_relative(out), os.path.abspath(os.path.join(results, scale)),
                        os.path.abspath(page), resolve_device(device), chosen)


class Stages:
    """Runs each step from the repository root, its output appended to logs/STAGE.log, and counts its seconds: this
    invocation's per stage (``timings``) and, at once, every invocation's in OUT's ledger (a run killed later keeps
    both)."""

    def __init__(self, r: Reproduction):
        self.logs, self.out, self.ledger = r.logs, r.out, r.ledger
        self.timings: dict[str, float] = {}  # this invocation's seconds per stage
        self.mark = time.time()  # the time "total" has been counted up to

    def run(self, stage: str, what: str, step: Callable[[], None]) -> None:
        """Run a step; a failure stops with the log named (relative paths of the steps are the repository's)."""
        log = os.path.join(self.logs, f"{stage}.log")
        os.makedirs(self.logs, exist_ok=True)
        print(f"== {stage}: {what} (log: {log})", flush=True)
        t0 = time.time()
        try:
            with _in_repo_logged_to(log):
                step()
        except Exception as e:
            raise RuntimeError(f"{stage} failed ({type(e).__name__}: {e}); see {log}, fix it and run the same "
                               "command again (finished steps are skipped)") from e
        finally:
            self.spend({stage: time.time() - t0})

    def spend(self, seconds: dict[str, float]) -> dict[str, float]:
        """Add ``seconds`` per stage, and the time since the last call as "total", to this invocation's timings and
        to OUT's ledger; returns the ledger."""
        now, spent = time.time(), self.spent()
        for stage, s in {**seconds, "total": now - self.mark}.items():
            self.timings[stage] = round(self.timings.get(stage, 0.0) + s, 1)
            spent[stage] = round(spent.get(stage, 0.0) + s, 1)
        self.mark = now
        os.makedirs(self.out, exist_ok=True)
        write_json_atomic(self.ledger, {"stages_s": spent})
        return spent

    def spent(self) -> dict[str, float]:
        """Seconds per stage over the invocations that wrote OUT (none yet: empty)."""
        if not os.path.isfile(self.ledger):
            return {}
        return read_json(self.ledger, "remove it to count from zero", what="timings ledger")["stages_s"]


# What the scale reads and builds, from its studies' grids.

def variants(r: Reproduction, study: Study) -> list[Variant]:
    """The runs of the study's grid at this scale (the -smoke twins in quick mode), resolved and validated."""
    return load_grid(os.path.join(REPO, study.grid_for(r.mode))).variants(smoke=r.quick, out=r.out)


def reads_smollm2(r: Reproduction) -> bool:
    """Whether a selected study reads SmolLM2: a baseline, or a run that starts from it or uses its tokenizer
    (every SmolLM2 study does; the from-scratch study reads only the sample corpus and its tokenizer)."""
    model = os.path.join(REPO, SMOLLM2)
    return any(study.baselines or any(model in (os.path.join(REPO, v.experiment.model.init),
                                                os.path.join(REPO, v.experiment.data.tokenizer))
                                      for v in variants(r, study)) for study in r.studies)


def shard_builds(r: Reproduction) -> list[tuple[str, str, BuildConfig]]:
    """(stage, what, build) of the shards the selected studies' runs read that the trainer does not build."""
    reviews = (f"{REAL}/text/reviews.jsonl",)
    pairs = tuple(sorted(glob.glob(os.path.join(REPO, REAL, "pairs", "*.jsonl"))))
    builds = []
    if unit_len := UNIT_SEQ_LEN.get(r.mode):  # the SmolLM2 scales
        units = UNIT_SHARDS.format(seq_len=unit_len)
        builds.append(("unit_shards", f"sentence units of {reviews[0]} ({unit_len} tokens) into {units}",
                       BuildConfig(inputs=reviews, tokenizer=SMOLLM2, output=units, seq_len=unit_len,
                                   units="sentence", progress=False)))
    if span_len := SPAN_SEQ_LEN.get(r.mode):
        spans = SPAN_SHARDS.format(seq_len=span_len)
        builds.append(("span_shards", f"{reviews[0]} packed into {span_len} tokens with spans into {spans}",
                       BuildConfig(inputs=reviews, tokenizer=SMOLLM2, output=spans, seq_len=span_len,
                                   span_fraction=0.15, progress=False)))
    builds.append(("pair_shards", f"{REAL}/pairs (64 tokens a text) into {PAIR_SHARDS}",
                   BuildConfig(inputs=pairs, tokenizer=SMOLLM2, output=PAIR_SHARDS, seq_len=64, pairs=True,
                               instructions=f"{REAL}/pairs/instructions.json", progress=False)))
    read = {os.path.join(REPO, path) for study in r.studies for v in variants(r, study)
            for path in (v.experiment.data.shards, v.experiment.data.unit_shards, v.experiment.data.pair_shards)
            if path}
    return [b for b in builds if os.path.join(REPO, b[2].output) in read]


def inputs(r: Reproduction) -> list[str]:
    """What the scale reads that nothing here makes from something else (absolute paths): the extracted data
    (``make real-data``), SmolLM2 where a study reads it, each run's tokenizer and the files its trainer builds
    shards from (a pattern's directory). Their size is what a machine with nothing under runs/ must be given
    (gpu-short: <= 40 MB)."""
    paths = {os.path.join(REPO, REAL)} | ({os.path.join(REPO, SMOLLM2)} if reads_smollm2(r) else set())
    for study in r.studies:
        for v in variants(r, study):
            paths.add(os.path.join(REPO, v.experiment.data.tokenizer))
            paths.update(os.path.join(REPO, pattern.split("*")[0].rstrip(os.sep))
                         for pattern in v.experiment.data.build_inputs)
    return sorted(p for p in paths if not any(p.startswith(other + os.sep) for other in paths))


def gpu_grids(r: Reproduction) -> list[str]:
    """The selected studies' grids at this scale whose runs declare GPU ranks (the paper and gpu-short scales)."""
    return [s.grid_for(r.mode) for s in r.studies if any(v.resources.gpu for v in variants(r, s))]


def rows(r: Reproduction, study: Study) -> tuple[tuple[str, str], ...]:
    """The study's table rows this scale has: its baselines and the runs of the scale's grids (MAGNET's table
    shows the LLM2Vec study's; gpu-short leaves the CPT chain out)."""
    names = {v.name.removesuffix(SMOKE_SUFFIX) for s in STUDIES if s.grid_for(r.mode)
             for v in variants(r, s)} | {b.name for b in study.baselines}
    return tuple((label, row) for label, row in study.rows
                 if row in names or any(n.startswith(row + "-s") for n in names))


def plan(r: Reproduction) -> None:
    """--dry-run: every run of the scale resolved and validated (the sweep's table: model, steps, tokens,
    phases, start run, state), each study's evaluation options, the shards to build; nothing written."""
    with contextlib.chdir(REPO):
        for _, what, config in shard_builds(r):
            print(f"shards: {what}: " + ("built" if os.path.isfile(os.path.join(config.output, MANIFEST))
                                         else "to build"))
        sizes = {os.path.relpath(p, REPO): size_mb(p) if os.path.exists(p) else None for p in inputs(r)}
        print(f"device: {r.device}; inputs: " + ", ".join(
            f"{p} {mb:.1f} MB" if mb is not None else f"{p} not here" for p, mb in sizes.items())
              + f"; {sum(mb or 0 for mb in sizes.values()):.1f} MB here in all")
        for study in r.studies:
            print(f"\n== {study.name} ({r.mode} scale): {study.grid_for(r.mode)}" + (" (twins)" if r.quick else ""))
            prepare(SweepRequest(study.grid_for(r.mode), smoke=r.quick, out=r.out))
            for task, options in task_options(study.tasks.split(","), study.options[r.mode]).items():
                print(f"eval {task}: {asdict(options)}")


# The stages, in the order reproduce() runs them.

def prepare_inputs(r: Reproduction, stages: Stages) -> None:
    """The real data extracted, SmolLM2 imported where a study reads it, the shards the runs read built."""
    if not is_extracted(os.path.join(REPO, REAL)):
        extract(os.path.join(REPO, DOWNLOADS), os.path.join(REPO, REAL))
    if reads_smollm2(r) and not os.path.isfile(os.path.join(REPO, SMOLLM2, "config.json")):
        stages.run("import_smollm2", f"import the packaged GGUF into {SMOLLM2}",
                   lambda: print(f"wrote {import_gguf(packaged_gguf(), SMOLLM2)}"))
    for stage, what, config in shard_builds(r):
        if not os.path.isfile(os.path.join(REPO, config.output, MANIFEST)):
            stages.run(stage, what, lambda config=config: run_job(config))


def train_study(r: Reproduction, stages: Stages, study: Study) -> list[str]:
    """The study's runs trained through the sweep (finished ones skipped, unfinished ones resumed); returns the
    study's run directories (names with -smoke in quick mode) that have an HF export."""
    request = SweepRequest(study.grid_for(r.mode), smoke=r.quick, out=r.out, action="local")
    stages.run(f"train_{study.name}", f"the runs of {study.grid_for(r.mode)}" + (" (twins)" if r.quick else "")
               + f" trained here into {r.out}", lambda: act(prepare(request)))
    suffix = SMOKE_SUFFIX if r.quick else ""
    names = []
    for _, row in study.rows:
        names += sorted(os.path.basename(d) for d in glob.glob(os.path.join(r.out, row + "*"))
                        if os.path.isdir(RunDir(d).hf) and os.path.basename(d).endswith(suffix)
                        and (os.path.basename(d).removesuffix(suffix) == row
                             or os.path.basename(d).removesuffix(suffix).startswith(row + "-s")))
    return [os.path.join(r.out, name) for name in names]


@dataclass(frozen=True)
class Evaluated:
    """A study's evaluated numbers: each table row's headline numbers (one per seed) and each row's curve over the
    chain's steps (the first seed's)."""

    headlines: dict[str, list[dict]]
    curves: dict[str, Curve]


def evaluate_study(r: Reproduction, stages: Stages, study: Study, runs: list[str]) -> Evaluated:
    """Every baseline and run of the study without its results evaluated (the kept checkpoints on the curve
    tasks too); returns the study's numbers."""
    for b in study.baselines:
        evaluate_model(r, stages, study, SMOLLM2, baseline_results(r, study, b.name), b.attention,
                       siblings=f"{b.name}-*.json")
    for path in runs:
        run = RunDir(path)
        evaluate_model(r, stages, study, run.path, run.eval_results(study.name))
        for step in kept_steps(run) if study.curve_tasks else ():
            evaluate_model(r, stages, study, run.path, run.eval_results(study.name, step), tasks=study.curve_tasks,
                           step=step)
    headlines: dict[str, list[dict]] = {}
    for b in study.baselines:
        if os.path.isfile(path := baseline_results(r, study, b.name)):
            headlines[b.name] = [EvalResults.read(path).headline]
    curves: dict[str, Curve] = {}
    for row, seeds in _row_runs(study, runs).items():
        for path in seeds:
            if os.path.isfile(results := RunDir(path).eval_results(study.name)):
                headlines.setdefault(row, []).append(EvalResults.read(results).headline)
        if study.curves and seeds and (curve := run_curve(RunDir(seeds[0]), study.name)):
            curves[row] = curve
    return Evaluated(headlines, curves)


def baseline_results(r: Reproduction, study: Study, baseline: str) -> str:
    return os.path.join(r.out, "baselines", f"{baseline}-{study.name}.json")


def _row_runs(study: Study, runs: list[str]) -> dict[str, list[str]]:
    """Table row -> its runs (its seeds' in order), for the rows that have any."""
    by_name = {os.path.basename(p).removesuffix(SMOKE_SUFFIX): p for p in runs}
    found = {}
    for _, row in study.rows:
        if seeds := [by_name[n] for n in sorted(n for n in by_name if n == row or n.startswith(row + "-s"))]:
            found[row] = seeds
    return found


def evaluate_model(r: Reproduction, stages: Stages, study: Study, model: str, out: str, attention: str = "auto",
                   siblings: str = "*.json", tasks: str = "", step: int | None = None) -> None:
    """The study's tasks that ``out`` has no results of (all of them without ``out``; none: nothing to do) on
    ``model``, merged into ``out``: written when a task finished, a failed task is an error (the finished ones
    are kept, so a re-run evaluates only what is missing, e.g. a task a study gained). A task that another
    study's results file of the same model (``siblings``, beside ``out``) holds with the same options is copied
    from it, not run again: studies 1 and 3 both read STS. ``tasks`` (default: the study's) and ``step`` (a kept
    checkpoint of the run ``model``) evaluate a point of the study's curves."""
    before = EvalResults.read(out) if os.path.isfile(out) else EvalResults({}, {}, {})
    wanted = (tasks or study.tasks).split(",")
    tasks = [t for t in wanted if t not in before.results]
    if not tasks:
        return
    config = EvalConfig(model=model, tasks=tasks, data_dir=REAL,
                        overrides=[o for o in study.options[r.mode] if o.split(".", 1)[0] in tasks],
                        attention=attention, device=r.device, batch_size=8, progress=False, step=step)
    reused = _evaluated_elsewhere(config, glob.glob(os.path.join(os.path.dirname(out), siblings)), out)
    config.tasks = [t for t in tasks if t not in reused]
    config.overrides = [o for o in config.overrides if o.split(".", 1)[0] in config.tasks]

    def evaluate_here() -> None:
        if config.tasks:
            results = evaluate(config)
        else:  # every task is another study's
            other = next(iter(reused.values()))[1]
            results = EvalResults(asdict(config), other.model, other.environment)
        for task, (path, other) in reused.items():
            print(f"{task}: the results of {path} (the same model and options)")
            results.with_task_of(other, task, os.path.basename(path), TASKS[task].headline(other.results[task]))
        results = results.merge(before, wanted)
        if results.write(out):
            print(f"wrote {out}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.headline.items()))
        if results.failed or not results.results:
            raise RuntimeError("; ".join(results.failure_lines()) or "no task finished")

    at = "" if step is None else f" (step {step})"
    stages.run(f"eval_{study.name}", f"{','.join(tasks)} on {model}{at} into {out}", evaluate_here)


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
    keep_records(r, study, runs)
    page_dir = os.path.dirname(os.path.abspath(r.page))
    plots = [os.path.relpath(os.path.join(target, f"{name}.png"), page_dir) for name in study.plots
             if os.path.isfile(os.path.join(target, f"{name}.png"))]
    with open(r.page) as f:
        text = f.read()
    shown = replace(study, rows=rows(r, study))
    text = replace_block(text, r.mode, study.name, study_markdown(shown, evaluated.headlines, plots, r.mode,
                                                                  evaluated.curves), r.page)
    with open(r.page, "w") as f:
        f.write(text)


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
    """RESULTS/SCALE/timings.json: the seconds per stage over every invocation that wrote OUT and the runs' median
    step times; returns the seconds per stage."""
    spent = stages.spend({})
    write_json_atomic(os.path.join(r.results, "timings.json"),
                      {"stages_s": spent, "step_seconds_median": step_seconds(r.out)})
    return spent


def reproduce(r: Reproduction) -> None:
    """Every stage in order, from the repository root (where the records' relative paths point)."""
    stages = Stages(r)
    with contextlib.chdir(REPO):
        prepare_inputs(r, stages)
        for study in r.studies:
            runs = train_study(r, stages, study)
            report_study(r, stages, study, runs, evaluate_study(r, stages, study, runs))
        spent = write_timings(r, stages)
    print(f"wrote {r.page} and {r.results}/ in {stages.timings['total']:.0f} s ({spent['total']:.0f} s "
          "over all invocations)")


def _evaluated_elsewhere(config: EvalConfig, paths: list[str], out: str) -> dict[str, tuple[str, EvalResults]]:
    """Task -> (results file, its contents) for each of ``config``'s tasks that a results file in ``paths`` (not
    ``out``) has for the same model, attention, data and batch size with the options ``config`` would run."""
    wanted = {t: asdict(o) for t, o in task_options(config.tasks, config.overrides).items()}
    same = {k: v for k, v in asdict(config).items() if k not in ("tasks", "overrides", "progress")}
    found: dict[str, tuple[str, EvalResults]] = {}
    for path in sorted(p for p in paths if os.path.abspath(p) != os.path.abspath(out)):
        other = EvalResults.read(path)
        if {k: other.config.get(k) for k in same} != same:
            continue
        for task, options in wanted.items():
            if task not in found and task in other.results and other.options.get(task) == options:
                found[task] = (path, other)
    return found


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
                         args.study or [s.name for s in STUDIES if s.grid_for(args.scale)], args.device)
        if r.device != "cuda" and not args.dry_run and (gpu := gpu_grids(r)):
            raise ValueError(f"--scale {args.scale}: the runs of {', '.join(gpu)} declare GPU ranks (resources.gpu) "
                             f"and this run would be on the CPU (--device {args.device}); run it on a GPU machine, "
                             "or check it here with --dry-run")
        set_rank_defaults(r.device)
        plan(r) if args.dry_run else reproduce(r)
    except (RealDataError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
