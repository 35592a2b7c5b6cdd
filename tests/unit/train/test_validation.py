"""Validation during training (the experiment's ``eval`` section): the held-out samples in the loader, the config's
and preflight's errors, and real 2-rank ZeRO-3 CPU runs (gloo) of a tiny Llama on shards of the sample corpus.

One 8-step run evaluating at steps 3, 6 and 8 is shared: a run stopped at step 4 and resumed, and a 1-rank run of
the same global batch, must log the same validation numbers.
"""

from __future__ import annotations

import math
import os

import pytest
from helpers import launch_training, logged_steps, make_shard_dir

from pipeline.config import ConfigError
from pipeline.data.format.index import load_index
from pipeline.data.loading.holdout import held_out_count
from pipeline.data.loading.loader import ShardLoader, iter_eval
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import SAMPLE_DIR, load_experiment
from pipeline.train.preflight import preflight

TOKENIZER = os.path.join(SAMPLE_DIR, "tokenizer")
STEPS = 8
COMMON = ["train.steps=8", "train.micro_batch=2", "train.log_every=4", "optim.warmup_steps=2", "optim.decay_steps=2",
          "optim.lr=0.002", "checkpoint.every=4", "data.seq_len=64", "data.build_if_missing=false",
          "train.export_hf=false", "eval.every=3", "eval.holdout=0.01", "eval.samples=20", "eval.micro_batch=3"]
EVAL_STEPS = [3, 6, 8]  # every 3 steps and at the end
# the phase's CLM loss and the three probes, with their accuracies and the perplexity
EVAL_KEYS = {"eval/loss/clm", "eval/acc/clm", "eval/probe/clm", "eval/probe/mlm15", "eval/probe/mntp20",
             "eval/probe_acc/clm", "eval/probe_acc/mlm15", "eval/probe_acc/mntp20", "eval/probe_ppl/clm"}


def eval_numbers(run_dir: str) -> dict[int, dict[str, float]]:
    return {step: {k: v for k, v in rec.items() if k in EVAL_KEYS}
            for step, rec in logged_steps(run_dir).items() if "eval/seconds" in rec}


def _ids(keys) -> list[int]:
    """Global sample ids of ``make_shard_dir``'s keys (``f000000s<id>``); padding rows (key "") left out."""
    return [int(key.rsplit("s", 1)[1]) for key in keys if key]


def test_held_out_fraction_is_never_trained_on(tmp_path):
    """Training reads only the first N - K samples, in every epoch and on any number of ranks; validation exactly
    the last K, each once; a loader state of another holdout is refused."""
    index = load_index(make_shard_dir(tmp_path, num_samples=50))
    k = held_out_count(index.num_samples, 0.1)
    train = index.num_samples - k
    assert k == 5 and held_out_count(100, 0.07) == 7  # 0.07 x 100 is 7.000000000000001 in floats
    for world in (1, 2):
        loaders = [ShardLoader(index, 2, 1, rank, world, num_samples=train) for rank in range(world)]
        epochs = 3
        seen = _ids(key for _ in range(epochs * loaders[0].batches_per_epoch) for loader in loaders
                    for key in loader.next_global_step()[0].keys)
        per_epoch = train - train % (2 * world)
        assert max(seen) < train and len(seen) == epochs * per_epoch and len(set(seen)) == train, world
        with pytest.raises(ValueError, match="another eval.holdout"):
            ShardLoader(index, 2, 1, 0, world).load_state_dict(loaders[0].state_dict())
    held = _ids(key for rank in range(2) for b in iter_eval(index, 3, rank, 2, first=train, count=k) for key in b.keys)
    assert sorted(held) == list(range(train, index.num_samples))


@pytest.fixture(scope="module")
def shards(build_shards) -> str:
    """5835 samples of 64 tokens (59 of them held out at 1 %): one input file of the sample corpus."""
    return build_shards(inputs=(os.path.join(SAMPLE_DIR, "train", "chunk1", "example_train_0.jsonl.zst"),),
                        samples_per_shard=512)


@pytest.mark.parametrize("overrides, message", [
    (["eval.every=5"], "eval.every: validation needs held-out samples; set eval.shards"),
    (["eval.every=5", "eval.holdout=0.1", "eval.shards=x"], "eval.holdout: 0.1 holds samples of data.shards out, "),
    (["eval.holdout=1"], "eval.holdout: 1.0 is out of range; it must be in [0, 1)"),
    (["eval.samples=-1"], "eval.samples: -1 is out of range; it must be >= 0"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_experiment(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["eval.samples=100"], "eval.samples: 100 samples to score, but {shards} holds out only 59; set eval.samples=59"),
    (["eval.holdout=0", "eval.shards={shards}"], "eval.shards: {shards} holds the samples of data.shards"),
    (["eval.mask_token=notatoken"], "eval.mask_token: the MLM and MNTP probes mask tokens: 'notatoken' is not a "
                                    "single token of tokenizer"),
])
def test_preflight_refuses_held_out_sets_it_cannot_score(shards, tmp_path, overrides, message):
    exp = load_experiment(None, [*COMMON, f"data.shards={shards}", f"run_dir={tmp_path / 'run'}",
                                 *(o.format(shards=shards) for o in overrides)])
    with pytest.raises(ConfigError) as e, preflight(exp, rank=0, world=1):
        pass
    assert str(e.value).startswith(message.format(shards=shards)) and "\n" not in str(e.value)


def test_preflight_holds_the_last_samples_out(shards, tmp_path):
    """Also while validation is off: turning it on at a resume keeps the training order."""
    n = load_index(shards).num_samples
    for every in (3, 0):
        exp = load_experiment(None, [*COMMON, f"data.shards={shards}", f"run_dir={tmp_path / 'run'}",
                                     f"eval.every={every}"])
        with preflight(exp, rank=0, world=1) as prepared:
            pass
        assert prepared.train_samples == n - 59
        held = prepared.validation
        assert (held.first, held.count) == (n - 59, 20) if every else held is None



def test_preflight_takes_a_separate_held_out_directory_whole(shards, tmp_path):
    held_dir = str(tmp_path / "heldout")
    run_job(BuildConfig(inputs=(os.path.join(SAMPLE_DIR, "train", "chunk2", "example_train_1.jsonl.zst"),),
                        tokenizer=TOKENIZER, output=held_dir, seq_len=64, samples_per_shard=512, progress=False))
    exp = load_experiment(None, [*COMMON, f"data.shards={shards}", f"run_dir={tmp_path / 'run'}", "eval.holdout=0",
                                 f"eval.shards={held_dir}", "eval.samples=0"])
    with preflight(exp, rank=0, world=1) as prepared:
        pass
    held = prepared.validation
    assert (held.index.directory, held.first, held.count) == (held_dir, 0, load_index(held_dir).num_samples)
    assert prepared.train_samples == load_index(shards).num_samples


def launch(run_dir: str, shards: str, init: str, *overrides: str, nproc: int = 2):
    return launch_training(run_dir, None, *COMMON, f"data.shards={shards}", f"model.init={init}", *overrides,
                           nproc=nproc)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, shards, init_dir) -> tuple[str, str]:
    """(run directory, console output) of the shared 2-rank run."""
    run_dir = str(tmp_path_factory.mktemp("runs") / "baseline")
    return run_dir, launch(run_dir, shards, init_dir).stdout


@pytest.mark.e2e
def test_validation_is_logged_at_its_steps(baseline):
    run_dir, stdout = baseline
    numbers = eval_numbers(run_dir)
    assert sorted(numbers) == EVAL_STEPS
    for n in numbers.values():
        assert set(n) == EVAL_KEYS
        assert n["eval/loss/clm"] == n["eval/probe/clm"]  # the phase's CLM is the CLM probe, on the same samples
        assert n["eval/probe_ppl/clm"] == pytest.approx(math.exp(n["eval/probe/clm"]))
        assert all(0 <= n[k] <= 1 for k in EVAL_KEYS if "acc/" in k)
    for key in ("eval/loss/clm", "eval/probe/mlm15", "eval/probe/mntp20"):
        assert numbers[8][key] < numbers[3][key] - 0.05, key  # it learns, and validation sees it
    assert all(logged_steps(run_dir)[s]["eval/seconds"] > 0 for s in EVAL_STEPS)
    for step in EVAL_STEPS:  # the console line of each evaluation
        assert f"eval {step:>6} [clm] loss/clm={numbers[step]['eval/loss/clm']:.4f} " in stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("eval/probe/mlm15")] == EVAL_STEPS


@pytest.mark.e2e
@pytest.mark.slow  # several launches: the slow suite
def test_a_resumed_run_logs_the_validation_of_the_uninterrupted_one(baseline, shards, init_dir, tmp_path):
    run_dir = str(tmp_path / "resumed")
    assert "stopped at step 4" in launch(run_dir, shards, init_dir, "train.stop_at_step=4").stdout
    assert "resumed from step00000004" in launch(run_dir, shards, init_dir).stdout
    assert eval_numbers(run_dir) == eval_numbers(baseline[0])  # exactly: step 3 before the stop, 6 and 8 after


@pytest.mark.e2e
@pytest.mark.slow  # several launches: the slow suite
def test_one_rank_logs_the_validation_of_two(baseline, shards, init_dir, tmp_path):
    """Same global batch (1 rank accumulating 2 micro-batches) and the same eval micro-batches: the numbers differ
    only by fp32 summation order in ZeRO-3's reductions during training (as the trainer's losses, test_train_e2e.py)."""
    run_dir = str(tmp_path / "one-rank")
    launch(run_dir, shards, init_dir, "train.grad_accum=2", nproc=1)
    one, two = eval_numbers(run_dir), eval_numbers(baseline[0])
    assert sorted(one) == EVAL_STEPS
    for step in EVAL_STEPS:
        assert one[step] == pytest.approx(two[step], rel=1e-5), step
