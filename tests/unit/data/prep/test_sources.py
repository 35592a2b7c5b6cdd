"""The input readers (pipeline/data/prep/sources.py): jsonl (plain, .zst, .gz), parquet and HF dataset directories read
alike (every input type of ``READERS``), damaged files and bad records counted by reason, globs expanded."""

import gzip
import json
import os
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipeline.data.prep.sources import (
    SUFFIXES,
    InputError,
    RecordStats,
    SourceField,
    expand_inputs,
    input_size,
    read_records,
    read_texts,
)

_rng = random.Random(0)
MANY = [f"document {i}: " + " ".join(f"w{_rng.randrange(10**6)}" for _ in range(i % 40 + 1)) for i in range(6000)]
DOCS = MANY[:300]


def jsonl_bytes(docs, field="text") -> bytes:
    return b"".join(json.dumps({field: d, "meta": {"redpajama_set_name": "x"}}).encode() + b"\n" for d in docs)


def read(path, field="text"):
    stats = RecordStats()
    return list(read_texts(str(path), field, stats)), stats


# one record each: a good one, an empty text, no text, no source, a good one
RECORDS = [{"text": "one", "meta": {"set": "a"}}, {"text": "", "meta": {"set": "a"}}, {"text": None, "meta": {"set": "b"}},
           {"text": "two", "meta": {"set": None}}, {"text": "three", "meta": {"set": "b"}}]


def _jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _dataset(records):
    import datasets

    return datasets.Dataset.from_list(records)


# how this test writes each input type ("": a saved HF dataset directory)
WRITERS = {
    ".jsonl": lambda path, records: path.write_bytes(_jsonl(records)),
    ".jsonl.zst": lambda path, records: path.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(records))),
    ".jsonl.gz": lambda path, records: path.write_bytes(gzip.compress(_jsonl(records))),
    ".parquet": lambda path, records: pq.write_table(pa.Table.from_pylist(records), path),
    "": lambda path, records: _dataset(records).save_to_disk(str(path)),
}


@pytest.mark.parametrize("suffix", [*SUFFIXES, ""])
def test_every_input_type_reads_the_same_records(tmp_path, suffix):
    """Each input type prep reads (``READERS``) gives one corpus's texts, sources and bad records alike: a type
    added without its writer in ``WRITERS`` fails here."""
    path = tmp_path / f"in{suffix}"
    WRITERS[suffix](path, RECORDS)
    assert expand_inputs([str(path)]) == [str(path)]
    stats = RecordStats()
    assert list(read_records(str(path), ("text",), stats, SourceField("meta.set"))) == [("one", "a"), ("three", "b")]
    assert stats.documents == 2 and stats.bad == {"empty": 1, "missing_field": 1, "missing_source": 1}


def test_the_docs_list_every_input_type():
    """docs/data_prep.md's ``--input`` rows name the suffixes ``READERS`` reads, in its order."""
    with open(os.path.join(os.path.dirname(__file__), "../../../../docs/data_prep.md")) as f:
        rows = [line for line in f if line.startswith("| `--input GLOB...` |")]
    named = [re.findall(r"`(\.[\w.]+)`", row) for row in rows]
    assert named and all(n == list(SUFFIXES) for n in named), f"{named}: list {list(SUFFIXES)} in docs/data_prep.md"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst", ".jsonl.gz"])
def test_jsonl_roundtrip(tmp_path, suffix):
    data = jsonl_bytes(DOCS)
    if suffix == ".jsonl.zst":  # two frames, as concatenated zstd files have
        half = len(data) // 2
        data = zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])
    elif suffix == ".jsonl.gz":
        data = gzip.compress(data)
    path = tmp_path / f"a{suffix}"
    path.write_bytes(data)
    texts, stats = read(path)
    assert texts == DOCS
    assert stats.documents == len(DOCS) and stats.num_bad == 0


def test_bad_records_counted_by_reason(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"text": "good one"}).encode(),
        b'{"text": "unterminated',
        json.dumps({"content": "wrong field"}).encode(),
        json.dumps({"text": 17}).encode(),
        json.dumps({"text": "  \n "}).encode(),
        b'{"text": "caf\xe9"}',
        b'{"text": "lone \\ud800 surrogate"}',
        b"[1, 2]",
        b"",
        json.dumps({"text": "good two"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines))  # no trailing newline: the last line still counts
    texts, stats = read(path)
    assert texts == ["good one", "good two"]
    assert stats.documents == 2
    assert stats.bad == {"not_json": 2, "missing_field": 1, "not_string": 1, "empty": 1, "invalid_utf8": 2}
    assert stats.bad_fraction == pytest.approx(7 / 9)
    # json's own message ends in "at": it said "starting at at column 10"
    assert stats.examples[0].startswith(f"{path}:2: invalid JSON (Unterminated string starting at column 10): ")
    assert f"{path}:3: field 'text' is missing or null" in stats.examples[1]
    assert "--text-field" in stats.examples[1]
    assert stats.examples[2].startswith(f"{path}:4: field 'text' is int")
    assert len(stats.examples) == 5


def test_truncated_zst_keeps_records_before_the_damage(tmp_path):
    data = zstandard.ZstdCompressor(level=3).compress(jsonl_bytes(MANY))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    texts, stats = read(path)
    assert 0 < len(texts) < len(DOCS) * 20
    assert texts == (MANY)[: len(texts)]
    assert stats.bad == {"corrupt_file": 1}
    assert "ends in the middle of a frame" in stats.examples[0] and "re-download" in stats.examples[0]
    assert stats.examples[0].startswith(f"{path}:{len(texts) + 1}")


def test_corrupt_zst_block(tmp_path):
    data = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(jsonl_bytes(MANY)))
    data[len(data) // 2] ^= 0xFF
    path = tmp_path / "flip.jsonl.zst"
    path.write_bytes(bytes(data))
    texts, stats = read(path)
    assert texts == (MANY)[: len(texts)]
    assert stats.bad == {"corrupt_file": 1}
    assert "decompression failed" in stats.examples[0]


def test_not_zstd_at_all(tmp_path):
    path = tmp_path / "plain.jsonl.zst"
    path.write_bytes(jsonl_bytes(DOCS))
    texts, stats = read(path)
    assert texts == [] and stats.bad == {"corrupt_file": 1}


def test_truncated_gzip(tmp_path):
    data = gzip.compress(jsonl_bytes(MANY))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    texts, stats = read(path)
    assert 0 < len(texts) and texts == (MANY)[: len(texts)]
    assert stats.bad == {"corrupt_file": 1}


def test_parquet(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["one", None, "three", ""], "n": [1, 2, 3, 4]}), path, row_group_size=2)
    texts, stats = read(path, "body")
    assert texts == ["one", "three"]
    assert stats.bad == {"missing_field": 1, "empty": 1}
    assert stats.examples[0].startswith(f"{path}: row 2")
    texts, stats = read(path, "text")
    assert texts == [] and stats.bad == {"missing_field": 4}
    assert "columns: ['body', 'n']" in stats.examples[0]
    texts, stats = read(path, "n")
    assert texts == [] and stats.bad == {"not_string": 4}


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1 this is not parquet PAR1")
    texts, stats = read(path)
    assert texts == [] and stats.bad == {"corrupt_file": 1}
    assert "cannot read parquet" in stats.examples[0]


def test_hf_dataset_dir(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS[:50], "id": list(range(50))}).save_to_disk(str(tmp_path / "ds"))
    texts, stats = read(tmp_path / "ds")
    assert texts == DOCS[:50] and stats.documents == 50
    assert expand_inputs([str(tmp_path / "ds")]) == [str(tmp_path / "ds")]
    assert input_size(str(tmp_path / "ds")) > 0
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match="DatasetDict with splits \\['train'\\].*dd/train"):
        expand_inputs([str(tmp_path / "dd")])


def test_expand_inputs(tmp_path):
    for name in ["b/2.jsonl.zst", "a/1.jsonl.zst", "a/3.jsonl", "c.txt"]:
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    got = expand_inputs([f"{tmp_path}/*/*.jsonl.zst", f"{tmp_path}/a/*.jsonl", f"{tmp_path}/a/1.jsonl.zst"])
    assert got == [f"{tmp_path}/a/1.jsonl.zst", f"{tmp_path}/a/3.jsonl", f"{tmp_path}/b/2.jsonl.zst"]
    with pytest.raises(InputError, match="matches no file"):
        expand_inputs([f"{tmp_path}/*.parquet"])
    with pytest.raises(InputError, match="unsupported input type"):
        expand_inputs([f"{tmp_path}/c.txt"])
    with pytest.raises(InputError, match="not a saved HF dataset"):
        expand_inputs([f"{tmp_path}/a"])
