"""The shard loader: global order independent of ranks/workers/micro-batch, epochs, exact resume, errors, collate."""

import datetime
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import make_shard_dir

from pipeline.data.format.index import job_manifest_name, load_index
from pipeline.data.format.sample import UNMASKABLE, Sample
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.loading.batch import collate
from pipeline.data.loading.loader import ShardLoader, iter_eval
from pipeline.data.loading.order import BatchWarmup
from pipeline.data.loading.permutation import permute

N, G = 37, 4  # samples in the test directory; global batch of every geometry below
STEPS_PER_EPOCH = N // G


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return load_index(make_shard_dir(tmp_path_factory.mktemp("data"), num_samples=N))


@pytest.fixture(scope="module")
def stored(index):
    """key -> Sample, read sequentially from every shard."""
    return {s.key: s for info in index.shards for s in ShardReader(info.path)}


def run(index, steps, micro_batch, grad_accum, dp_world, num_workers=0, state=None, seed=0, warmup=None):
    """Keys of the next ``steps`` global batches (each rank's micro-batches concatenated in rank order), with the
    state of rank 0 afterwards. Ranks are simulated by one loader per dp_rank in this process."""
    loaders = [ShardLoader(index, micro_batch, grad_accum, rank, dp_world, seed, num_workers, warmup=warmup)
               for rank in range(dp_world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    steps_keys = [[k for loader in loaders for b in loader.next_global_step() for k in b.keys] for _ in range(steps)]
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "ranks disagree on the global state"
    return steps_keys, states[0]


@pytest.fixture(scope="module")
def reference(index):
    """Three epochs at micro_batch 4, one rank, no workers."""
    return run(index, 3 * STEPS_PER_EPOCH, 4, 1, 1)[0]


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000])
def test_permute_is_a_seeded_bijection(n):
    orders = [permute(np.arange(n), n, seed, epoch).tolist() for seed, epoch in [(0, 0), (0, 1), (1, 0)]]
    for order in orders:
        assert sorted(order) == list(range(n))
    if n >= 17:
        assert orders[0] != orders[1] and orders[0] != orders[2] and orders[0] != list(range(n))
    assert permute(np.arange(n), n, 0, 1).tolist() == orders[1]


@pytest.mark.parametrize("micro_batch,grad_accum,dp_world,num_workers",
                         [(4, 1, 1, 2), (2, 1, 2, 0), (2, 1, 2, 1), (1, 2, 2, 2), (1, 4, 1, 1), (2, 2, 1, 0)])
def test_global_batches_do_not_depend_on_geometry_or_workers(index, reference, micro_batch, grad_accum, dp_world,
                                                             num_workers):
    steps = 2 * STEPS_PER_EPOCH + 2  # crosses two epoch boundaries
    assert run(index, steps, micro_batch, grad_accum, dp_world, num_workers)[0] == reference[:steps]


def test_epoch_takes_each_sample_at_most_once_and_epochs_differ(index, reference, stored):
    epochs = [sum(reference[e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH], []) for e in range(3)]
    for keys in epochs:
        assert len(keys) == len(set(keys)) == STEPS_PER_EPOCH * G  # the remainder N % G is dropped
        assert set(keys) <= set(stored)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert run(index, STEPS_PER_EPOCH, 4, 1, 1, seed=1)[0] != reference[:STEPS_PER_EPOCH]


def test_batches_hold_the_stored_samples(index, stored):
    batch = ShardLoader(index, micro_batch=8).next_global_step()[0]
    assert batch.input_ids.shape == (8, index.seq_len)
    for row, key in enumerate(batch.keys):
        np.testing.assert_array_equal(batch.input_ids[row].numpy(), stored[key].input_ids)
        np.testing.assert_array_equal(batch.mask_draw[row].numpy(), stored[key].mask_draw)


@pytest.mark.parametrize("before,after,k", [
    ((2, 1, 2, 1), (4, 1, 1, 0), 3),   # 2 ranks -> 1, workers 1 -> 0
    ((4, 1, 1, 0), (1, 2, 2, 2), 5),   # 1 rank -> 2, micro-batch and workers change
    ((2, 2, 1, 2), (2, 1, 2, 0), 7),   # resumed run crosses the epoch boundary
    ((4, 1, 1, 1), (2, 1, 2, 1), STEPS_PER_EPOCH),  # stopped exactly at the boundary
])
def test_resume_continues_at_the_same_global_sample(index, reference, before, after, k):
    _, state = run(index, k, *before)
    assert state["epoch"] == k // STEPS_PER_EPOCH
    assert state["samples_in_epoch"] == k % STEPS_PER_EPOCH * G and state["samples_consumed"] == k * G
    resumed, final = run(index, 5, *after, state=state)
    assert resumed == reference[k:k + 5]
    assert final["samples_consumed"] == (k + 5) * G


def test_state_counts_consumed_whole_steps_not_prefetched(index):
    loader = ShardLoader(index, micro_batch=2, grad_accum=2, num_workers=2)
    stream = iter(loader)
    taken = [next(stream) for _ in range(3)]  # one whole step and half of the next; workers prefetched more
    state = loader.state_dict()
    assert state["samples_in_epoch"] == G and state["samples_consumed"] == G
    replay = ShardLoader(index, micro_batch=2, grad_accum=2)
    replay.load_state_dict(state)
    assert replay.next_global_step()[0].keys == taken[2].keys  # the unfinished step is replayed
    with pytest.raises(RuntimeError, match="one way of consuming"):
        loader.next_global_step()


def test_load_state_errors(index, tmp_path):
    _, state = run(index, 1, 4, 1, 1)
    other = load_index(make_shard_dir(tmp_path, num_samples=N, seed=1))
    with pytest.raises(ValueError, match="fingerprint .* resume on the shard directory"):
        ShardLoader(other, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 0, this loader has seed 3"):
        ShardLoader(index, 4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        ShardLoader(index, 4).load_state_dict({"epoch": 0})


def test_a_shard_holding_other_samples_than_its_manifest_says_is_refused(tmp_path):
    directory = make_shard_dir(tmp_path, num_samples=8, samples_per_shard=8)
    path = os.path.join(directory, job_manifest_name(0))
    with open(path) as f:
        job = json.load(f)
    job["shards"][0]["samples"] = 9
    with open(path, "w") as f:
        json.dump(job, f)
    with pytest.raises(ValueError, match="index holds 8 samples, the job manifest says 9"):
        ShardLoader(load_index(directory), micro_batch=1).next_global_step()


@pytest.mark.parametrize("micro_batch,dp_world,num_workers", [(8, 1, 0), (5, 2, 2), (9, 4, 1)])
def test_eval_sees_every_sample_once_in_order(index, stored, micro_batch, dp_world, num_workers):
    ranks = [list(iter_eval(index, micro_batch, rank, dp_world, num_workers)) for rank in range(dp_world)]
    assert len({len(batches) for batches in ranks}) == 1  # same number of batches on every rank
    batches = [batch for rnd in zip(*ranks) for batch in rnd]
    assert all(b.input_ids.shape == (micro_batch, index.seq_len) for b in batches)
    keys = [k for batch in batches for k in batch.keys]
    assert [k for k in keys if k] == sorted(stored)
    assert len(keys) - len(stored) == -N % (micro_batch * dp_world)  # padding rows fill the last round only
    for batch in batches:
        filler = torch.tensor([k == "" for k in batch.keys])
        assert (batch.doc_ids[filler] == -1).all() and (batch.mask_rank[filler] == UNMASKABLE).all()
        assert (batch.doc_ids[~filler] >= 0).any(dim=1).all()


def _sample(key, segments, spans, seq_len=8):
    return Sample(key, np.arange(seq_len, dtype=np.int32) + 10, np.array(segments, np.int32).reshape(-1, 2),
                  np.full(seq_len, UNMASKABLE, np.uint16), np.full(seq_len, 4_000_000_007, np.uint32),
                  np.array(spans, np.int32).reshape(-1, 2))


def test_collate_shapes_dtypes_and_ids():
    batch = collate([_sample("a", [[0, 3], [3, 6]], [[1, 3]]), _sample("b", [[0, 8]], [[2, 4], [5, 7]])])
    assert [t.dtype for t in (batch.input_ids, batch.doc_ids, batch.mask_rank, batch.mask_draw, batch.span_ids)] \
        == [torch.int64, torch.int32, torch.int32, torch.int64, torch.int32]
    assert batch.doc_ids.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1], [0] * 8]
    assert batch.span_ids.tolist() == [[-1, 0, 0, -1, -1, -1, -1, -1], [-1, -1, 0, 0, -1, 1, 1, -1]]
    assert batch.mask_rank.unique().tolist() == [int(UNMASKABLE)]
    assert batch.mask_draw.unique().tolist() == [4_000_000_007]  # uint32 above int32 range survives
    assert batch.keys == ["a", "b"] and batch.to("cpu").input_ids.shape == (2, 8)
    with pytest.raises(ValueError, match="at least one sample"):
        collate([])


def _distributed_rank(rank, directory, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails the test instead of CI
    loader = ShardLoader(load_index(directory), micro_batch=1, grad_accum=2, dp_rank=rank, dp_world=2, num_workers=1)
    steps = []
    for _ in range(STEPS_PER_EPOCH + 2):
        gathered = [None, None]
        dist.all_gather_object(gathered, [k for b in loader.next_global_step() for k in b.keys])
        steps.append(gathered[0] + gathered[1])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(steps, f)
    dist.destroy_process_group()


def test_two_real_ranks_under_gloo_see_the_reference_order(index, reference, tmp_path):
    out = tmp_path / "steps.json"
    mp.start_processes(_distributed_rank, args=(index.directory, tmp_path / "store", out), nprocs=2,
                       start_method="fork")
    assert json.loads(out.read_text()) == reference[:STEPS_PER_EPOCH + 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_pinned_batches_reach_the_gpu_unchanged(index):
    loader = ShardLoader(index, micro_batch=4, num_workers=1, pin_memory=True)
    batch = loader.next_global_step()[0]
    assert batch.input_ids.is_pinned() and batch.span_ids.is_pinned()
    on_gpu = batch.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.mask_draw.cpu(), batch.mask_draw) and on_gpu.keys == batch.keys


def test_batch_warmup_grows_in_whole_granules_to_the_full_batch():
    warmup = BatchWarmup(full=8, start=0.25, steps=6, granule=2)
    assert [warmup.micro_batches(t) for t in range(8)] == [2, 2, 4, 4, 6, 6, 8, 8]
    assert BatchWarmup(full=8, start=0.05, steps=4, granule=4).micro_batches(0) == 4  # at least one granule


def test_batch_warmup_order_is_the_same_on_one_and_two_ranks_and_resumes_exactly(index):
    """Micro-batches of 1 sample, a full global batch of 8 (1 rank x 8, or 2 ranks x 4), warming up from a quarter
    of it in granules of 2 over 6 steps, for three epochs; resumed inside the warmup on the other world size, and
    after it."""
    warm = BatchWarmup(full=8, start=0.25, steps=6, granule=2)
    steps = 3 * (N // 8) + 6
    one, _ = run(index, steps, 1, 8, 1, warmup=warm)
    two, _ = run(index, steps, 1, 4, 2, num_workers=1, warmup=warm)
    assert one == two
    sizes = [len(keys) for keys in one]
    assert sizes == [warm.micro_batches(t) for t in range(steps)]  # the rows taken are the schedule's
    assert sizes[:7] == [2, 2, 4, 4, 6, 6, 8] and set(sizes[6:]) == {8}
    # each epoch takes each sample at most once: its global batches end where the next would not fit
    epoch, seen = 0, set()
    for keys in one:
        if len(seen) + len(keys) > N:
            epoch, seen = epoch + 1, set()
        assert not seen & set(keys)
        seen |= set(keys)
    assert epoch == 3
    for k, before, after in [(3, (1, 4, 2), (1, 8, 1)), (5, (1, 8, 1), (1, 4, 2)), (9, (1, 4, 2), (1, 8, 1))]:
        _, state = run(index, k, *before, warmup=warm)
        assert state["step"] == k and state["samples_consumed"] == sum(sizes[:k])
        resumed, _ = run(index, 4, *after, state=state, warmup=warm)
        assert resumed == one[k:k + 4]
    _, state = run(index, 3, 1, 8, 1, warmup=warm)
    with pytest.raises(ValueError, match="step 3 of the batch warmup .* resume with the run's train.batch_warmup"):
        run(index, 1, 1, 8, 1, state=state)
    _, state = run(index, 6, 1, 8, 1, warmup=warm)
    assert run(index, 2, 1, 8, 1, state=state)[0] == one[6:8]  # after the warmup, a loader without one continues
