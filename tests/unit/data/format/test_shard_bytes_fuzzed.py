"""Shard bytes fuzzed (issue 43): a real shard directory, built by the project's builder, damaged by hypothesis (a
truncated tar, flipped bytes in an array member or a header, a member with another name or dtype, an ``.idx.npy``
sidecar or a job manifest that disagrees with its shard, a manifest of another format version) and read through
the real path: :func:`load_index`, the checks preflight runs on it, and a :class:`ShardLoader` over one whole epoch.
Each damage must be refused with one line (``errors.one_line``, what a run prints) naming the damaged file and the
fix, with no changed sample handed out; a damage that changes nothing read (a flipped bit in a tar's end padding)
may pass, if every sample handed out is the one that was built. Bounded for ``make test``: a fixed number of
examples, derandomized. The counts are in docs/reliability.md ("Shard bytes, fuzzed").

Damage comes in two kinds. "After the build": the bytes change and the manifests still record the built shard (a
disk or copy error): the size and sha256 checks see it before a sample is read. "Recorded": the manifests record
the damaged shard's size and sha256 (a shard written wrong by a builder, or a directory assembled by hand): only
the format's own checks (the tar, the ``.npy`` headers, the members, the sidecar) stand between it and training.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_corpus import documents, write_jsonl_zst

from pipeline.data.format.index import (
    MANIFEST,
    check_compatible,
    check_enough_samples,
    check_shard_sizes,
    job_manifest_name,
    load_index,
)
from pipeline.data.format.sample import index_path
from pipeline.data.format.tar_shard import ShardReader, sha256_file
from pipeline.data.loading.loader import ShardLoader
from pipeline.io import write_json_atomic
from pipeline.train.errors import one_line

SAMPLES_PER_SHARD = 24
MICRO_BATCH = 1  # an epoch then reads every sample (it drops the last num_samples % global_batch)
FIXES = ("rebuild", "build_shards", "inspect_shards", "copy the shard again")
# what a reading bug raises; a refusal is a ValueError or an OSError whose message names the file
BUGS = (KeyError, IndexError, TypeError, AttributeError, AssertionError, UnicodeDecodeError, OverflowError)
FUZZ = settings(max_examples=20, derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def built(build_shards, tmp_path_factory) -> str:
    """95 samples of 64 tokens in 4 shards: the sample corpus's held-out documents, each cut to 400 characters."""
    inputs = write_jsonl_zst(tmp_path_factory.mktemp("fuzz-input") / "docs.jsonl.zst", documents(max_chars=400))
    return build_shards(inputs=(inputs,), samples_per_shard=SAMPLES_PER_SHARD)


class Samples(dict):
    """key -> (shard name, arrays), shown short in hypothesis's report of a failing example."""

    def __repr__(self) -> str:
        return f"<{len(self)} samples>"


@pytest.fixture(scope="module")
def reference(built, tokenizer) -> Samples:
    """Every sample of the built directory by key: the name of its shard, and its arrays as the loader hands it out."""
    shard_of = {ShardReader(p)[i].key: os.path.basename(p) for p in shard_paths(built)
                for i in range(len(ShardReader(p)))}
    return Samples({key: (shard_of[key], arrays) for key, arrays in read_epoch(built, tokenizer.info.fingerprint)})


def read_epoch(directory: str, tokenizer_fingerprint: str):
    """(key, arrays) of every sample handed out by what a run does with ``directory``: preflight's checks, then one
    epoch of a loader (ShardLoader reads through the same per-sample reader as evaluation)."""
    index = load_index(directory)
    check_compatible(index, tokenizer_fingerprint, 64)
    check_shard_sizes(index)
    check_enough_samples(index, MICRO_BATCH)
    loader = ShardLoader(index, MICRO_BATCH)
    for _ in range(loader.batches_per_epoch):
        for batch in loader.next_global_step():
            for row, key in enumerate(batch.keys):
                yield key, {"input_ids": batch.input_ids[row].numpy(), "doc_ids": batch.doc_ids[row].numpy(),
                            "mask_rank": batch.mask_rank[row].numpy(), "mask_draw": batch.mask_draw[row].numpy(),
                            "span_ids": batch.span_ids[row].numpy()}


def damaged_copy(built: str, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("damaged") / "shards")
    shutil.copytree(built, out)
    return out


def shard_paths(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".tar"))


def record(directory: str, shard: str) -> None:
    """Record ``shard``'s present size and sha256 in its job manifest (the "recorded" kind of damage)."""
    name = os.path.basename(shard)
    for k in range(json.load(open(os.path.join(directory, MANIFEST)))["num_jobs"]):
        path = os.path.join(directory, job_manifest_name(k))
        job = json.load(open(path))
        for entry in job["shards"]:
            if entry["name"] == name:
                entry.update(bytes=os.path.getsize(shard), sha256=sha256_file(shard))
        write_json_atomic(path, job)


def members(shard: str) -> list[tarfile.TarInfo]:
    with tarfile.open(shard) as tar:
        return tar.getmembers()


def npy_data_offset(shard: str, member: tarfile.TarInfo) -> int:
    """Where the array's bytes start in the shard: after the member's ``.npy`` header (format 1.0)."""
    with open(shard, "rb") as f:
        f.seek(member.offset_data + 8)
        return member.offset_data + 10 + int.from_bytes(f.read(2), "little")


def patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: str, offset: int, mask: int) -> None:
    with open(path, "rb") as f:
        f.seek(offset)
        byte = f.read(1)[0]
    patch(path, offset, bytes([byte ^ mask]))


def set_header_name(shard: str, member: tarfile.TarInfo, name: str) -> None:
    """Rename a tar member in place, with the header's checksum made right again (a tar any reader accepts)."""
    with open(shard, "rb") as f:
        f.seek(member.offset)
        header = bytearray(f.read(tarfile.BLOCKSIZE))
    header[0:100] = name.encode().ljust(100, b"\0")[:100]
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    patch(shard, member.offset, bytes(header))


def check_outcome(directory: str, tokenizer, reference: dict, named: str, must_refuse: bool,
                  none_of: str | None) -> str:
    """Read ``directory`` as a run does; returns "refused" or "unchanged". A refusal must be one line naming
    ``named`` (a path) and a fix, and every sample handed out before it must be one that was built, and none of the
    shard ``none_of`` ("*": none at all); a read that is not refused must hand out exactly the built samples."""
    handed_out = []
    try:
        for key, arrays in read_epoch(directory, tokenizer.info.fingerprint):
            handed_out.append(key)
            assert key in reference, f"a sample that was never built was handed out: {key}"
            assert all(np.array_equal(arrays[k], reference[key][1][k]) for k in arrays), f"sample {key} changed"
    except BUGS as e:
        raise AssertionError(f"a reading bug, not a refusal: {type(e).__name__}: {e}") from e
    except (ValueError, OSError) as e:
        line = one_line(e)
        assert "\n" not in line and named in line, f"the refusal does not name {named}: {line}"
        assert any(fix in line for fix in FIXES), f"the refusal names no fix: {line}"
        read = [k for k in handed_out if none_of == "*" or reference[k][0] == none_of]
        assert not read, f"{len(read)} samples of {none_of} handed out before: {line}"
        return "refused"
    assert not must_refuse, f"accepted: {directory}"
    assert sorted(handed_out) == sorted(reference), "not every built sample was handed out once"
    return "unchanged"


def damaged_member(built: str, tmp_path_factory, data) -> tuple[str, str, tarfile.TarInfo]:
    """A copy of ``built`` to damage, one of its shards and a member of that shard, drawn."""
    directory = damaged_copy(built, tmp_path_factory)
    shard = data.draw(st.sampled_from(shard_paths(directory)))
    return directory, shard, data.draw(st.sampled_from(members(shard)), label="member")


def check_damaged(directory: str, shard: str, recorded: bool, tokenizer, reference: dict, must_refuse: bool) -> None:
    """:func:`check_outcome` of a damaged ``shard``, its size and sha256 recorded in its manifest when ``recorded``
    (else none of its samples may be handed out: the size and hash checks come first)."""
    if recorded:
        record(directory, shard)
    check_outcome(directory, tokenizer, reference, shard, must_refuse, None if recorded else os.path.basename(shard))


# ---------------------------------------------------------------- damage to a tar

@FUZZ
@given(data=st.data(), recorded=st.booleans())
def test_a_truncated_tar(built, reference, tokenizer, tmp_path_factory, data, recorded):
    directory = damaged_copy(built, tmp_path_factory)
    shard = data.draw(st.sampled_from(shard_paths(directory)))
    size = os.path.getsize(shard)
    cut = data.draw(st.integers(0, size - 1), label="cut at")
    os.truncate(shard, cut)
    # a cut inside the tar's end padding loses nothing read; any other must be refused
    last = members(os.path.join(built, os.path.basename(shard)))[-1]
    check_damaged(directory, shard, recorded, tokenizer, reference,
                  must_refuse=not recorded or cut < last.offset_data + last.size)


@FUZZ
@given(data=st.data())
def test_flipped_bytes_in_an_array_member(built, reference, tokenizer, tmp_path_factory, data):
    directory = damaged_copy(built, tmp_path_factory)
    shard = data.draw(st.sampled_from(shard_paths(directory)))
    member = data.draw(st.sampled_from(members(shard)), label="member")
    start = npy_data_offset(shard, member)
    for offset in data.draw(st.sets(st.integers(start, member.offset_data + member.size - 1), min_size=1,
                                    max_size=4), label="offsets"):
        flip(shard, offset, data.draw(st.integers(1, 255), label="xor"))
    check_outcome(directory, tokenizer, reference, shard, must_refuse=True, none_of=os.path.basename(shard))


@FUZZ
@given(data=st.data(), recorded=st.booleans())
def test_flipped_bytes_in_a_header(built, reference, tokenizer, tmp_path_factory, data, recorded):
    """A tar header or an ``.npy`` header: recorded, the tar's checksums and the ``.npy`` parser are what is left."""
    directory, shard, member = damaged_member(built, tmp_path_factory, data)
    header = data.draw(st.sampled_from([(member.offset, tarfile.BLOCKSIZE),
                                        (member.offset_data, npy_data_offset(shard, member) - member.offset_data)]))
    offset = data.draw(st.integers(header[0], header[0] + header[1] - 1), label="offset")
    flip(shard, offset, data.draw(st.integers(1, 255), label="xor"))
    check_damaged(directory, shard, recorded, tokenizer, reference, must_refuse=False)


FIELD_NAMES = ("input_ids", "segments", "mask_rank", "mask_draw", "spans", "paraphrase", "pool_spans", "text_hash")


@FUZZ
@given(data=st.data(), recorded=st.booleans())
def test_a_member_with_another_name(built, reference, tokenizer, tmp_path_factory, data, recorded):
    directory, shard, member = damaged_member(built, tmp_path_factory, data)
    key, field, _ = member.name.split(".")
    other_key = data.draw(st.sampled_from(sorted({m.name.split(".")[0] for m in members(shard)} - {key})))
    name = data.draw(st.one_of(
        st.sampled_from([f"{key}.{f}.npy" for f in FIELD_NAMES if f != field]),  # another field, or a repeated one
        st.just(f"{other_key}.{field}.npy"),  # another sample's
        st.just(f"{key}.{field}.npz"), st.just(f"{key}.{field}"), st.just(f"{key}.{field}.x.npy"),
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
        .filter(lambda n: n != member.name)), label="name")
    set_header_name(shard, member, name)
    check_damaged(directory, shard, recorded, tokenizer, reference, must_refuse=True)


DTYPES = ("<i4", "<u4", "<f4", "<i8", "<u8", "<i2", "<u2", "|u1", "|i1", ">i4", "<f8", "|b1", "<c8", "|O")


@FUZZ
@given(data=st.data(), recorded=st.booleans())
def test_a_member_with_another_dtype(built, reference, tokenizer, tmp_path_factory, data, recorded):
    """The ``.npy`` header's dtype rewritten in place (same header length): the bytes read as another type."""
    directory, shard, member = damaged_member(built, tmp_path_factory, data)
    with open(shard, "rb") as f:
        f.seek(member.offset_data)
        head = f.read(npy_data_offset(shard, member) - member.offset_data)
    descr = head[head.index(b"'descr': '") + 10:][:3]
    dtype = data.draw(st.sampled_from([d for d in DTYPES if d.encode() != descr]), label="dtype")
    patch(shard, member.offset_data + head.index(b"'descr': '") + 10, dtype.encode())
    check_damaged(directory, shard, recorded, tokenizer, reference, must_refuse=True)


# ---------------------------------------------------------------- the sidecar and the manifests

def _sidecar_damage(rows: np.ndarray, data) -> np.ndarray | bytes:
    kind = data.draw(st.sampled_from(["swap", "shift", "length", "drop", "repeat", "dtype", "shape", "bytes",
                                      "truncate", "object"]), label="sidecar damage")
    n = len(rows)
    i = data.draw(st.integers(0, n - 1), label="row")
    out = rows.copy()
    if kind == "swap":
        j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i), label="with row")
        out[[i, j]] = out[[j, i]]
    elif kind in ("shift", "length"):
        out[i, 0 if kind == "shift" else 1] += data.draw(st.integers(-4096, 4096).filter(bool), label="by")
    elif kind == "drop":
        out = np.delete(out, i, axis=0)
    elif kind == "repeat":
        out = np.insert(out, i, out[i], axis=0)
    elif kind == "dtype":
        out = out.astype(data.draw(st.sampled_from([np.int32, np.float64, np.uint64, np.int16]), label="as"))
    elif kind == "shape":
        out = data.draw(st.sampled_from([out.reshape(-1), out[:, :1], np.concatenate([out, out], 1), out[None]]))
    elif kind == "object":
        out = out.astype(object)
    else:
        return data.draw(st.binary(max_size=200), label="bytes") if kind == "bytes" else b"truncate"
    return out


@FUZZ
@given(data=st.data())
def test_a_sidecar_that_disagrees_with_its_shard(built, reference, tokenizer, tmp_path_factory, data):
    """The ``.idx.npy`` holds no checksum of its own: it must agree with the tar it locates samples in."""
    directory = damaged_copy(built, tmp_path_factory)
    shard = data.draw(st.sampled_from(shard_paths(directory)))
    sidecar = index_path(shard)
    damage = _sidecar_damage(np.load(sidecar), data)
    if isinstance(damage, np.ndarray):
        with open(sidecar, "wb") as f:
            np.save(f, damage, allow_pickle=True)
    elif damage == b"truncate":
        os.truncate(sidecar, data.draw(st.integers(0, os.path.getsize(sidecar) - 1), label="cut at"))
    else:
        open(sidecar, "wb").write(damage)
    outcome = check_outcome(directory, tokenizer, reference, shard[: -len(".tar")], must_refuse=False, none_of=None)
    # only a value rewritten equal (an int array as another int type) may read the same samples
    rows = np.load(index_path(os.path.join(built, os.path.basename(shard))))
    assert outcome == "refused" or (isinstance(damage, np.ndarray) and np.array_equal(damage, rows))


@FUZZ
@given(data=st.data())
def test_a_job_manifest_that_disagrees_with_its_shards(built, reference, tokenizer, tmp_path_factory, data):
    directory = damaged_copy(built, tmp_path_factory)
    path = os.path.join(directory, job_manifest_name(0))
    job = json.load(open(path))
    entry = data.draw(st.sampled_from(job["shards"]), label="shard")
    field = data.draw(st.sampled_from(["samples", "bytes", "sha256", "name"]), label="field")
    shard = os.path.join(directory, entry["name"])
    if field == "sha256":
        entry[field] = data.draw(st.text("0123456789abcdef", min_size=64, max_size=64).filter(
            lambda h: h != entry["sha256"]), label="sha256")
    elif field == "name":
        entry[field] = data.draw(st.sampled_from([e["name"] for e in job["shards"] if e is not entry]
                                                 + ["shard-x.tar", "missing.tar"]), label="name")
        shard = os.path.join(directory, entry[field])
    else:
        entry[field] += data.draw(st.integers(-entry[field], 1000).filter(bool), label="by")
    write_json_atomic(path, job)
    check_outcome(directory, tokenizer, reference, shard, must_refuse=True, none_of=os.path.basename(shard))


@FUZZ
@given(data=st.data(), which=st.sampled_from(["manifest", "job"]))
def test_a_manifest_of_another_format_version(built, reference, tokenizer, tmp_path_factory, data, which):
    directory = damaged_copy(built, tmp_path_factory)
    path = os.path.join(directory, MANIFEST if which == "manifest" else job_manifest_name(0))
    manifest = json.load(open(path))
    version = data.draw(st.one_of(
        st.sampled_from(["decoder-encoders-shards/0", "decoder-encoders-shards/2", "decoder-encoders-shards/1 ",
                         "webdataset", ""]),
        st.text(max_size=30), st.integers(), st.none(), st.just("(missing)")).filter(
        lambda v: v != manifest["format"]), label="format")
    if version == "(missing)":
        del manifest["format"]
    else:
        manifest["format"] = version
    write_json_atomic(path, manifest)
    check_outcome(directory, tokenizer, reference, path, must_refuse=True, none_of="*")
