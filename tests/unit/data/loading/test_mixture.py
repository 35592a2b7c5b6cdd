"""Source mixtures (``data.mixture``, ``pipeline/data/loading/mixture.py``): the order's index arithmetic (ratios at every
prefix, maximum repetition, the error of a source too small for its share), the loader's world-size independent and
resumable order, the config's and preflight's errors, the planner's tokens per source, and a real 2-rank ZeRO-3 CPU
run on the sample corpus split into named sources (``shard_corpus.genre``) that logs its losses per source."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from helpers import http_server, launch_training, logged_steps, make_shard_dir
from shard_corpus import HOLDOUT, ROOT, TOKENIZER, sourced_corpus

from pipeline.config import ConfigError, to_dict
from pipeline.data.format.index import DatasetIndex, ShardInfo, load_index
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.loading.holdout import split
from pipeline.data.loading.loader import ShardLoader, iter_eval
from pipeline.data.loading.mixture import Budget, MixtureError, MixturePlan, check_budget, source_samples
from pipeline.data.loading.order import BatchWarmup, TrainOrder
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.experiment import load_experiment
from pipeline.planner.report import PlannerInput, report
from pipeline.train.preflight import preflight

RATIOS = {"histories": 0.3, "plays": 0.5, "poems": 0.2}


def index_of(sizes: list[tuple[str, int]]) -> DatasetIndex:
    """An index of shards (source, samples), in this order: the plan reads only the manifest's counts."""
    shards = tuple(ShardInfo(f"s{i:03d}.tar", f"/nowhere/s{i:03d}.tar", n, n * 8, 0, "", source)
                   for i, (source, n) in enumerate(sizes))
    return DatasetIndex("/nowhere", "f" * 64, {"seq_len": 8}, shards, ())


# sources interleaved over the shards, as K prep jobs of files that each mix them write them
INDEX = index_of([("a", 40), ("b", 30), ("c", 9), ("a", 25), ("d", 3), ("b", 41), ("c", 7), ("a", 50)])
FOUR = {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.05}


def test_every_prefix_and_every_batch_holds_the_ratios():
    plan = MixturePlan.build(INDEX, FOUR, seed=1)
    n = 20_000
    source, local = plan.locate(np.arange(n))
    for s, name in enumerate(plan.names):
        mine = source == s
        assert np.array_equal(local[mine], np.arange(mine.sum()))  # each source's items in order, none skipped
        prefix = np.cumsum(mine)
        # within two samples (one per tree level) of the ratio at every prefix
        assert np.abs(prefix - np.arange(1, n + 1) * plan.ratios[name]).max() <= 2, name
        batches = mine.reshape(-1, 40).sum(1)  # global batches of 40
        assert np.abs(batches - 40 * plan.ratios[name]).max() <= 2, name
    for k in (0, 1, 39, 40, 12_345, n):
        assert plan.counts(k) == {name: int((source[:k] == s).sum()) for s, name in enumerate(plan.names)}
    assert plan.ratios == pytest.approx(FOUR, abs=1e-6)


def test_order_is_deterministic_and_each_repetition_reads_each_sample_once():
    plan = MixturePlan.build(INDEX, FOUR, seed=1)
    positions = np.arange(3000)
    ids = plan.sample_ids(positions)
    assert np.array_equal(ids, MixturePlan.build(INDEX, FOUR, seed=1).sample_ids(positions))
    assert np.array_equal(ids[1000:1100], plan.sample_ids(positions[1000:1100]))  # any slice, computed alone
    assert not np.array_equal(ids, MixturePlan.build(INDEX, FOUR, seed=2).sample_ids(positions))
    owned = source_samples(INDEX)
    source, local = plan.locate(positions)
    for s, name in enumerate(plan.names):
        samples = owned[name]
        mine = ids[source == s]
        members = {int(i) for i in samples.global_ids(np.arange(samples.count))}
        assert set(mine.tolist()) <= members  # only its own samples
        for e in range(len(mine) // samples.count):  # every full repetition is a permutation of them
            assert sorted(mine[e * samples.count:(e + 1) * samples.count].tolist()) == sorted(members)
        counts = np.bincount(mine)
        assert counts.max() <= math.ceil(len(mine) / samples.count)


def test_held_out_samples_are_never_in_the_mixture():
    train = INDEX.num_samples - 30  # the last shard's last 30 samples held out
    ids = MixturePlan.build(INDEX, FOUR, seed=0, num_samples=train).sample_ids(np.arange(5000))
    assert ids.max() < train and source_samples(INDEX, train)["a"].count == 115 - 30


def test_a_source_short_of_its_share_is_an_error_naming_it_and_the_fixes():
    plan = MixturePlan.build(INDEX, FOUR, seed=0)
    budget = Budget(steps=50, global_batch=8, seq_len=8)  # 400 samples: d (3 samples) must give 20
    with pytest.raises(MixtureError) as e:
        check_budget(plan, budget, {"a": 4.0, "b": 4.0, "c": 4.0, "d": 4.0})
    message = str(e.value)
    assert message.startswith("data.mixture: source 'd' cannot supply its share of the run: ratio 0.05 of 50 steps "
                              "x 8 samples x 8 tokens (3,200 tokens) needs 20 of its samples (160 tokens), but it has "
                              "3 (24 tokens) and max_repetition 4 allows 12 (6.67x needed)")
    assert "lower its ratio to at most 0.03" in message and "max_repetition) to 6.67 or more" in message
    steps = int(message.split("shorten train.steps to ")[1].split(",")[0])
    lines = check_budget(plan, Budget(steps, 8, 8), {n: 4.0 for n in FOUR})  # the suggested steps fit
    assert plan.counts(steps * 8)["d"] <= 12 < plan.counts((steps + 1) * 8)["d"]
    assert lines[3].startswith("d: ratio 0.05, ")
    check_budget(plan, budget, {"a": 4.0, "b": 4.0, "c": 4.0, "d": 6.67})  # or the suggested repetition


@pytest.fixture(scope="module")
def sourced_shards(tmp_path_factory) -> str:
    """One train file of the sample corpus split into its three sources, 64-token samples: about 5.8k samples
    (histories 2.1k, plays 3.4k, poems 0.3k)."""
    corpus = sourced_corpus(tmp_path_factory.mktemp("corpus"),
                            [os.path.join(ROOT, "data/sample/train/chunk1/example_train_0.jsonl.zst")])
    out = str(tmp_path_factory.mktemp("data") / "shards")
    run_job(BuildConfig(inputs=tuple(corpus), tokenizer=TOKENIZER, output=out, seq_len=64, samples_per_shard=512,
                        progress=False, source_field="meta.redpajama_set_name"))
    return out


def _global_batches(index, world: int, grad_accum: int, steps: int, state=None) -> tuple[list[list], dict]:
    """([(key, source id) of each row of each global batch], the loader state after them)."""
    loaders = [ShardLoader(index, 2, grad_accum, rank, world, seed=5, mixture=RATIOS, verify=False)
               for rank in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    return [[(k, int(i)) for loader in loaders for b in loader.next_global_step() for k, i in zip(b.keys, b.source_ids)]
            for _ in range(steps)], loaders[0].state_dict()


def test_loader_order_is_world_size_independent_and_resumes_exactly(sourced_shards):
    index = load_index(sourced_shards)
    one, _ = _global_batches(index, 1, 4, 6)
    two, _ = _global_batches(index, 2, 2, 6)
    assert one == two
    first, state = _global_batches(index, 2, 2, 2)
    rest, _ = _global_batches(index, 1, 4, 4, state)  # resumed on another world size
    assert first + rest == one
    assert state["mixture"] == RATIOS
    with pytest.raises(ValueError, match=r"saved training on data.mixture \{'histories': 0.3, 'plays': 0.5, "
                                         r"'poems': 0.2\}, this loader has \(none\)"):
        ShardLoader(index, 2, seed=5).load_state_dict(state)
    served = [index.sources[i] for batch in one for _, i in batch]
    assert {name: served.count(name) for name in RATIOS} == MixturePlan.build(index, RATIOS, 5).counts(len(served))


@pytest.mark.parametrize("overrides, message", [
    (["data.mixture={histories: 0.3, plays: 0.5}"], "data.mixture: ratios must sum to 1, got 0.8; e.g. "
                                                    "{histories: 0.375, plays: 0.625}"),
    (["data.mixture={histories: 0.3, plays: high}"], "data.mixture.plays: 'high' is not a ratio; write plays: 0.25"),
    (["data.mixture={histories: 1.0, plays: 0}"], "data.mixture.plays: ratio 0.0 is out of range; it must be in "
                                                  "[1e-06, 1]"),
    (["data.mixture={plays: {ratio: 1, max_repetition: 0}}"], "data.mixture.plays.max_repetition: 0.0 is out of "
                                                              "range; it must be > 0"),
    (["data.mixture={plays: {ratio: 1, repeat: 2}}"], "data.mixture.plays.repeat: unknown key"),
    (["data.mixture_max_repetition=0"], "data.mixture_max_repetition: 0.0 is out of range; it must be > 0"),
])
def test_mixture_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_experiment(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_mixture_is_typed_at_load_and_written_back_as_given():
    """``data.mixture`` reads as typed fields (each source's repetition filled in, sorted by name); the config keeps
    the mapping as written, so the run's experiment.yaml and a --set round trip are unchanged."""
    written = "data.mixture={plays: 0.75, histories: {ratio: 0.25, max_repetition: 3}}"
    exp = load_experiment(None, [written, "data.mixture_max_repetition=2"])
    mixture = exp.data.source_mixture
    assert mixture.names == ("histories", "plays")
    assert mixture.ratios == {"histories": 0.25, "plays": 0.75}
    assert mixture.max_repetition == {"histories": 3.0, "plays": 2.0}
    assert to_dict(exp)["data"]["mixture"] == {"plays": 0.75, "histories": {"ratio": 0.25, "max_repetition": 3}}
    assert load_experiment(None, [written, "data.mixture_max_repetition=2"]) == exp
    assert not load_experiment(None, []).data.source_mixture


COMMON = ["train.steps=8", "train.micro_batch=4", "train.log_every=4", "optim.warmup_steps=2",
          "optim.decay_steps=2", "optim.lr=0.002", "checkpoint.every=4", "data.seq_len=64",
          "data.build_if_missing=false", "train.export_hf=false",
          "data.mixture={histories: 0.3, plays: 0.5, poems: 0.2}"]


@pytest.mark.parametrize("overrides, message, end", [
    (["data.mixture={histories: 0.5, sonnets: 0.5}"], "data.mixture: 'sonnets' not among the sources of {shards}: "
                                                      "histories (2", ""),
    (["train.steps=300"], "data.mixture: source 'poems' cannot supply its share of the run: ratio 0.2 of 300 steps x "
                          "8 samples x 64 tokens (153,600 tokens) needs 480 of its samples (30,720 tokens), but it has "
                          "137 (8,768 tokens) and max_repetition 1 allows 137", ""),
    # the shortest source first, the others after
    (["train.steps=2000"], "data.mixture: source 'poems' cannot supply", "or add data of that source (also short: "
                                                                         "histories, plays)"),
])
def test_preflight_refuses_a_mixture_the_shards_cannot_serve(sourced_shards, tmp_path, overrides, message, end):
    exp = load_experiment(None, [*COMMON, f"data.shards={sourced_shards}", f"run_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as e, preflight(exp, rank=0, world=2):
        pass
    assert str(e.value).startswith(message.format(shards=sourced_shards)) and "\n" not in str(e.value)
    assert str(e.value).endswith(end)


def test_preflight_reports_the_plan_and_the_sources_left_out(sourced_shards, tmp_path):
    exp = load_experiment(None, [*COMMON, f"data.shards={sourced_shards}", f"run_dir={tmp_path / 'run'}",
                                 "data.mixture={histories: 0.4, plays: 0.6}"])
    with preflight(exp, rank=0, world=2) as prepared:
        pass
    assert prepared.notes[0] == "mixture of 2 sources over 8 steps x 8 samples x 64 tokens (4,096 tokens):"
    assert prepared.notes[1].startswith("  histories: ratio 0.4, 26 samples (1,664 tokens) of its 2,")
    assert prepared.notes[-1] == f"note: data.mixture leaves out poems of {sourced_shards}: not trained on"


def test_planner_reports_tokens_per_source(sourced_shards):
    plan = PlannerInput(model="tiny", nodes=1, gpus_per_node=2, gpu="h100", seq_len=64, micro_batch=4,
                        tokens_per_step=8 * 64, steps=100, mixture=RATIOS, shards=sourced_shards)
    plan.validate()
    text = report(plan)
    assert "mixture of 3 sources over 800 samples of 64 tokens (0.00 B tokens):" in text
    held = load_index(sourced_shards).source_counts()["poems"]["samples"]
    assert f"  poems                        0.2      0.000B           160{held:>14,}{160 / held:>8.2f}x" in text
    short = report(PlannerInput(**{**plan.__dict__, "steps": 100_000}))
    assert "SHORT: beyond max repetition 1" in short.split("poems")[1].splitlines()[0]
    with pytest.raises(ValueError, match="--mixture: ratios must sum to 1"):
        PlannerInput(**{**plan.__dict__, "mixture": {"poems": 0.5}}).validate()


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> str:
    """A held-out directory of two sources: three plays' and the one poem's documents of the sample corpus's
    validation split, cut to 1000 characters (about 25 samples of 64 tokens)."""
    corpus = sourced_corpus(tmp_path_factory.mktemp("held"), [HOLDOUT], per_source=3, max_chars=1000)
    out = str(tmp_path_factory.mktemp("data") / "held")
    run_job(BuildConfig(inputs=tuple(corpus), tokenizer=TOKENIZER, output=out, seq_len=64, progress=False,
                        source_field="meta.redpajama_set_name"))
    return out


@pytest.mark.e2e
def test_two_rank_run_on_a_mixture_logs_losses_and_tokens_per_source(sourced_shards, held_out, init_dir, tmp_path):
    """The run reads the plan's samples (its tokens per source are the plan's counts: the samples are full), logs
    each source's loss (the overall loss is their mean weighted by targets, so it lies between them), in training
    and in validation."""
    run_dir = str(tmp_path / "run")
    launch_training(run_dir, None, *COMMON, f"data.shards={sourced_shards}", f"model.init={init_dir}", "train.steps=6",
                    "eval.every=3", f"eval.shards={held_out}", "eval.samples=0", "eval.micro_batch=8")
    steps = logged_steps(run_dir)
    plan = MixturePlan.build(load_index(sourced_shards), RATIOS, seed=0)
    for step in steps:
        counts = plan.counts(step * 8)
        assert {n: steps[step][f"progress/source_tokens/{n}"] for n in RATIOS} == {n: c * 64 for n, c in counts.items()}
        per_source = [v for k, v in steps[step].items() if k.startswith("source_loss/clm/")]
        assert len(per_source) >= 2 and min(per_source) <= steps[step]["loss/clm"] <= max(per_source), step
    assert load_index(held_out).sources == ("plays", "poems")
    for step in (3, 6):
        held = [steps[step][f"eval/source_loss/clm/{n}"] for n in ("plays", "poems")]
        assert min(held) <= steps[step]["eval/loss/clm"] <= max(held)
        assert {"eval/source_probe/mlm15/plays", "eval/source_probe/mntp20/poems"} <= set(steps[step])


def _trained_numbers(run_dir: str) -> dict[int, dict[str, float]]:
    """What a run computes, step by step: losses (overall and per source), accuracies, tokens per source,
    validation; not its timings."""
    keep = ("loss/", "acc/", "source_loss/", "progress/", "eval/")
    return {step: {k: v for k, v in rec.items() if k.startswith(keep) and k != "eval/seconds"}
            for step, rec in logged_steps(run_dir).items()}


@pytest.mark.e2e
@pytest.mark.slow  # three launches: the slow suite
def test_mixture_over_http_with_validation_resumes_after_kill_as_the_local_run(sourced_shards, init_dir, tmp_path):
    """Issue 21's "done when": a 2-rank ZeRO-3 run on a mixture, validating every 3 steps, reading its shards over
    HTTP, killed (SIGKILL of rank 0 while it writes its last checkpoint, step 6) and resumed from step 3, logs
    exactly what the same run from the local directory logs uninterrupted: losses, per-source losses and tokens,
    validation."""
    run = [*COMMON, f"model.init={init_dir}", "train.steps=6", "checkpoint.every=3", "eval.every=3",
           "eval.holdout=0.01", "eval.samples=16", "eval.micro_batch=4"]
    launch_training(str(tmp_path / "local"), None, *run, f"data.shards={sourced_shards}")
    parent, name = os.path.split(sourced_shards)
    with http_server(parent) as server:
        remote = [*run, f"data.shards={server.url}/{name}", f"data.cache_dir={tmp_path / 'cache'}"]
        killed = launch_training(str(tmp_path / "http"), None, *remote, env={"PIPELINE_FAULT": "kill-before-marker:6"},
                                 check=False)
        assert killed.returncode != 0
        resumed = launch_training(str(tmp_path / "http"), None, *remote)
    assert "resumed from step00000003" in resumed.stdout
    local, http = _trained_numbers(str(tmp_path / "local")), _trained_numbers(str(tmp_path / "http"))
    assert sorted(local) == sorted(http) == list(range(1, 7))
    assert {k for rec in local.values() for k in rec} >= {"source_loss/clm/poems", "progress/source_tokens/poems",
                                                          "eval/loss/clm", "eval/probe/mlm15"}
    assert http == local


def _source_ids(index: DatasetIndex) -> dict[str, list[int]]:
    """Each source's global sample ids, ascending, by the test's own walk over the shards."""
    out, start = {}, 0
    for shard in index.shards:
        out.setdefault(shard.source, []).extend(range(start, start + shard.samples))
        start += shard.samples
    return out


def test_holdout_takes_the_tail_of_each_source_and_training_never_reads_it():
    """eval.holdout of a directory of sources: each source's last ceil(fraction x N_s) samples; the order without a
    mixture (1 or 2 ranks, several epochs) and with one read the others only; the scored subset is apportioned."""
    h = split(INDEX, 0.1)
    assert h.held_counts == {"a": 12, "b": 8, "c": 2, "d": 1} and not h.prefix
    own = _source_ids(INDEX)
    held = {name: ids[len(ids) - h.held_counts[name]:] for name, ids in own.items()}
    assert {n: h.held[n].global_ids(np.arange(h.held[n].count)).tolist() for n in own} == held
    train = sorted(set(range(INDEX.num_samples)) - {i for ids in held.values() for i in ids})
    assert h.train.global_ids(np.arange(h.train_count)).tolist() == train
    for world in (1, 2):
        orders = [TrainOrder(h.train_count, 3, 2, 1, rank, world, ids=h.train) for rank in range(world)]
        steps = 3 * orders[0].steps_per_epoch
        seen = [int(i) for j in range(steps) for o in orders for i in o.sample_ids(j)]
        per_epoch = h.train_count - h.train_count % (2 * world)
        assert set(seen) <= set(train) and len(seen) == 3 * per_epoch, world
        assert all(len(set(seen[e * per_epoch:(e + 1) * per_epoch])) == per_epoch for e in range(3))
    mixed = MixturePlan.build(INDEX, FOUR, seed=0, num_samples=h.limit).sample_ids(np.arange(5000))
    assert set(mixed.tolist()) <= set(train) and set(mixed.tolist()) >= set(train) - set(own["d"])
    assert h.scored(h.held_count).tolist() == sorted(i for ids in held.values() for i in ids)
    scored = h.scored(10).tolist()  # 10 of 23: a 5.2, b 3.5, c 0.9, d 0.4 -> 5, 4, 1, 0 (largest remainders)
    assert scored == sorted(held["a"][:5] + held["b"][:4] + held["c"][:1])


def test_holdout_of_one_source_is_the_directory_tail(tmp_path):
    """As before sources: the last samples, and a loader given the split is the loader given their count, state
    and all."""
    h = split(index_of([("default", 30), ("default", 20)]), 0.1)
    assert h.prefix and h.limit == 45 == h.train_count and h.held_counts == {"default": 5}
    assert h.scored(3).tolist() == [45, 46, 47]
    index = load_index(make_shard_dir(tmp_path, num_samples=50))
    by_split, by_count = (ShardLoader(index, 2, 2, seed=3, **kw) for kw in ({"holdout": split(index, 0.1)},
                                                                             {"num_samples": 45}))
    for _ in range(14):  # past an epoch
        assert [b.keys for b in by_split.next_global_step()] == [b.keys for b in by_count.next_global_step()]
    assert by_split.state_dict() == by_count.state_dict()


def test_preflight_and_loader_hold_out_each_sources_tail(sourced_shards, tmp_path):
    """On the sample corpus's three sources: every source is in the scored set in proportion, training on 1 or 2
    ranks reads none of it, and a loader state of another split is refused."""
    index = load_index(sourced_shards)
    exp = load_experiment(None, [*COMMON, f"data.shards={sourced_shards}", f"run_dir={tmp_path / 'run'}", "data.mixture={}",
                                 "eval.every=4", "eval.holdout=0.01", "eval.samples=30"])
    with preflight(exp, rank=0, world=2) as prepared:
        pass
    h = prepared.holdout
    counts = {n: c["samples"] for n, c in index.source_counts().items()}
    assert h.held_counts == {n: math.ceil(c / 100) for n, c in counts.items()}
    assert prepared.train_samples == index.num_samples - h.held_count
    held = prepared.validation
    scored = [(k, index.sources[i]) for rank in range(2) for b in
              iter_eval(index, 4, rank, 2, first=held.first, count=held.count, ids=held.ids)
              for k, i in zip(b.keys, b.source_ids) if k]
    assert len(scored) == len(set(scored)) == 30
    per_source = {n: [s for _, s in scored].count(n) for n in index.sources}
    assert h.held_counts == {"histories": 21, "plays": 37, "poems": 2}
    assert per_source == {"histories": 11, "plays": 18, "poems": 1}  # 10.5, 18.5, 1: the tie to the first name
    held_keys = {k for k, _ in scored}
    loaders = [ShardLoader(index, 2, 2, rank, 2, seed=5, verify=False, holdout=h) for rank in range(2)]
    trained = {k for _ in range(4) for loader in loaders for b in loader.next_global_step() for k in b.keys}
    assert len(trained) == 32 and not trained & held_keys
    state = loaders[0].state_dict()
    assert state["held_out"] == h.held_counts and state["num_samples"] == h.train_count
    with pytest.raises(ValueError, match=r"saved holding out the last samples of each source \(\{'histories'"):
        ShardLoader(index, 2, seed=5, num_samples=h.train_count).load_state_dict(state)
    resumed = ShardLoader(index, 2, 4, seed=5, verify=False, holdout=h)
    resumed.load_state_dict(state)  # another world size, the same order
    straight = [ShardLoader(index, 2, 2, rank, 2, seed=5, verify=False, holdout=h) for rank in range(2)]
    expected = [k for _ in range(6) for loader in straight for b in loader.next_global_step() for k in b.keys][32:]
    assert [k for _ in range(2) for b in resumed.next_global_step() for k in b.keys] == expected


# data.pair_batching: same_task (issue 52, item 3): the tasks of pairs shards, each global batch from one of them
PAIRS = os.path.join(ROOT, "data", "sample", "pairs")
TASKS = {"continuations": 0.25, "replies": 0.75}


@pytest.fixture(scope="module")
def pair_shards(build_shards) -> str:
    """The sample pairs (128 rows of each of 2 tasks, each task in its own shards) with their hard negative,
    without instructions: 16 tokens a text."""
    return build_shards((os.path.join(PAIRS, "*.jsonl"),), pairs=True, seq_len=16, samples_per_shard=50)


def _task_batches(index, world: int, grad_accum: int, steps: int, state=None, **kw) -> tuple[list[list], dict]:
    """([(sample key, task id) of each row of each global batch, rank 0's rows first], the loader state after them)
    of ``world`` simulated ranks of same-task loaders (2 rows a micro-batch)."""
    loaders = [ShardLoader(index, 2, grad_accum, rank, world, seed=3, mixture=TASKS, same_task=True, verify=False,
                           **kw) for rank in range(world)]
    for loader in loaders if state is not None else ():
        loader.load_state_dict(state)
    return [[(k, int(i)) for loader in loaders for b in loader.next_global_step() for k, i in zip(b.keys, b.source_ids)]
            for _ in range(steps)], loaders[0].state_dict()


def test_same_task_batches_follow_the_ratios_on_any_world_size_and_resume_exactly(pair_shards):
    """Every global batch of 8 rows (2 simulated ranks x 2 micro-steps x 2 rows) holds one task; the sequence of
    batch tasks is the plan's routing of steps (a quarter continuations); 1 and 2 ranks read the same batches; a
    state saved mid-epoch on 2 ranks resumes on 1 with the same batches; each task reads its rows in its own order,
    every row once per repetition (replies: 24 batches of 8 = 1.5 repetitions of its 128)."""
    index = load_index(pair_shards)
    assert index.sources == ("continuations", "replies")
    two, _ = _task_batches(index, 2, 2, 32)
    assert two == _task_batches(index, 1, 4, 32)[0]
    tasks = [{task for _, task in batch} for batch in two]
    assert all(len(t) == 1 for t in tasks)  # one task a global batch, over both ranks' rows
    plan = MixturePlan.build(index, TASKS, 3)
    assert [t.pop() for t in tasks] == plan.locate(np.arange(32))[0].tolist()
    assert plan.counts(32) == {"continuations": 8, "replies": 24}
    stored = [sample.key for shard in index.shards for sample in ShardReader(shard.path)]  # by global sample id
    for s in range(len(plan.names)):  # each task's rows: its own order, from its first row on, none skipped
        keys = [key for batch in two for key, task in batch if task == s]
        assert keys == [stored[i] for i in plan.source_ids(s, np.arange(len(keys)))]
        assert len(set(keys[:128])) == min(len(keys), 128)  # a repetition reads each of its rows once
    first, state = _task_batches(index, 2, 2, 13)
    assert state["batching"] == "same_task" and state["mixture"] == TASKS
    rest, _ = _task_batches(index, 1, 4, 19, state)  # resumed mid-epoch of replies, on 1 rank
    assert first + rest == two
    with pytest.raises(ValueError, match="saved with data.pair_batching same_task, this loader has mixed"):
        ShardLoader(index, 2, 2, seed=3, mixture=TASKS).load_state_dict(state)
    with pytest.raises(ValueError, match="same-task global batches of 8 rows, this loader's are 4"):
        ShardLoader(index, 2, 2, seed=3, mixture=TASKS, same_task=True).load_state_dict(state)
    # a batch warmup (4 rows for 5 steps, then 8): its smaller batches, still of one task, take each task's next rows
    warm = BatchWarmup(full=4, start=0.5, steps=5, granule=2)
    warm_two, _ = _task_batches(index, 2, 2, 12, warmup=warm)
    assert warm_two == _task_batches(index, 1, 4, 12, warmup=warm)[0]
    assert [len(b) for b in warm_two] == [4] * 5 + [8] * 7 and all(len({t for _, t in b}) == 1 for b in warm_two)
    for s in range(len(plan.names)):
        keys = [key for batch in warm_two for key, task in batch if task == s]
        assert keys == [stored[i] for i in plan.source_ids(s, np.arange(len(keys)))]


PAIRS_RUN = ["train.steps=8", "train.micro_batch=2", "data.build_if_missing=false", "train.export_hf=false",
             "phases=[{objectives: [{name: supervised, in_batch_negatives: false}]}]"]


@pytest.mark.parametrize("shards, overrides, message", [
    ("two", ["data.pair_batching=same_task"], "data.pair_batching: same_task draws each global batch from one task "
     "of data.pair_mixture, which names 0 task(s); set data.pair_mixture to >= 2 tasks of {dir}, e.g. "
     "{{continuations: 0.5, replies: 0.5}} (in proportion to their rows"),
    ("two", ["data.pair_batching=same_task", "data.pair_mixture={replies: 1}"], "data.pair_batching: same_task "
     "draws each global batch from one task of data.pair_mixture, which names 1 task(s)"),
    ("one", ["data.pair_batching=same_task", "data.pair_mixture={replies: 1}"], "data.pair_batching: same_task "
     "draws each global batch from one task of data.pair_mixture, but data.pair_shards {dir} holds one task "
     "('replies'; "),
    ("two", ["data.pair_mixture={replies: 0.5, sonnets: 0.5}"], "data.pair_mixture: 'sonnets' not among the "
     "sources of {dir}: continuations (128 samples), replies (128 samples); name its sources (pairs shards built "
     "before they recorded their rows' tasks"),
    ("two", ["data.pair_mixture={continuations: 0.25, replies: 0.75}", "train.steps=300"], "data.pair_mixture: "
     "source 'replies' cannot supply its share of the run: ratio 0.75 of 300 steps x 4 samples x 48 tokens"),
    ("none", [], "phases[0].objectives[0].in_batch_negatives: false scores each query against its own hard "
     "negatives only, but data.pair_shards {dir} holds none (built with --negatives 0); rebuild them with "
     "--negatives 1 or more, or set phases[0].objectives[0].in_batch_negatives=true"),
])
def test_preflight_refuses_pair_batching_and_negatives_the_pairs_cannot_serve(pair_shards, build_shards, tmp_path,
                                                                            shards, overrides, message):
    directory = {"two": pair_shards,
                 "one": lambda: build_shards((os.path.join(PAIRS, "replies.jsonl"),), pairs=True, seq_len=16),
                 "none": lambda: build_shards((os.path.join(PAIRS, "*.jsonl"),), pairs=True, seq_len=16,
                                              negatives=0)}[shards]
    directory = directory if isinstance(directory, str) else directory()
    exp = load_experiment(None, [*PAIRS_RUN, f"data.shards={directory}", f"data.pair_shards={directory}",
                                 f"data.seq_len={load_index(directory).seq_len}", f"run_dir={tmp_path / 'run'}",
                                 *overrides])
    with pytest.raises(ConfigError) as e, preflight(exp, rank=0, world=2):
        pass
    assert str(e.value).startswith(message.format(dir=directory)) and "\n" not in str(e.value)
    assert "cannot supply" not in message or "raise data.pair_mixture.replies.max_repetition" in str(e.value)


def test_preflight_hands_the_pairs_loader_its_task_plan_and_same_task_batches(pair_shards, tmp_path):
    exp = load_experiment(None, [*PAIRS_RUN, f"data.shards={pair_shards}", f"data.pair_shards={pair_shards}",
                                 "data.seq_len=48", f"run_dir={tmp_path / 'run'}", "data.pair_batching=same_task",
                                 "data.pair_mixture={continuations: 0.25, replies: 0.75}"])
    with preflight(exp, rank=0, world=2) as prepared:
        pass
    spec = prepared.loaders["pairs"]
    assert spec.same_task and dict(spec.mixture) == TASKS and spec.plan.names == ("continuations", "replies")
    assert prepared.notes[0] == "mixture of 2 tasks over 8 steps x 4 samples x 48 tokens (1,536 tokens):"
    assert prepared.notes[1].startswith("  continuations: ratio 0.25, 8 samples (384 tokens) of its 128")
