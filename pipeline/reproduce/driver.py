"""Run the studies end to end: real data, SmolLM2 (``pipeline.model.gguf_import``), unit, span and pairs shards
(``pipeline.data.build``), each grid's runs trained here through the sweep (``pipeline.sweep``, as
``launch/sweep.py --local``: finished runs skipped, unfinished ones resumed), every run and baseline without results
evaluated (``pipeline.eval.runner``), the kept checkpoints too on the study's curve tasks (``pipeline.reproduce.curves``),
then the report (``pipeline.eval.report.write``), the curves' plot and the results page. Each
step runs in this process from the repository root, its output (and its child processes', e.g. the training ranks)
appended to a log file; every step is skipped when its output exists, so the same command resumes.

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
from dataclasses import asdict, replace

import torch

from pipeline.data.build import run_job
from pipeline.data.build_config import BuildConfig
from pipeline.data.manifest import MANIFEST
from pipeline.eval.registry import TASKS, task_options
from pipeline.eval.report.write import write_report
from pipeline.eval.results import EvalResults
from pipeline.eval.runner import EvalConfig, evaluate
from pipeline.experiment import REPO
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


class Driver:
    def __init__(self, scale: str, out: str, results: str, page: str, studies: list[str], device: str = "auto"):
        if scale not in SCALES:
            raise ValueError(f"scale {scale!r}: expected one of {', '.join(SCALES)}")
        self.quick, self.mode = scale == "quick", scale
        self.out, self.results = out, os.path.abspath(os.path.join(results, self.mode))
        self.page = os.path.abspath(page)
        self.device = resolve_device(device)
        self.studies = [s for s in STUDIES if s.name in studies]
        if without := [s.name for s in self.studies if not s.grid_for(scale)]:
            have = [s.name for s in STUDIES if s.grid_for(scale)]
            raise ValueError(f"--study {', '.join(without)}: no {scale} grid; at --scale {scale} pass "
                             + " or ".join(f"--study {n}" for n in have) + " (or no --study)")
        self.logs = os.path.join(self.results, "logs")
        self.timings: dict[str, float] = {}  # this invocation's seconds per stage
        self.ledger = os.path.join(out, "timings.json")  # every invocation's into OUT, summed
        self.mark = time.time()  # the time "total" has been counted up to

    def _run(self, stage: str, what: str, step: Callable[[], None]) -> None:
        """Run a step from the repository root, its output appended to logs/STAGE.log; a failure stops with the log
        named (relative paths of the steps are the repository's)."""
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
        to OUT's ledger at once (a run killed later keeps both); returns the ledger."""
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

    def prepare(self) -> None:
        if not is_extracted(os.path.join(REPO, REAL)):
            extract(os.path.join(REPO, DOWNLOADS), os.path.join(REPO, REAL))
        if self.reads_smollm2() and not os.path.isfile(os.path.join(REPO, SMOLLM2, "config.json")):
            self._run("import_smollm2", f"import the packaged GGUF into {SMOLLM2}",
                      lambda: print(f"wrote {import_gguf(packaged_gguf(), SMOLLM2)}"))
        for stage, what, config in self.shard_builds():
            if not os.path.isfile(os.path.join(REPO, config.output, MANIFEST)):
                self._run(stage, what, lambda config=config: run_job(config))

    def variants(self, study: Study) -> list[Variant]:
        """The runs of the study's grid at this scale (the -smoke twins in quick mode), resolved and validated."""
        return load_grid(os.path.join(REPO, study.grid_for(self.mode))).variants(smoke=self.quick, out=self.out)

    def reads_smollm2(self) -> bool:
        """Whether a selected study reads SmolLM2: a baseline, or a run that starts from it or uses its tokenizer
        (every SmolLM2 study does; the from-scratch study reads only the sample corpus and its tokenizer)."""
        model = os.path.join(REPO, SMOLLM2)
        return any(study.baselines or any(model in (os.path.join(REPO, v.experiment.model.init),
                                                    os.path.join(REPO, v.experiment.data.tokenizer))
                                          for v in self.variants(study)) for study in self.studies)

    def shard_builds(self) -> list[tuple[str, str, BuildConfig]]:
        """(stage, what, build) of the shards the selected studies' runs read that the trainer does not build."""
        reviews = (f"{REAL}/text/reviews.jsonl",)
        pairs = tuple(sorted(glob.glob(os.path.join(REPO, REAL, "pairs", "*.jsonl"))))
        builds = []
        if unit_len := UNIT_SEQ_LEN.get(self.mode):  # the SmolLM2 scales
            units = UNIT_SHARDS.format(seq_len=unit_len)
            builds.append(("unit_shards", f"sentence units of {reviews[0]} ({unit_len} tokens) into {units}",
                           BuildConfig(inputs=reviews, tokenizer=SMOLLM2, output=units, seq_len=unit_len,
                                       units="sentence", progress=False)))
        if span_len := SPAN_SEQ_LEN.get(self.mode):
            spans = SPAN_SHARDS.format(seq_len=span_len)
            builds.append(("span_shards", f"{reviews[0]} packed into {span_len} tokens with spans into {spans}",
                           BuildConfig(inputs=reviews, tokenizer=SMOLLM2, output=spans, seq_len=span_len,
                                       span_fraction=0.15, progress=False)))
        builds.append(("pair_shards", f"{REAL}/pairs (64 tokens a text) into {PAIR_SHARDS}",
                       BuildConfig(inputs=pairs, tokenizer=SMOLLM2, output=PAIR_SHARDS, seq_len=64, pairs=True,
                                   instructions=f"{REAL}/pairs/instructions.json", progress=False)))
        read = {os.path.join(REPO, path) for study in self.studies for v in self.variants(study)
                for path in (v.experiment.data.shards, v.experiment.data.unit_shards, v.experiment.data.pair_shards)
                if path}
        return [b for b in builds if os.path.join(REPO, b[2].output) in read]

    def inputs(self) -> list[str]:
        """What the scale reads that nothing here makes from something else (absolute paths): the extracted data
        (``make real-data``), SmolLM2 where a study reads it, each run's tokenizer and the files its trainer builds
        shards from (a pattern's directory). Their size is what a machine with nothing under runs/ must be given
        (gpu-short: <= 40 MB)."""
        paths = {os.path.join(REPO, REAL)} | ({os.path.join(REPO, SMOLLM2)} if self.reads_smollm2() else set())
        for study in self.studies:
            for v in self.variants(study):
                paths.add(os.path.join(REPO, v.experiment.data.tokenizer))
                paths.update(os.path.join(REPO, pattern.split("*")[0].rstrip(os.sep))
                             for pattern in v.experiment.data.build_inputs)
        return sorted(p for p in paths if not any(p.startswith(other + os.sep) for other in paths))

    def gpu_grids(self) -> list[str]:
        """The selected studies' grids at this scale whose runs declare GPU ranks (the paper and gpu-short
        scales)."""
        return [s.grid_for(self.mode) for s in self.studies if any(v.resources.gpu for v in self.variants(s))]

    def rows(self, study: Study) -> tuple[tuple[str, str], ...]:
        """The study's table rows this scale has: its baselines and the runs of the scale's grids (MAGNET's table
        shows the LLM2Vec study's; gpu-short leaves the CPT chain out)."""
        names = {v.name.removesuffix(SMOKE_SUFFIX) for s in STUDIES if s.grid_for(self.mode)
                 for v in self.variants(s)} | {b.name for b in study.baselines}
        return tuple((label, row) for label, row in study.rows
                     if row in names or any(n.startswith(row + "-s") for n in names))

    def plan(self) -> None:
        """--dry-run: every run of the scale resolved and validated (the sweep's table: model, steps, tokens,
        phases, start run, state), each study's evaluation options, the shards to build; nothing written."""
        with contextlib.chdir(REPO):
            for _, what, config in self.shard_builds():
                print(f"shards: {what}: " + ("built" if os.path.isfile(os.path.join(config.output, MANIFEST))
                                             else "to build"))
            inputs = {os.path.relpath(p, REPO): size_mb(p) if os.path.exists(p) else None for p in self.inputs()}
            print(f"device: {self.device}; inputs: " + ", ".join(
                f"{p} {mb:.1f} MB" if mb is not None else f"{p} not here" for p, mb in inputs.items())
                  + f"; {sum(mb or 0 for mb in inputs.values()):.1f} MB here in all")
            for study in self.studies:
                print(f"\n== {study.name} ({self.mode} scale): {study.grid_for(self.mode)}"
                      + (" (twins)" if self.quick else ""))
                prepare(SweepRequest(study.grid_for(self.mode), smoke=self.quick, out=self.out))
                for task, options in task_options(study.tasks.split(","), study.options[self.mode]).items():
                    print(f"eval {task}: {asdict(options)}")

    def train(self, study: Study) -> None:
        request = SweepRequest(study.grid_for(self.mode), smoke=self.quick, out=self.out, action="local")
        self._run(f"train_{study.name}", f"the runs of {study.grid_for(self.mode)}" + (" (twins)" if self.quick else "")
                  + f" trained here into {self.out}", lambda: act(prepare(request)))

    def run_names(self, study: Study) -> list[str]:
        """The study's run directories (names with -smoke in quick mode) that have an HF export."""
        suffix = SMOKE_SUFFIX if self.quick else ""
        names = []
        for _, row in study.rows:
            names += sorted(os.path.basename(d) for d in glob.glob(os.path.join(self.out, row + "*"))
                            if os.path.isdir(RunDir(d).hf) and os.path.basename(d).endswith(suffix)
                            and (os.path.basename(d).removesuffix(suffix) == row
                                 or os.path.basename(d).removesuffix(suffix).startswith(row + "-s")))
        return names

    def evaluate(self, study: Study) -> None:
        for b in study.baselines:
            self._evaluate(study, SMOLLM2, os.path.join(self.out, "baselines", f"{b.name}-{study.name}.json"),
                           b.attention, siblings=f"{b.name}-*.json")
        for name in self.run_names(study):
            run = RunDir(os.path.join(self.out, name))
            self._evaluate(study, run.path, run.eval_results(study.name))
            for step in kept_steps(run) if study.curve_tasks else ():
                self._evaluate(study, run.path, run.eval_results(study.name, step), tasks=study.curve_tasks, step=step)

    def _evaluate(self, study: Study, model: str, out: str, attention: str = "auto", siblings: str = "*.json",
                  tasks: str = "", step: int | None = None) -> None:
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
                            overrides=[o for o in study.options[self.mode] if o.split(".", 1)[0] in tasks],
                            attention=attention, device=self.device, batch_size=8,
                            progress=False, step=step)
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
        self._run(f"eval_{study.name}", f"{','.join(tasks)} on {model}{at} into {out}", evaluate_here)

    def headlines(self, study: Study) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = {}
        for b in study.baselines:
            path = os.path.join(self.out, "baselines", f"{b.name}-{study.name}.json")
            if os.path.isfile(path):
                found[b.name] = [EvalResults.read(path).headline]
        runs = {name.removesuffix(SMOKE_SUFFIX): name for name in self.run_names(study)}
        for _, row in study.rows:
            for name in sorted(n for n in runs if n == row or n.startswith(row + "-s")):
                path = RunDir(os.path.join(self.out, runs[name])).eval_results(study.name)
                if os.path.isfile(path):
                    found.setdefault(row, []).append(EvalResults.read(path).headline)
        return found

    def curves(self, study: Study) -> dict[str, Curve]:
        """Row run name -> its numbers over the chain's steps (the first seed's, for rows with seeds)."""
        found = {}
        runs = {name.removesuffix(SMOKE_SUFFIX): name for name in self.run_names(study)}
        for _, row in study.rows:
            names = sorted(n for n in runs if n == row or n.startswith(row + "-s"))
            if names and (curve := run_curve(RunDir(os.path.join(self.out, runs[names[0]])), study.name)):
                found[row] = curve
        return found

    def report(self, study: Study) -> None:
        target = os.path.join(self.results, study.name)
        runs = [os.path.join(self.out, n) for n in self.run_names(study)]
        curves = self.curves(study) if study.curves else {}
        labels = {run: label for label, run in study.rows}

        def report_here() -> None:
            print(write_report(runs, target))
            if curves:
                path = plot_curves({labels[r]: c for r, c in curves.items()},
                                   {labels[b.name]: h[0] for b in study.baselines
                                    if b.name in labels and (h := self.headlines(study).get(b.name))},
                                   list(study.curves), os.path.join(target, "curves.png"),
                                   f"{study.name}: evaluated over training steps ({self.mode} run)")
                print(path or "curves: no run has two evaluated steps")

        self._run(f"report_{study.name}", f"the report of {len(runs)} runs into {target}", report_here)
        for path in runs:
            run, keep = RunDir(path), os.path.join(self.results, "runs", os.path.basename(path))
            for rel in (os.path.relpath(p, path) for p in (run.experiment_json, run.metrics, *run.all_eval_results(),
                                                           *run.step_eval_results())):
                if os.path.isfile(os.path.join(path, rel)):
                    os.makedirs(os.path.dirname(os.path.join(keep, rel)), exist_ok=True)
                    shutil.copyfile(os.path.join(path, rel), os.path.join(keep, rel))
        for path in glob.glob(os.path.join(self.out, "baselines", f"*-{study.name}.json")):
            os.makedirs(os.path.join(self.results, "baselines"), exist_ok=True)
            shutil.copyfile(path, os.path.join(self.results, "baselines", os.path.basename(path)))
        page_dir = os.path.dirname(os.path.abspath(self.page))
        plots = [os.path.relpath(os.path.join(target, f"{name}.png"), page_dir) for name in study.plots
                 if os.path.isfile(os.path.join(target, f"{name}.png"))]
        with open(self.page) as f:
            text = f.read()
        shown = replace(study, rows=self.rows(study))
        text = replace_block(text, self.mode, study.name, study_markdown(shown, self.headlines(study), plots,
                                                                         self.mode, curves), self.page)
        with open(self.page, "w") as f:
            f.write(text)

    def step_seconds(self) -> dict[str, float]:
        """Median seconds per training step of every run, from its metrics.jsonl (the step's tokens over its
        tokens/s): the measurement behind the budget in docs/results.md."""
        out = {}
        for path in sorted(RunDir(d).metrics for d in glob.glob(os.path.join(self.out, "*"))
                           if os.path.isfile(RunDir(d).metrics)):
            with open(path) as f:
                records = [r for r in map(json.loads, f) if r.get("perf/tokens_per_s")]
            seen = [0] + [r["progress/tokens_seen"] for r in records]
            times = sorted((b - a) / r["perf/tokens_per_s"] for a, b, r in zip(seen, seen[1:], records) if b > a)
            if times:
                out[os.path.basename(os.path.dirname(path))] = round(times[len(times) // 2], 2)
        return out

    def run(self) -> None:
        self.prepare()
        for study in self.studies:
            self.train(study)
            self.evaluate(study)
            self.report(study)
        spent = self.spend({})
        write_json_atomic(os.path.join(self.results, "timings.json"),
                          {"stages_s": spent, "step_seconds_median": self.step_seconds()})
        print(f"wrote {self.page} and {self.results}/ in {self.timings['total']:.0f} s ({spent['total']:.0f} s "
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
        driver = Driver(args.scale, os.path.abspath(out), args.results, args.page,
                        args.study or [s.name for s in STUDIES if s.grid_for(args.scale)], args.device)
        if driver.device != "cuda" and not args.dry_run and (gpu := driver.gpu_grids()):
            raise ValueError(f"--scale {args.scale}: the runs of {', '.join(gpu)} declare GPU ranks (resources.gpu) "
                             f"and this run would be on the CPU (--device {args.device}); run it on a GPU machine, "
                             "or check it here with --dry-run")
        set_rank_defaults(driver.device)
        driver.plan() if args.dry_run else driver.run()
    except (RealDataError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
