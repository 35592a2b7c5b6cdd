"""Resume a ZeRO-3 run on another number of ranks (2 -> 1 -> 2) through DeepSpeed's universal checkpoint.

One run trains steps 1-10 on 2 ranks, 11-15 on 1 rank and 16-20 on 2 ranks again, always with the global batch
of 8 (2 ranks x 2 x 2 accumulation, then 1 rank x 2 x 4), warmed up from 4 over its first 16 steps
(``train.batch_warmup``), so both resumes land inside the warmup: a step of 4 samples is 1 micro-step a rank on 2
ranks and 2 of DeepSpeed's 4 on 1 rank. Its losses must follow the uninterrupted training (the single-process
reference loop of test_train_e2e, which matches 2-rank ZeRO-3 to fp32 rounding) step for step, and the samples it logs
per step the schedule.
"""

from __future__ import annotations

import os

import pytest
import test_train_e2e as tt
from helpers import logged_steps

from pipeline.experiment import load_experiment
from pipeline.run_dir import RunDir
from pipeline.train.batch_warmup import batch_warmup
from pipeline.train.checkpoint import UNIVERSAL

# granules of 4 samples: whole micro-batches of 2 on 1 rank and on 2 ranks
WARMUP = ("train.batch_warmup.start=0.5", "train.batch_warmup.steps=16", "train.batch_warmup.multiple=4")


@pytest.mark.e2e
@pytest.mark.slow  # three 2-rank/1-rank launches (~1 min)
def test_resume_on_fewer_then_more_ranks_follows_the_uninterrupted_run(shards, init_dir, tmp_path):
    run_dir = str(tmp_path / "elastic")
    tt.launch(run_dir, shards, init_dir, *WARMUP, "train.stop_at_step=10")
    run = RunDir(run_dir)
    assert run.checkpoint_world_size(10) == 2

    one = tt.launch(run_dir, shards, init_dir, *WARMUP, "train.grad_accum=4", "train.stop_at_step=15", nproc=1)
    assert "resumed from step00000010" in one.stdout
    assert os.path.isdir(os.path.join(run.checkpoint(10), UNIVERSAL))
    assert run.checkpoint_world_size(15) == 1

    two = tt.launch(run_dir, shards, init_dir, *WARMUP)
    assert "resumed from step00000015" in two.stdout
    assert run.latest_complete() == tt.STEPS

    warmup = batch_warmup(load_experiment(None, [*tt.COMMON, *WARMUP]).train, 2)
    logged = logged_steps(run_dir)
    samples = [logged[step]["batch/samples/packed"] for step in range(1, tt.STEPS + 1)]
    assert samples == [2 * warmup.micro_batches(t) for t in range(tt.STEPS)]  # micro-batches of 2 samples
    assert samples[0] == 4 and samples[-1] == 8
    ours = tt.losses(run_dir)
    ref = tt.reference_losses(shards, init_dir, run_dir, *WARMUP).losses
    for step, expected in enumerate(ref, start=1):
        assert ours[step] == pytest.approx(expected, rel=1e-5), (step, ours[step], expected)
