"""The shards are webdataset tars: the webdataset library's streaming reader (``webdataset.WebDataset``) and its
indexed one (``wids.ShardListDataset``), decoding the ``.npy`` members with numpy, give the same samples as the
project's reader (``ShardReader``), sample for sample: tokens, segments (so doc ids), masking plans, spans, and the
paraphrase member of unit shards. The ``wids`` shard list is written from the manifest as docs/loader.md shows."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import webdataset
import wids
from shard_corpus import TOKENIZER, split_corpus

from pipeline.data.format.index import DatasetIndex, load_index
from pipeline.data.format.sample import FIELDS, OPTIONAL_FIELDS, Sample
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.loading.batch import collate
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig

SEQ_LEN = 64


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> DatasetIndex:
    """Packed shards of three sample-corpus files, built by two prep jobs: several shards, spans in most samples."""
    root = tmp_path_factory.mktemp("packed")
    inputs = tuple(split_corpus(root, 3, max_chars=3000))
    for job in range(2):
        run_job(BuildConfig(inputs=inputs, tokenizer=TOKENIZER, output=str(root / "shards"), seq_len=SEQ_LEN,
                            samples_per_shard=16, num_jobs=2, job_index=job, remainder="pad", progress=False))
    return load_index(str(root / "shards"))


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> DatasetIndex:
    """Record-unit shards with a paraphrase member in every sample."""
    root = tmp_path_factory.mktemp("units")
    pairs = [("The quick brown fox jumps over the lazy dog.", "A fast fox leaps over a dog."),
             ("To be or not to be.", "Whether to exist or not."),
             ("All the world's a stage.", "The world is a theatre."),
             ("Brevity is the soul of wit.", "Wit lives in few words.")]
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "para": p}) + "\n" for t, p in pairs))
    run_job(BuildConfig(inputs=(str(path),), tokenizer=TOKENIZER, output=str(root / "shards"), seq_len=16,
                        units="record", paraphrase_field="para", samples_per_shard=3, progress=False))
    return load_index(str(root / "shards"))


def project_samples(index: DatasetIndex) -> list[Sample]:
    samples = []
    for shard in index.shards:
        reader = ShardReader(shard.path)
        samples.extend(reader)
        reader.close()
    return samples


def as_sample(key: str, members: dict[str, np.ndarray]) -> Sample:
    """A Sample from one webdataset sample's decoded ``FIELD.npy`` members; any other member is a format error."""
    fields = {name.removesuffix(".npy"): array for name, array in members.items()}
    unknown = set(fields) - set(FIELDS) - set(OPTIONAL_FIELDS)
    assert not unknown, f"sample {key}: members the format does not name: {sorted(unknown)}"
    return Sample(key=key, **fields)


def read_webdataset(index: DatasetIndex) -> list[Sample]:
    dataset = webdataset.WebDataset([shard.path for shard in index.shards], shardshuffle=False).decode()
    return [as_sample(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in dataset]


def write_wids_shardlist(index: DatasetIndex) -> str:
    """The wids dataset description of a shard directory, from its manifest (docs/loader.md)."""
    path = os.path.join(index.directory, "wids.json")
    with open(path, "w") as f:
        json.dump({"wids_version": 1, "name": os.path.basename(index.directory),
                   "shardlist": [{"url": s.name, "nsamples": s.samples, "filesize": s.bytes} for s in index.shards]},
                  f)
    return path


def decode_npy(sample: dict) -> dict:
    """wids hands each member as a stream under its extension (``.FIELD.npy``)."""
    return {k: v if k.startswith("__") else np.load(v, allow_pickle=False) for k, v in sample.items()}


def read_wids(index: DatasetIndex) -> list[Sample]:
    dataset = wids.ShardListDataset(write_wids_shardlist(index), transformations=[decode_npy],
                                    localname=lambda url: url)  # read the shards in place, no cache copy
    assert len(dataset) == index.num_samples
    samples = [dataset[i] for i in range(len(dataset))]
    dataset.close()
    return [as_sample(s["__key__"], {k.removeprefix("."): v for k, v in s.items() if not k.startswith("__")})
            for s in samples]


def assert_same_samples(got: list[Sample], expected: list[Sample], seq_len: int) -> None:
    assert [s.key for s in got] == [s.key for s in expected]
    for g, e in zip(got, expected):
        g.validate(seq_len)
        assert g.fields() == e.fields(), g.key
        for name in e.fields():
            a, b = getattr(g, name), getattr(e, name)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (g.key, name)
    batch, reference = collate(got), collate(expected)
    for name in ("input_ids", "doc_ids", "mask_rank", "mask_draw", "span_ids", "paraphrase_ids"):
        a, b = getattr(batch, name), getattr(reference, name)
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("read", [read_webdataset, read_wids], ids=["WebDataset", "wids"])
def test_packed_shards_read_with_webdataset(packed, read):
    expected = project_samples(packed)
    assert len(packed.shards) > 2 and {s.name.split("-")[1] for s in packed.shards} == {"00000", "00001"}
    assert len({s.key for s in expected}) == len(expected) == packed.num_samples  # keys are unique, tar-wide too
    assert sum(len(s.spans) > 0 for s in expected) > len(expected) // 2
    assert_same_samples(read(packed), expected, SEQ_LEN)


@pytest.mark.parametrize("read", [read_webdataset, read_wids], ids=["WebDataset", "wids"])
def test_unit_shards_with_paraphrases_read_with_webdataset(units, read):
    expected = project_samples(units)
    assert len(units.shards) == 2 and all(s.paraphrase is not None for s in expected)
    assert_same_samples(read(units), expected, 16)
