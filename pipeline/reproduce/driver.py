"""Run the studies end to end: real data, SmolLM2, unit shards, each grid through launch/sweep.py --local (finished
runs skipped, unfinished ones resumed), launch/evaluate.py on every run and baseline without results, then
launch/report.py and the results page. Every step is skipped when its output exists, so the same command resumes.

Outputs: runs under OUT (runs/reproduce or runs/reproduce-quick), and under RESULTS/MODE (docs/results/full or
docs/results/quick) the small records: each run's experiment.json, metrics.jsonl and eval results, the logs, the
report plots, ``timings.json`` (seconds per stage summed over invocations, median seconds per training step of
each run); the tables go into docs/results.md between its ``<!-- BEGIN MODE STUDY -->`` markers.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

from pipeline.data.manifest import MANIFEST
from pipeline.reproduce.data import extract
from pipeline.reproduce.results import replace_block, study_markdown
from pipeline.reproduce.studies import SMOLLM2, STUDIES, Study
from pipeline.run_dir import RunDir
from pipeline.train.experiment import REPO

REAL = "runs/real"
DOWNLOADS = "runs/downloads"
UNIT_SHARDS = "runs/reproduce/shards/smollm2-reviews-units-64"
SPAN_SHARDS = "runs/reproduce/shards/smollm2-reviews-spans-128"  # packed, with MAGNET spans (trainer-built: none)
SMOKE = "-smoke"


class Driver:
    def __init__(self, quick: bool, out: str, results: str, page: str, studies: list[str]):
        self.quick, self.mode = quick, "quick" if quick else "full"
        self.out, self.results, self.page = out, os.path.join(results, self.mode), page
        self.studies = [s for s in STUDIES if s.name in studies]
        self.logs = os.path.join(self.results, "logs")
        self.timings: dict[str, float] = {}
        os.makedirs(self.logs, exist_ok=True)

    def _run(self, stage: str, cmd: list[str]) -> None:
        """Run a repository command, its output appended to logs/STAGE.log; a failure stops with the log named."""
        log = os.path.join(self.logs, f"{stage}.log")
        print(f"== {stage}: {' '.join(cmd)} (log: {log})", flush=True)
        t0 = time.time()
        env = dict(os.environ, PYTHONPATH=REPO, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with open(log, "a") as f:
            rc = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        self.timings[stage] = self.timings.get(stage, 0.0) + round(time.time() - t0, 1)
        if rc != 0:
            raise RuntimeError(f"{stage} failed (exit status {rc}); see {log}, fix it and run the same command again "
                               "(finished steps are skipped)")

    def prepare(self) -> None:
        if not os.path.isfile(os.path.join(REPO, REAL, "manifest.json")):
            extract(os.path.join(REPO, DOWNLOADS), os.path.join(REPO, REAL))
        if not os.path.isfile(os.path.join(REPO, SMOLLM2, "config.json")):
            self._run("import_smollm2", ["launch/import_gguf.py", "--output", SMOLLM2])
        if not os.path.isfile(os.path.join(REPO, UNIT_SHARDS, MANIFEST)):
            self._run("unit_shards", ["data_prep/build_shards.py", "--input", f"{REAL}/text/reviews.jsonl",
                                      "--units", "sentence", "--max-unit-tokens", "64", "--no-progress",
                                      "--tokenizer", SMOLLM2, "--output", UNIT_SHARDS])
        if not os.path.isfile(os.path.join(REPO, SPAN_SHARDS, MANIFEST)):
            self._run("span_shards", ["data_prep/build_shards.py", "--input", f"{REAL}/text/reviews.jsonl",
                                      "--seq-len", "128", "--span-fraction", "0.15", "--no-progress",
                                      "--tokenizer", SMOLLM2, "--output", SPAN_SHARDS])

    def train(self, study: Study) -> None:
        self._run(f"train_{study.name}", ["launch/sweep.py", study.grid, *(["--smoke"] if self.quick else []),
                                          "--local", "--out", self.out])

    def run_names(self, study: Study) -> list[str]:
        """The study's run directories (names with -smoke in quick mode) that have an HF export."""
        suffix = SMOKE if self.quick else ""
        names = []
        for _, row in study.rows:
            names += sorted(os.path.basename(d) for d in glob.glob(os.path.join(self.out, row + "*"))
                            if os.path.isdir(RunDir(d).hf) and os.path.basename(d).endswith(suffix)
                            and (os.path.basename(d).removesuffix(suffix) == row
                                 or os.path.basename(d).removesuffix(suffix).startswith(row + "-s")))
        return names

    def evaluate(self, study: Study) -> None:
        common = ["--tasks", study.tasks, "--data-dir", REAL, "--no-progress", "--batch-size", "8",
                  *(x for s in study.options[self.mode] for x in ("--set", s))]
        for b in study.baselines:
            out = os.path.join(self.out, "baselines", f"{b.name}-{study.name}.json")
            if not os.path.isfile(out):
                self._run(f"eval_{study.name}", ["launch/evaluate.py", "--model", SMOLLM2, "--attention", b.attention,
                                                 "--out", out, *common])
        for name in self.run_names(study):
            out = RunDir(os.path.join(self.out, name)).eval_results(study.name)
            if not os.path.isfile(out):
                self._run(f"eval_{study.name}", ["launch/evaluate.py", "--model", os.path.join(self.out, name),
                                                 "--out", out, *common])

    def headlines(self, study: Study) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = {}
        for b in study.baselines:
            path = os.path.join(self.out, "baselines", f"{b.name}-{study.name}.json")
            if os.path.isfile(path):
                with open(path) as f:
                    found[b.name] = [json.load(f)["headline"]]
        runs = {name.removesuffix(SMOKE): name for name in self.run_names(study)}
        for _, row in study.rows:
            for name in sorted(n for n in runs if n == row or n.startswith(row + "-s")):
                path = RunDir(os.path.join(self.out, runs[name])).eval_results(study.name)
                if os.path.isfile(path):
                    with open(path) as f:
                        found.setdefault(row, []).append(json.load(f)["headline"])
        return found

    def report(self, study: Study) -> None:
        target = os.path.join(self.results, study.name)
        runs = [os.path.join(self.out, n) for n in self.run_names(study)]
        self._run(f"report_{study.name}", ["launch/report.py", *runs, "--out", target])
        for path in runs:
            run, keep = RunDir(path), os.path.join(self.results, "runs", os.path.basename(path))
            os.makedirs(RunDir(keep).eval, exist_ok=True)
            for rel in (os.path.relpath(p, path) for p in (run.experiment_json, run.metrics, *run.all_eval_results())):
                if os.path.isfile(os.path.join(path, rel)):
                    shutil.copyfile(os.path.join(path, rel), os.path.join(keep, rel))
        for path in glob.glob(os.path.join(self.out, "baselines", f"*-{study.name}.json")):
            os.makedirs(os.path.join(self.results, "baselines"), exist_ok=True)
            shutil.copyfile(path, os.path.join(self.results, "baselines", os.path.basename(path)))
        page_dir = os.path.dirname(os.path.abspath(self.page))
        plots = [os.path.relpath(p, page_dir) for p in sorted(glob.glob(os.path.join(target, "*.png")))]
        with open(self.page) as f:
            text = f.read()
        text = replace_block(text, self.mode, study.name, study_markdown(study, self.headlines(study), plots,
                                                                         self.mode), self.page)
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
        t0 = time.time()
        self.prepare()
        for study in self.studies:
            self.train(study)
            self.evaluate(study)
            self.report(study)
        self.timings["total"] = round(time.time() - t0, 1)
        path = os.path.join(self.results, "timings.json")
        spent = dict(self.timings)
        if os.path.isfile(path):  # a resumed run adds to what the earlier invocations spent
            with open(path) as f:
                for stage, seconds in json.load(f)["stages_s"].items():
                    spent[stage] = round(spent.get(stage, 0.0) + seconds, 1)
        with open(path, "w") as f:
            json.dump({"stages_s": spent, "step_seconds_median": self.step_seconds()}, f, indent=1)
        print(f"wrote {self.page} and {self.results}/ in {self.timings['total']:.0f} s ({spent['total']:.0f} s "
              "over all invocations)")
