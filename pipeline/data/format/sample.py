"""The on-disk contract between data prep and training.

A shard directory holds webdataset tar shards plus JSON manifests. Every sample is one tar "key" with these
members (numpy ``.npy`` each, so plain ``webdataset.WebDataset(...).decode()`` reads them too):

- ``input_ids.npy``  int32 [seq_len]     token ids; positions outside every segment are padding (``pad_id``)
- ``segments.npy``   int32 [k, 2]        [start, end) of each document piece in the sample, in order
- ``mask_rank.npy``  uint16 [seq_len]    masking plan: rank of each token among the maskable ones;
                                         ``UNMASKABLE`` for special tokens and padding
- ``mask_draw.npy``  uint32 [seq_len]    replacement draw: ``draw % 10`` picks mask (0-7) / random (8) / keep (9),
                                         ``draw // 10`` picks the random replacement token
- ``spans.npy``      int32 [m, 2]        MAGNET spans, [start, end), sorted, each inside one segment
- ``paraphrase.npy`` int32 [seq_len]     OPTIONAL, in every sample of unit shards built with ``--paraphrase-field``
                                         and in no other: the record's paraphrase (MAGNET's x+), wrapped in BOS/EOS
                                         and padded with ``pad_id`` like ``input_ids``
- ``pool_spans.npy`` int32 [t, 2]        PAIRS only (``--pairs``, ``pairs.py``): per slot (query, positive,
                                         negatives) the [start, end) of the text tokens pooling reads, inside
                                         the slot's segment (the instruction, BOS and EOS left out)
- ``text_hash.npy``  int64 [t]           PAIRS only: a 64-bit hash of each slot's text (without instruction), so
                                         the objective can tell equal texts apart from in-batch negatives

Pairs samples carry no masking plan: ``mask_rank`` and ``mask_draw`` are absent from them (``spans`` is empty);
the loader fills the batch with "never masked" for them.

Keys are ``f{file_index:06d}s{sample_index:08d}``: ``file_index`` is the input file's position in the sorted input
list, ``sample_index`` the sample's position in that file's packed stream. Both are independent of how many prep
jobs ran, so K jobs and 1 job produce the same set of samples.

Beside each shard ``X.tar`` sits ``X.idx.npy``: int64 [n, 2] byte (offset, length) of each sample's members inside
the tar, so the trainer can read any sample without scanning the shard.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass

import numpy as np

FORMAT_VERSION = "decoder-encoders-shards/1"
UNMASKABLE = np.iinfo(np.uint16).max
MAX_SEQ_LEN = int(UNMASKABLE) - 1
TAR_MTIME = 1_700_000_000  # fixed so that shard bytes are reproducible

FIELDS = {
    "input_ids": np.int32,
    "segments": np.int32,
    "mask_rank": np.uint16,
    "mask_draw": np.uint32,
    "spans": np.int32,
}
OPTIONAL_FIELDS = {"paraphrase": np.int32, "pool_spans": np.int32, "text_hash": np.int64}
PLAN_FIELDS = ("mask_rank", "mask_draw")  # required in every sample but pairs samples (those with pool_spans)


def sample_key(file_index: int, sample_index: int) -> str:
    return f"f{file_index:06d}s{sample_index:08d}"


def parse_key(key: str) -> tuple[int, int]:
    return int(key[1:7]), int(key[8:])


@dataclass(frozen=True)
class Sample:
    key: str
    input_ids: np.ndarray
    segments: np.ndarray
    mask_rank: np.ndarray | None  # None in pairs samples only
    mask_draw: np.ndarray | None
    spans: np.ndarray
    paraphrase: np.ndarray | None = None
    pool_spans: np.ndarray | None = None
    text_hash: np.ndarray | None = None

    def fields(self) -> dict[str, type]:
        """Name -> dtype of the members this sample has: every required one, and the optional ones it carries."""
        return {name: dtype for name, dtype in (FIELDS | OPTIONAL_FIELDS).items() if getattr(self, name) is not None}

    def validate(self, seq_len: int) -> None:
        """Raise ValueError when arrays are out of bounds: checked by inspect_shards and the loader for every sample."""
        fields = self.fields()
        missing = [n for n in PLAN_FIELDS if n not in fields and self.pool_spans is None]
        if missing:
            raise ValueError(f"sample {self.key}: missing members {missing}")
        for name, dtype in fields.items():
            arr = getattr(self, name)
            if arr.dtype != dtype:
                raise ValueError(f"sample {self.key}: {name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
        for name in ("input_ids", *(n for n in (*PLAN_FIELDS, "paraphrase") if n in fields)):
            if getattr(self, name).shape != (seq_len,):
                raise ValueError(f"sample {self.key}: {name} has shape {getattr(self, name).shape}, expected ({seq_len},)")
        for name in ("segments", "spans"):
            arr = getattr(self, name)
            if arr.ndim != 2 or arr.shape[1] != 2:
                raise ValueError(f"sample {self.key}: {name} must have shape [k, 2], got {arr.shape}")
            if len(arr) and ((arr[:, 0] >= arr[:, 1]).any() or arr.min() < 0 or arr.max() > seq_len):
                raise ValueError(f"sample {self.key}: {name} has an empty or out-of-bounds interval: {arr.tolist()}")
            if len(arr) > 1 and (arr[1:, 0] < arr[:-1, 1]).any():
                raise ValueError(f"sample {self.key}: {name} intervals overlap or are unsorted: {arr.tolist()}")
        seg, spans = self.segments, self.spans
        inside = ((seg[None, :, 0] <= spans[:, None, 0]) & (spans[:, None, 1] <= seg[None, :, 1])).any(axis=1)
        if not inside.all():
            s, e = spans[int(np.argmin(inside))]
            raise ValueError(f"sample {self.key}: span [{s}, {e}) crosses a document boundary or padding")
        if self.pool_spans is not None:
            self._validate_pairs()

    def _validate_pairs(self) -> None:
        """A pairs sample: one pool span and one text hash per slot (segment), each span inside its segment."""
        seg, pool = self.segments, self.pool_spans
        if pool.shape != seg.shape or self.text_hash is None or self.text_hash.shape != (len(seg),):
            raise ValueError(f"sample {self.key}: pool_spans {pool.shape} and text_hash "
                             f"{None if self.text_hash is None else self.text_hash.shape} must have one entry per "
                             f"segment ({len(seg)})")
        if ((pool[:, 0] < seg[:, 0]) | (pool[:, 0] > pool[:, 1]) | (pool[:, 1] > seg[:, 1])).any():
            raise ValueError(f"sample {self.key}: pool_spans {pool.tolist()} leave their segments {seg.tolist()}")


def _header_template() -> bytes:
    info = tarfile.TarInfo("")
    info.mtime = TAR_MTIME
    info.mode = 0o444
    info.uname = info.gname = "data"
    buf = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
    buf[148:156] = b" " * 8  # the checksum is computed with its own field as spaces
    return bytes(buf)


_HEADER_TEMPLATE = _header_template()
_ZEROS = bytes(tarfile.BLOCKSIZE)
_MEMBER_PREFIXES: dict[tuple[int, str, str, tuple[int, ...]], tuple[bytes, int, int]] = {}


def _member_prefix(key_len: int, field: str, arr: np.ndarray) -> tuple[bytes, int, int]:
    """For member ``KEY.field.npy`` holding ``arr``: (its ustar header, the key's bytes left zero, followed by the
    ``np.save`` header; the ustar checksum without the key; the zero padding after the data). Cached, as only the
    key changes from sample to sample: building these headers cost more than the data for arrays of this size."""
    cache_key = (key_len, field, arr.dtype.str, arr.shape)
    entry = _MEMBER_PREFIXES.get(cache_key)
    if entry is None:
        buf = io.BytesIO()
        np.save(buf, np.zeros(arr.shape, arr.dtype), allow_pickle=False)
        npy_header = buf.getvalue()[: len(buf.getvalue()) - arr.nbytes]
        suffix = f".{field}.npy".encode()
        if key_len + len(suffix) > 100:
            raise ValueError(f"tar member names of {key_len}-byte keys and field {field!r} exceed 100 bytes")
        size = len(npy_header) + arr.nbytes
        header = bytearray(_HEADER_TEMPLATE)  # its name field is all zeros
        header[key_len : key_len + len(suffix)] = suffix
        header[124:136] = b"%011o\0" % size
        entry = _MEMBER_PREFIXES[cache_key] = (bytes(header) + npy_header, sum(header), -size % tarfile.BLOCKSIZE)
    return entry


def append_sample_tar(sample: Sample, out: bytearray) -> None:
    """Append the tar members of one sample (``.npy`` files in a fixed order, optional members last) to ``out``:
    byte-identical to ``TarFile.addfile`` of ``np.save``'s bytes with the fixed metadata above, built directly
    because tarfile's pure-Python header code and the intermediate copies cost more than tokenizing in data prep."""
    key = sample.key.encode()
    key_sum = sum(key)
    for field, dtype in sample.fields().items():
        arr = np.ascontiguousarray(getattr(sample, field), dtype=dtype)
        prefix, checksum, padding = _member_prefix(len(key), field, arr)
        start = len(out)
        out += prefix
        out[start : start + len(key)] = key
        out[start + 148 : start + 155] = b"%06o\0" % (checksum + key_sum)
        out += arr.reshape(-1).view(np.uint8).data
        out += _ZEROS[:padding]


def tar_end(size: int) -> bytes:
    """What ``TarFile.close`` appends to an archive of ``size`` bytes: two zero blocks, then zeros to a record."""
    size += 2 * tarfile.BLOCKSIZE
    return bytes(2 * tarfile.BLOCKSIZE + -size % tarfile.RECORDSIZE)


def _load_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> np.ndarray:
    """The array of one ``.npy`` member, of the dtype the format gives its field, with no byte left over."""
    field = member.name.split(".")[1]
    dtype = np.dtype((FIELDS | OPTIONAL_FIELDS)[field])
    f = tar.extractfile(member)
    if f is None:
        raise ValueError(f"tar member {member.name!r} is not a regular file")
    buf = io.BytesIO(f.read())
    try:  # np.load's header parser raises SyntaxError and others on damaged text, not only ValueError
        arr = np.load(buf, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - every way a damaged .npy fails is the same finding: this member
        raise ValueError(f"tar member {member.name!r} is no readable .npy array ({type(e).__name__}: "
                         f"{' '.join(str(e).split())})") from None
    if arr.dtype != dtype:
        raise ValueError(f"tar member {member.name!r} has dtype {arr.dtype}, the format's is {dtype}")
    if buf.tell() != len(buf.getbuffer()):
        raise ValueError(f"tar member {member.name!r} holds {len(buf.getbuffer()) - buf.tell()} bytes after its array")
    return arr


def decode_members(blob: bytes) -> Sample:
    """Decode the tar bytes of one sample (as located by the ``.idx.npy`` sidecar): each member once, of a known
    field and of its dtype; raises ValueError naming what is wrong."""
    arrays: dict[str, np.ndarray] = {}
    key = None
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for member in tar:
            parts = member.name.split(".")
            if len(parts) != 3 or parts[2] != "npy" or (parts[1] not in FIELDS and parts[1] not in OPTIONAL_FIELDS):
                raise ValueError(f"unexpected tar member {member.name!r}")
            stem, field, _ = parts
            key = stem if key is None else key
            if stem != key:
                raise ValueError(f"members of two samples ({key}, {stem}) in one index entry")
            if field in arrays:
                raise ValueError(f"sample {key}: member {field} twice")
            arrays[field] = _load_member(tar, member)
    if key is None:
        raise ValueError("no tar member at this index entry")
    missing = set(FIELDS) - set(arrays) - (set(PLAN_FIELDS) if "pool_spans" in arrays else set())
    if missing:
        raise ValueError(f"sample {key}: missing members {sorted(missing)}")
    return Sample(key=key, **{n: None for n in PLAN_FIELDS} | arrays)


def index_path(shard_path: str) -> str:
    assert shard_path.endswith(".tar"), shard_path
    return shard_path[: -len(".tar")] + ".idx.npy"


def read_sample(f, offset: int, length: int) -> Sample:
    f.seek(offset)
    return decode_members(f.read(length))
