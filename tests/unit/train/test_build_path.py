"""The experiment's path through :meth:`Trainer.build` (issue 42): setup hands the trainer specs it decided
(``Prepared``: the model's, the engine's, each loader's), so the experiment itself reaches few places there, each
once, and seldom climbs back up the layer table (tests/unit/test_imports.py LAYERS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, one_rank_env, rendezvous
from test_imports import ROW, package_of

# Builds the default experiment's trainer on one rank as launch/train.py does (preflight, then Trainer.build) and
# prints each call of a pipeline/ function that receives the experiment or one of its sections as an argument
# (file, function), in order; the config's own code (its methods and its serialisation) aside.
TRACE = """
import contextlib, dataclasses, json, os, sys
import deepspeed, torch
from pipeline.experiment import load_experiment
from pipeline.train.ds_config import load_ds_config
from pipeline.train.preflight import agreed_preflight, local_preflight
from pipeline.train.signals import StopRequest
from pipeline.train.trainer import Trainer
deepspeed.init_distributed(dist_backend="gloo")
exp = load_experiment(None, json.loads(sys.argv[1]))
sections = {id(exp)} | {id(getattr(exp, f.name)) for f in dataclasses.fields(exp)
                        if dataclasses.is_dataclass(getattr(exp, f.name))}
own = tuple(os.path.join(os.getcwd(), "pipeline", f) for f in ("experiment.py", "config.py"))
stops = []

def follow(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_filename.startswith(os.path.join(os.getcwd(), "pipeline")) \\
            and code.co_filename not in own:
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(id(frame.f_locals.get(n)) in sections for n in names):
            stops.append((os.path.relpath(code.co_filename), code.co_qualname))

with contextlib.ExitStack() as held:
    prepared = agreed_preflight(exp, 0, 1, False, held, local_preflight(exp, 0, 1, False, load_ds_config(sys.argv[2])))
    sys.setprofile(follow)
    Trainer.build(exp, prepared, StopRequest(0), torch.device("cpu"))
    sys.setprofile(None)
print(json.dumps(stops))
os._exit(0)
"""


def row(path: str) -> int:
    return ROW[package_of(path[:-3].replace(os.sep, ".").removesuffix(".__init__"))]


@pytest.mark.e2e
def test_the_experiment_enters_each_file_once_through_trainer_build_and_climbs_at_most_three_times(shards, tmp_path):
    """A visit is a run of consecutive calls in one file; a climb a visit to a file higher in the layer table than
    the one before. The model's builder (``ModelSpec``) and the engine's (``EngineSpec``) take no experiment."""
    overrides = [f"data.shards={shards}", "data.seq_len=64", f"run_dir={tmp_path / 'run'}", "train.steps=2"]
    with rendezvous() as rdzv:
        proc = subprocess.run([sys.executable, "-c", TRACE, json.dumps(overrides),
                               os.path.join(REPO, "ds_configs", "zero3.json")],
                              env=one_rank_env(rdzv), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stops = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stops[0] == ["pipeline/train/trainer.py", "Trainer.build"]
    visits = [path for i, (path, _) in enumerate(stops) if i == 0 or stops[i - 1][0] != path]
    assert len(visits) == len(set(visits)), f"a file entered twice: {stops}"
    climbs = [(a, b) for a, b in zip(visits, visits[1:]) if row(b) > row(a)]
    assert len(climbs) <= 3, climbs
    assert not any(path.startswith("pipeline/model/") for path, _ in stops), stops
