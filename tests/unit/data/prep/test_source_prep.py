"""Data prep keeps each document's source (``--source-field``): every source packed in its own stream into its own
shards, the manifests counting documents, samples and tokens per source; on the sample corpus split into named
sources (``shard_corpus.genre``)."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from shard_corpus import ROOT, TOKENIZER, genre, sourced_corpus

from pipeline.data.format.index import INDEX, UNNAMED_SOURCE, job_manifest_name, load_index
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.loading.loader import ShardLoader
from pipeline.data.prep import inspection
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig
from pipeline.data.prep.sources import RecordStats, SourceField, read_records
from pipeline.tokenizer import load_tokenizer

SEQ_LEN = 128
TRAIN_FILES = sorted(glob.glob(os.path.join(ROOT, "data/sample/train/chunk*/*.jsonl.zst")))


def config(inputs, out, **kw) -> BuildConfig:
    kw = {"seq_len": SEQ_LEN, "samples_per_shard": 64, "progress": False, "remainder": "pad",
          "source_field": "meta.redpajama_set_name", **kw}
    return BuildConfig(inputs=tuple(inputs), tokenizer=TOKENIZER, output=str(out), **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """Two files of 30 documents each (about 45k tokens each), every file mixing the three sources."""
    return sourced_corpus(tmp_path_factory.mktemp("corpus"), TRAIN_FILES[:2], max_docs=30)


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "shards"
    return out, run_job(config(corpus, out))


def records(path: str) -> list[tuple[str, str]]:
    """(text, source) of each record, by the test's own reading of the raw JSON."""
    import zstandard

    with open(path, "rb") as f:
        rows = [json.loads(line) for line in zstandard.ZstdDecompressor().stream_reader(f).read().splitlines()]
    return [(r["text"], genre(r["meta"]["title"])) for r in rows]


def test_every_source_is_packed_apart_and_counted(built, corpus):
    """Each shard holds one source, and each source's shards hold exactly its documents' token stream in file
    order: so every sample and every document piece in it has its shard's source. The manifests count documents,
    samples and tokens per source, and their sums are the directory's."""
    out, summary = built
    tok = load_tokenizer(TOKENIZER)
    index = load_index(str(out))
    assert index.sources == ("histories", "plays", "poems")
    expected_counts = {name: {"documents": 0, "samples": 0, "tokens": 0} for name in index.sources}
    for file_index, path in enumerate(corpus):
        docs = records(path)
        for name in index.sources:
            ids = tok.encode_batch([text for text, source in docs if source == name])
            expected = [t for d in ids for t in [tok.bos_id, *d, tok.eos_id]]
            samples = [s for shard in index.shards if shard.source == name for s in ShardReader(shard.path)
                       if s.key.startswith(f"f{file_index:06d}")]
            got = [int(t) for s in samples for a, b in s.segments for t in s.input_ids[a:b]]
            assert got == expected, (path, name)
            expected_counts[name]["documents"] += sum(source == name for _, source in docs)
            expected_counts[name]["samples"] += len(samples)
            expected_counts[name]["tokens"] += len(expected)
    assert index.source_counts() == expected_counts
    on_disk = json.load(open(out / INDEX))
    assert on_disk["sources"] == expected_counts
    assert summary.sources == expected_counts
    assert sum(c["tokens"] for c in expected_counts.values()) == on_disk["num_tokens"] == summary.tokens
    assert sum(c["samples"] for c in expected_counts.values()) == on_disk["num_samples"]
    files = json.load(open(out / job_manifest_name(0)))["files"]
    assert all(sum(c["documents"] for c in f["sources"].values()) == f["documents"] for f in files)
    assert index.settings["source_field"] == "meta.redpajama_set_name"


def test_inspect_verifies_a_directory_of_sources(built, capsys):
    """The keys of a file run 0..n-1 over its sources' shards, each source's in order: verification accepts it,
    and the statistics list the sources."""
    out, _ = built
    assert inspection.main([str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "sources (field 'meta.redpajama_set_name', default ''): histories " in stdout


def test_same_bytes_again_and_two_jobs_equal_one(built, corpus, tmp_path):
    out, _ = built
    run_job(config(corpus, tmp_path / "again"))
    names = sorted(os.listdir(out))
    assert names == sorted(os.listdir(tmp_path / "again"))
    assert all((out / n).read_bytes() == (tmp_path / "again" / n).read_bytes() for n in names)
    for k in range(2):
        run_job(config(corpus, tmp_path / "k2", num_jobs=2, job_index=k))
    one, two = load_index(str(out)), load_index(str(tmp_path / "k2"))

    def by_key(index):
        return {s.key: (shard.source, s.input_ids.tobytes(), s.mask_rank.tobytes()) for shard in index.shards
                for s in ShardReader(shard.path)}

    assert by_key(one) == by_key(two)
    assert one.source_counts() == two.source_counts()


def test_record_without_a_source_is_bad_or_gets_the_default(tmp_path, capsys):
    rows = [{"text": "To be, or not to be.", "meta": {"redpajama_set_name": "plays"}},
            {"text": "Shall I compare thee to a summer's day?", "meta": {}},
            {"text": "Now is the winter of our discontent.", "meta": {"redpajama_set_name": ""}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = RecordStats()
    got = list(read_records(str(path), ("text",), stats, SourceField("meta.redpajama_set_name")))
    assert [r[1] for r in got] == ["plays"] and stats.bad == {"missing_source": 2}
    assert "in.jsonl:2: field 'meta.redpajama_set_name' is missing or null: the record names no source" \
           in stats.examples[0] and "--source-default NAME" in stats.examples[0]
    stats = RecordStats()
    got = list(read_records(str(path), ("text",), stats, SourceField("meta.redpajama_set_name", "other")))
    assert [r[1] for r in got] == ["plays", "other", "other"] and not stats.bad
    run_job(config([str(path)], tmp_path / "out", source_default="other", seq_len=8))
    assert load_index(str(tmp_path / "out")).sources == ("other", "plays")


def test_parquet_with_a_nested_source_gives_the_jsonl_sources(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = records(corpus[0])
    pq.write_table(pa.table({"text": [t for t, _ in docs],
                             "meta": [{"redpajama_set_name": s, "title": ""} for _, s in docs]}),
                   tmp_path / "in.parquet")
    got = list(read_records(str(tmp_path / "in.parquet"), ("text",), RecordStats(),
                            SourceField("meta.redpajama_set_name")))
    assert got == docs


def test_shards_without_sources_are_one_source_and_carry_no_source_ids(corpus, tmp_path):
    """A directory built without --source-field (or before sources existed: its manifests name none) is the one
    source 'default'; its batches are as before, without source ids."""
    out = tmp_path / "plain"
    run_job(config(corpus[:1], out, source_field="", seq_len=64))
    index = load_index(str(out))
    assert "source_field" not in index.settings and "sources" not in json.load(open(out / INDEX))
    assert all("source" not in s for s in json.load(open(out / job_manifest_name(0)))["shards"])
    assert index.sources == (UNNAMED_SOURCE,) and list(index.source_counts()) == [UNNAMED_SOURCE]
    batch = ShardLoader(index, micro_batch=4).next_global_step()[0]
    assert batch.source_ids is None


def test_batches_of_a_directory_of_sources_carry_each_rows_source(built):
    out, _ = built
    index = load_index(str(out))
    loader = ShardLoader(index, micro_batch=8, grad_accum=2, seed=3)
    source_of_key = {s.key: shard.source for shard in index.shards for s in ShardReader(shard.path)}
    for batch in loader.next_global_step():
        assert [index.sources[i] for i in batch.source_ids.tolist()] == [source_of_key[k] for k in batch.keys]
    assert np.all(batch.source_ids.numpy() >= 0)


def _experiment(tmp_path, *overrides: str):
    from pipeline.experiment import load_experiment

    return load_experiment(None, [f"run_dir={tmp_path / 'run'}", f"data.shards={tmp_path / 'shards'}",
                                  "data.seq_len=64", "train.steps=2", "train.micro_batch=2", "optim.warmup_steps=1",
                                  "optim.decay_steps=1", *overrides])


@pytest.mark.parametrize("key", ["build_source_field", "build_source_default"])
def test_build_source_settings_with_blanks_are_config_errors(key, tmp_path):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=rf"^data.{key}: ' plays' must be .* without surrounding blanks$"):
        _experiment(tmp_path, f"data.{key}=' plays'")


def test_build_if_missing_builds_the_sources_a_mixture_mixes(corpus, tmp_path):
    """``data.build_source_field`` reaches the build (its shards name their sources and data.mixture mixes them);
    a mixture over shards that would be built without sources is refused before anything is built."""
    from pipeline.config import ConfigError
    from pipeline.train.preflight import preflight

    mixture = ["data.mixture={histories: 0.3, plays: 0.5, poems: 0.2}", f"data.build_inputs={json.dumps(corpus)}"]
    with pytest.raises(ConfigError, match=r"^data.mixture: mixes sources, but the shards data.build_if_missing would "
                                          r"build into .* set data.build_source_field"), \
            preflight(_experiment(tmp_path, *mixture), rank=0, world=1):
        pass
    assert not os.path.exists(tmp_path / "shards")
    with preflight(_experiment(tmp_path, *mixture, "data.build_source_field=meta.redpajama_set_name"), rank=0,
                   world=1) as prepared:
        pass
    index = prepared.indexes["packed"]
    assert index.sources == ("histories", "plays", "poems")
    assert any(line.startswith("mixture of 3 sources") for line in prepared.notes)
    settings = json.load(open(tmp_path / "shards" / "manifest.json"))["settings"]
    assert settings["source_field"] == "meta.redpajama_set_name"
