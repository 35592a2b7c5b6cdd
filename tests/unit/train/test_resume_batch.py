"""A resume on another world size that would change the global batch is refused with the settings that keep it:
the micro-batch and accumulation on the new world size (issue 44), or the switch that allows the change."""

from __future__ import annotations

import os

import pytest

from pipeline.config import ConfigError, to_dict
from pipeline.experiment import load_experiment
from pipeline.run_dir import EXPERIMENT, RunDir
from pipeline.train.checkpoint import _complete
from pipeline.train.run_setup import ResumePoint, batch_keeping, resume_point


def test_a_refused_resume_offers_the_micro_batch_and_accumulation_that_keep_the_global_batch(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    saved = load_experiment(None, [f"run_dir={run.path}", "train.micro_batch=4"])
    os.makedirs(run.checkpoint(10))
    _complete(run, 10, {EXPERIMENT: to_dict(saved)}, 4, keep_last=1, keep_every=0)  # 4 ranks x 4 x 1: 16
    refused = (r"^checkpoint.allow_global_batch_change: .*step0*10 was trained with a global batch of 16 "
               r"\(micro_batch 4 x grad_accum 1 x 4 ranks\), this run has {now} \(micro_batch 4 x grad_accum 1 x "
               r"{world} ranks\); {fix}set checkpoint.allow_global_batch_change=true to resume with the new batch$")
    with pytest.raises(ConfigError, match=refused.format(now=32, world=8, fix="set train.micro_batch=2 "
                                                         r"train.grad_accum=1 to keep it, or ")):
        resume_point(saved, 8)  # the old message offered nothing: 16 is not a whole accumulation of 4 x 8
    with pytest.raises(ConfigError, match=refused.format(now=4, world=1, fix="set train.micro_batch=4 "
                                                         r"train.grad_accum=4 to keep it, or ")):
        resume_point(saved, 1)
    with pytest.raises(ConfigError, match=refused.format(now=12, world=3, fix="no micro-batch x accumulation on "
                                                         r"3 ranks makes 16; ")):
        resume_point(saved, 3)
    kept = load_experiment(None, [f"run_dir={run.path}", "train.micro_batch=2", "train.grad_accum=1"])
    assert resume_point(kept, 8) == ResumePoint(10, 4)  # what the message offered resumes, from what it found


def test_the_batch_kept_prefers_the_micro_batch_asked_or_the_largest_below_it():
    assert batch_keeping(96, 4, 8) == (8, 3)
    assert batch_keeping(96, 4, 5) == (4, 6)
    assert batch_keeping(24, 8, 4) == (3, 1)
    assert batch_keeping(16, 3, 4) is None
