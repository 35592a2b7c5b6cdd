"""Sentence/paragraph units: the unit sample layout, the optional paraphrase member through shards,
Sample.validate and collate, and build_shards' unit mode on the sample corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_shard_dir
from shard_corpus import TOKENIZER, documents, write_jsonl_zst

from pipeline.data.format.index import ShardKind, check_shard_kind, load_index
from pipeline.data.format.sample import Sample
from pipeline.data.format.tar_shard import ShardReader, ShardWriter
from pipeline.data.format.units import split_units
from pipeline.data.loading.batch import collate
from pipeline.data.loading.loader import ShardLoader
from pipeline.data.prep import build_cli
from pipeline.data.prep.build import run_job
from pipeline.data.prep.build_config import BuildConfig, BuildError
from pipeline.data.prep.build_sample import PlanSettings, make_sample
from pipeline.data.prep.units import unit_sample


def test_unit_sample_wraps_pads_and_truncates():
    ids, n, cut = unit_sample([10, 11, 12], 8, pad_id=0, bos_id=1, eos_id=2)
    assert ids.tolist() == [1, 10, 11, 12, 2, 0, 0, 0] and n == 5 and not cut and ids.dtype == np.int32
    ids, n, cut = unit_sample(list(range(10, 20)), 6, pad_id=0, bos_id=1, eos_id=2)
    assert ids.tolist() == [1, 10, 11, 12, 13, 2] and n == 6 and cut
    ids, n, cut = unit_sample([10, 11], 4, pad_id=0, bos_id=None, eos_id=None)
    assert ids.tolist() == [10, 11, 0, 0] and n == 2 and not cut
    with pytest.raises(ValueError, match="no room for text between BOS and EOS; raise --max-unit-tokens"):
        unit_sample([10], 2, pad_id=0, bos_id=1, eos_id=2)


def _unit(key_index: int, ids: list[int], paraphrase: list[int] | None, seq_len: int = 8) -> Sample:
    input_ids, n, _ = unit_sample(ids, seq_len, 0, 1, 2)
    para = None if paraphrase is None else unit_sample(paraphrase, seq_len, 0, 1, 2)[0]
    plan = PlanSettings(seed=0, special_ids=np.array([0, 1, 2]), span_fraction=0.0)
    return make_sample(input_ids, np.array([[0, n]], np.int32), 0, key_index, plan, paraphrase=para)


def test_paraphrase_member_round_trips_through_a_shard(tmp_path):
    samples = [_unit(0, [10, 11, 12], [20, 21]), _unit(1, [13], [22, 23, 24, 25])]
    assert samples[0].spans.shape == (0, 2)  # units have no MAGNET spans
    writer = ShardWriter(str(tmp_path / "s.tar"))
    for s in samples:
        writer.write(s)
    writer.close()
    back = list(ShardReader(str(tmp_path / "s.tar")))
    for s, b in zip(samples, back):
        b.validate(8)
        assert b.paraphrase.dtype == np.int32 and np.array_equal(b.paraphrase, s.paraphrase)
    batch = collate(back)
    assert batch.paraphrase_ids.tolist() == [[1, 20, 21, 2, 0, 0, 0, 0], [1, 22, 23, 24, 25, 2, 0, 0]]
    assert batch.to("cpu").paraphrase_ids.dtype == batch.paraphrase_ids.dtype
    without = _unit(2, [10], None)
    assert collate([without]).paraphrase_ids is None and collate([without]).to("cpu").paraphrase_ids is None


def test_paraphrase_errors_name_the_sample():
    good = _unit(0, [10, 11], [20])
    with pytest.raises(ValueError, match=r"sample f000000s00000000: paraphrase has shape \(7,\), expected \(8,\)"):
        Sample(**{**good.__dict__, "paraphrase": good.paraphrase[:7]}).validate(8)
    with pytest.raises(ValueError, match="paraphrase has dtype int64, expected int32"):
        Sample(**{**good.__dict__, "paraphrase": good.paraphrase.astype(np.int64)}).validate(8)
    with pytest.raises(ValueError, match=r"samples \['f000000s00000001'\] have no paraphrase while others"):
        collate([good, _unit(1, [10], None)])
    filler = Sample("", np.zeros(8, np.int32), np.zeros((0, 2), np.int32), good.mask_rank, good.mask_draw,
                    np.zeros((0, 2), np.int32))
    assert collate([good, filler]).paraphrase_ids[1].tolist() == [0] * 8  # a padding row pads its paraphrase


@pytest.fixture(scope="module")
def sentence_shards(tmp_path_factory) -> tuple[str, list[str]]:
    """Sentence units of a few sample-corpus documents in 24-token samples; the documents too."""
    root = tmp_path_factory.mktemp("units")
    docs = documents(max_chars=1500)[:6]
    corpus = write_jsonl_zst(root / "docs.jsonl.zst", docs)
    out = str(root / "shards")
    run_job(BuildConfig(inputs=(corpus,), tokenizer=TOKENIZER, output=out, seq_len=24, units="sentence",
                        samples_per_shard=50, progress=False))
    return out, docs


def test_sentence_shards_hold_one_unit_a_sample(sentence_shards, tokenizer):
    out, docs = sentence_shards
    index = load_index(out)
    units = [u for d in docs for u in split_units(d, "sentence")]
    samples = [s for shard in index.shards for s in ShardReader(shard.path)]
    assert len(samples) == index.num_samples == len(units) and len(index.shards) > 1
    cut = 0
    for sample, ids in zip(samples, tokenizer.encode_batch(units)):
        expected, n, truncated = unit_sample(ids, 24, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)
        assert np.array_equal(sample.input_ids, expected) and sample.segments.tolist() == [[0, n]]
        assert sample.spans.shape == (0, 2) and sample.paraphrase is None
        cut += truncated
    assert 0 < cut < len(units)
    assert [s.key for s in samples] == [f"f000000s{i:08d}" for i in range(len(units))]
    assert index.units == "sentence" and index.seq_len == 24 and index.settings["paraphrase_field"] is None
    assert not {"span_fraction", "remainder"} & set(index.settings)  # settings units do not use
    assert sum(f["truncated_units"] for job in index.jobs for f in job["files"]) == cut


def test_paraphrases_are_stored_beside_record_units(tmp_path, tokenizer):
    records = [{"text": "The quick brown fox jumps over the lazy dog.", "para": "A fast fox leaps over a dog."},
               {"text": "To be or not to be.", "para": "Whether to exist or not."},
               {"text": "Missing its paraphrase."},
               {"text": "All the world's a stage.", "para": "The world is a theatre."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = str(tmp_path / "shards")
    summary = run_job(BuildConfig(inputs=(str(path),), tokenizer=TOKENIZER, output=out, seq_len=16, units="record",
                                  paraphrase_field="para", max_bad_fraction=0.5, progress=False))
    assert summary.samples == 3 and summary.bad_by_reason == {"missing_field": 1}
    good = [r for r in records if "para" in r]
    index = load_index(out)
    assert index.units == "record" and index.settings["paraphrase_field"] == "para"
    batch = next(iter(ShardLoader(index, micro_batch=3)))
    by_key = dict(zip(batch.keys, batch.paraphrase_ids.tolist()))
    for i, (record, ids) in enumerate(zip(good, tokenizer.encode_batch([r["para"] for r in good]))):
        expected = unit_sample(ids, 16, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)[0]
        assert by_key[f"f000000s{i:08d}"] == expected.tolist(), record


def test_bad_unit_options_are_named(tmp_path, capsys):
    def fails(*args: str) -> str:
        with pytest.raises(SystemExit):
            build_cli.parse_args(["--input", "x.jsonl", "--tokenizer", TOKENIZER, "--output", str(tmp_path), *args])
        return capsys.readouterr().err

    assert "--seq-len is for packed samples; unit samples are --max-unit-tokens long" in fails(
        "--units", "sentence", "--seq-len", "64")
    assert "--max-unit-tokens needs --units" in fails("--max-unit-tokens", "64")
    assert "invalid choice: 'line'" in fails("--units", "line")
    cfg = build_cli.parse_args(["--input", "x.jsonl", "--tokenizer", TOKENIZER, "--output", "o", "--units", "sentence"])
    assert (cfg.units, cfg.seq_len) == ("sentence", 128)
    for config, message in [
        (dict(units="sentence", paraphrase_field="para"), "--paraphrase-field needs --units record"),
        (dict(paraphrase_field="para"), "--paraphrase-field needs --units record .* got --units \\(none: packed\\)"),
        (dict(units="record", seq_len=2), "--max-unit-tokens 2 leaves no room for text between BOS and EOS"),
    ]:
        with pytest.raises(BuildError, match=message):
            BuildConfig(inputs=("x",), tokenizer=TOKENIZER, output="o", **config).validate()


def test_trainer_refuses_the_wrong_kind_of_shards(sentence_shards, tmp_path):
    units = load_index(sentence_shards[0])
    packed = load_index(make_shard_dir(str(tmp_path)))
    check_shard_kind(units, ShardKind.UNITS, "data.unit_shards", ["simcse"])
    check_shard_kind(packed, ShardKind.PACKED, "data.shards", ["mntp"])
    with pytest.raises(ValueError, match=r"data.unit_shards .* holds packed samples .* but simcse reads sentence "
                                         r"units, one a sample; build unit shards with .*--units sentence"):
        check_shard_kind(packed, ShardKind.UNITS, "data.unit_shards", ["simcse"])
    with pytest.raises(ValueError, match=r"data.shards .* holds sentence units \(built with --units\), but clm, "
                                         r"mntp reads packed samples"):
        check_shard_kind(units, ShardKind.PACKED, "data.shards", ["clm", "mntp"])
    with pytest.raises(ValueError, match=r"data.pair_shards .* holds units, but supervised reads \(query, positive"):
        check_shard_kind(units, ShardKind.PAIRS, "data.pair_shards", ["supervised"])
    # a kind reads as its word wherever it is written: messages, JSON, dict keys
    assert [f"{k}" for k in ShardKind] == json.loads(json.dumps(list(ShardKind))) == ["packed", "units", "pairs"]
    assert {"units": 1}[ShardKind.UNITS] == 1 and ShardKind("pairs") is ShardKind.PAIRS
