"""The experiment's path through the trainer (issues 42, 53): preflight reads the experiment and hands the trainer
what it decided (``Prepared``: the run's plan and one spec per part), so :meth:`Trainer.build` takes no experiment
and neither it nor the loop reaches one. Followed completely: every file of pipeline/, the config's own code
(experiment/, config.py) included, and every config object in the experiment (its sections, phases, objectives'
and evaluators' configs), ``self`` included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, one_rank_env, rendezvous

# Runs preflight on one rank as launch/train.py does, then Trainer.build and fit() with the profiler on, and prints
# each call of a pipeline/ function that receives the experiment or any config object in it (file, function).
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
parts = set()

def reach(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and id(obj) not in parts:
        parts.add(id(obj))
        for f in dataclasses.fields(obj):
            reach(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple, dict)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            reach(v)

reach(exp)
top = os.path.join(os.getcwd(), "pipeline")
stops = []

def follow(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_filename.startswith(top):
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(id(frame.f_locals.get(n)) in parts for n in names):
            stops.append((os.path.relpath(code.co_filename), code.co_qualname))

with contextlib.ExitStack() as held:
    prepared = agreed_preflight(exp, 0, 1, False, held, local_preflight(exp, 0, 1, False, load_ds_config(sys.argv[2])))
    sys.setprofile(follow)
    summary = Trainer.build(prepared, StopRequest(0), torch.device("cpu")).fit()
    sys.setprofile(None)
print(json.dumps({"stops": stops, "steps": summary.steps, "hf": summary.hf_export, "best": bool(summary.best)}))
os._exit(0)
"""


@pytest.mark.e2e
def test_the_experiment_reaches_no_call_of_trainer_build_and_fit(shards, tmp_path):
    """Two phases, validation with an evaluator, keep-best and the HF export, so every part the trainer builds and
    every cadence of the loop runs. (The export's card describes the run as it recorded it, experiment.json, as
    launch/export_hf.py's does: that is a file the run wrote, not the experiment preflight read.)"""
    sts = os.path.join(REPO, "tests", "fixtures", "eval", "sts", "stsb.tsv")
    overrides = [f"data.shards={shards}", "data.seq_len=64", f"run_dir={tmp_path / 'run'}", "train.steps=4",
                 "phases=[{name: clm, share: 0.5, objectives: [{name: clm}]}, "
                 "{name: mlm, share: 0.5, objectives: [{name: mlm}]}]",
                 "eval.every=2", "eval.holdout=0.05", "eval.samples=8",
                 f"eval.evaluators=[{{task: sts, datasets: [{sts}]}}]",
                 "checkpoint.every=2", "checkpoint.keep_best=eval/probe/clm"]
    with rendezvous() as rdzv:
        proc = subprocess.run([sys.executable, "-c", TRACE, json.dumps(overrides),
                               os.path.join(REPO, "ds_configs", "zero3.json")],
                              env=one_rank_env(rdzv), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["steps"], out["hf"], out["best"]) == (4, str(tmp_path / "run" / "hf"), True)  # the whole loop ran
    assert out["stops"] == []
