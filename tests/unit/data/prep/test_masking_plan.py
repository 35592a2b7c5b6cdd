"""Unit tests of packing, the masking plan and MAGNET spans (pure functions; end-to-end in test_build_shards)."""

import numpy as np
import pytest
import torch

from pipeline.data.format.masking import apply_mask_plan, mask_targets
from pipeline.data.format.sample import UNMASKABLE
from pipeline.data.prep.build_sample import PlanSettings, make_sample
from pipeline.data.prep.packing import Packer
from pipeline.data.prep.spans import sample_spans

BOS, EOS, PAD, MASK = 1, 2, 0, 3
SPECIAL = np.array([PAD, BOS, EOS, MASK])


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 100, size=int(rng.integers(1, 200))).tolist() for _ in range(n)]


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_packing_round_trips_the_token_stream(remainder):
    docs = _docs(30)
    packer = Packer(64, PAD, BOS, EOS, remainder)
    samples = [s for d in docs for s in packer.add(d)] + packer.finish()
    stream = np.concatenate([ids[s:e] for ids, segs in samples for s, e in segs])
    ref = np.concatenate([[BOS, *d, EOS] for d in docs])
    if remainder == "drop":
        ref = ref[: len(ref) // 64 * 64]
    assert np.array_equal(stream, ref)
    ids, segs = samples[-1]
    assert (ids[segs[-1, 1]:] == PAD).all()
    for ids, segs in samples:  # every piece after the first starts with BOS
        assert all(ids[s] == BOS for s in segs[1:, 0])


def _sample(seed=0, seq_len=512, plan_seed=11, file_index=3, sample_index=7, span_fraction=0.15):
    packer = Packer(seq_len, PAD, BOS, EOS, "pad")
    ids, segs = [s for d in _docs(40, seed) for s in packer.add(d)][1]
    return make_sample(ids, segs, file_index, sample_index,
                       PlanSettings(seed=plan_seed, special_ids=SPECIAL, span_fraction=span_fraction))


def test_mask_ratio_exact_subsets_and_no_specials():
    s = _sample()
    rank = torch.from_numpy(s.mask_rank.astype(np.int32))[None]
    eligible = int((s.mask_rank != UNMASKABLE).sum())
    assert eligible == int((~np.isin(s.input_ids, SPECIAL)).sum())
    prev = torch.zeros_like(rank, dtype=torch.bool)
    for p in (0.05, 0.2, 0.3, 0.4, 0.5, 0.8):
        m = mask_targets(rank, p)
        assert abs(m.sum().item() / eligible - p) <= 0.01
        assert not np.isin(s.input_ids[m[0].numpy()], SPECIAL).any()
        assert not (prev & ~m).any()  # lower ratios are subsets of higher ones
        prev = m


def test_replacement_policies():
    s = _sample()
    ids = torch.from_numpy(s.input_ids).long()[None]
    rank = torch.from_numpy(s.mask_rank.astype(np.int32))[None]
    draw = torch.from_numpy(s.mask_draw.astype(np.int64))[None]
    pool = torch.arange(5, 100)
    full, t = apply_mask_plan(ids, rank, draw, 0.5, "mask", MASK, pool)
    assert (full[t] == MASK).all() and (full[~t] == ids[~t]).all()
    bert, t2 = apply_mask_plan(ids, rank, draw, 0.5, "80-10-10", MASK, pool)
    assert torch.equal(t, t2)
    share = (bert[t] == MASK).float().mean().item()
    assert 0.7 < share < 0.9
    assert ((bert[t] != MASK) & (bert[t] != ids[t])).any()  # some random replacements
    with pytest.raises(ValueError, match="policy"):
        apply_mask_plan(ids, rank, draw, 0.5, "90-5-5", MASK, pool)


def test_plan_depends_on_the_sample_identity_and_not_on_span_settings():
    a = _sample()
    assert all(np.array_equal(getattr(a, f), getattr(_sample(), f)) for f in ("mask_rank", "mask_draw", "spans"))
    for other in (_sample(plan_seed=12), _sample(file_index=4), _sample(sample_index=8)):
        assert not np.array_equal(a.mask_draw, other.mask_draw)
        assert not np.array_equal(a.mask_rank, other.mask_rank)
        assert not np.array_equal(a.spans, other.spans)
    wider = _sample(span_fraction=0.3)  # spans draw after the plan: their settings never change it
    assert np.array_equal(a.mask_rank, wider.mask_rank) and np.array_equal(a.mask_draw, wider.mask_draw)
    assert len(wider.spans) > len(a.spans)


def test_spans_in_one_document_with_context_before():
    rng = np.random.default_rng(0)
    segments = np.array([[0, 40], [40, 45], [45, 300], [300, 512]], dtype=np.int32)
    for _ in range(50):
        spans = sample_spans(segments, rng, 8, 32, 0.15)
        assert abs((spans[:, 1] - spans[:, 0]).sum() / 512 - 0.15) < 0.05
        assert (spans[1:, 0] > spans[:-1, 1]).all()
        for s, e in spans:
            assert 8 <= e - s <= 32
            assert ((segments[:, 0] < s) & (e <= segments[:, 1])).any()
    assert len(sample_spans(np.array([[0, 5]], dtype=np.int32), rng, 8, 32, 0.5)) == 0
    with pytest.raises(ValueError, match="min_len"):
        sample_spans(segments, rng, 9, 8, 0.1)
