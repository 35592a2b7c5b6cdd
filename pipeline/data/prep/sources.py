"""Reading documents from input files, with bad records counted instead of crashing the job.

Supported inputs (``READERS``, by suffix): ``.jsonl``, ``.jsonl.zst``, ``.jsonl.gz`` (one JSON object a line),
``.parquet``, and a local HF ``datasets`` directory (``datasets.save_to_disk``). With a :class:`SourceField` each record's source (its data
set, e.g. SlimPajama's ``meta.redpajama_set_name``) is read beside its text. Each bad record is counted under one of ``BAD_REASONS`` and the
first few are kept as messages naming the file and line; the caller decides, through ``--max-bad-fraction``,
whether there were too many. A truncated or corrupt compressed file yields every record decoded before the damage
and then counts one ``corrupt_file`` record: a shard job must not lose a whole file to one bad block.
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

CHUNK_BYTES = 1 << 20
MAX_EXAMPLES = 5

BAD_REASONS = {
    "corrupt_file": "the file is truncated or corrupt (records before the damage were kept); re-download or "
                    "re-create it",
    "not_json": "the line is not a JSON object; fix or remove it",
    "missing_field": "the record has no text field; set --text-field (or --paraphrase-field) to the field that "
                     "holds it",
    "not_string": "the text field is not a string; set --text-field to a string field",
    "empty": "the document is empty or only whitespace; drop it from the input",
    "invalid_utf8": "the record is not valid UTF-8; re-encode the file as UTF-8",
    "bad_pair": "a pairs row needs a non-empty string query and positive and --negatives non-empty string "
                "negatives (negative: a string or a list); fix or drop the row",
    "long_instruction": "the row's instruction leaves no room for its text; shorten it or raise --max-text-tokens",
    "no_instruction": "the row has no instruction field and its task none in --instructions; add one of them",
    "missing_source": "the record names no source (the --source-field is missing, null, empty or not a string); "
                      "fix the input, or set --source-default NAME to give such records a source",
}


class InputError(ValueError):
    """An input that cannot be used at all (no such file, unsupported type): raised before any work starts."""


@dataclass
class RecordStats:
    """Good and bad record counts of one input file; ``examples`` holds the first few bad records' messages."""

    documents: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add_bad(self, reason: str, where: str, detail: str, count: int = 1) -> None:
        assert reason in BAD_REASONS, reason
        self.bad[reason] = self.bad.get(reason, 0) + count
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {detail}: {BAD_REASONS[reason]}")

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    @property
    def bad_fraction(self) -> float:
        total = self.documents + self.num_bad
        return self.num_bad / total if total else 0.0


@dataclass(frozen=True)
class SourceField:
    """Where a record names its source: ``path`` is a record field, dotted into nested objects (SlimPajama's
    ``meta.redpajama_set_name``; a field whose own name holds the dots is taken first); "" reads none. A record
    without a source (missing, null, empty or not a string) gets ``default``, or is a bad record
    (``missing_source``) when ``default`` is ""."""

    path: str
    default: str = ""

    def column(self, columns: list[str]) -> str | None:
        """The column of a columnar input (parquet, HF dataset) that holds the source, None when it has none."""
        if not self.path:
            return None
        head = self.path if self.path in columns else self.path.split(".")[0]
        return head if head in columns else None

    def lookup(self, record: dict):
        """The raw value at ``path`` in ``record``, None when some part of the path is missing."""
        if not self.path:
            return None
        if self.path in record:
            return record[self.path]
        value = record
        for part in self.path.split("."):
            if not isinstance(value, dict):
                return None
            value = value.get(part)
        return value

    def name(self, value) -> str | None:
        """The source of a record whose field holds ``value`` (``default`` for none), None when it has none."""
        if isinstance(value, str) and value.strip():
            return value
        return self.default or None


def is_hf_dataset_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(
        os.path.join(path, "dataset_info.json"))


def _check_input(path: str) -> None:
    if os.path.isdir(path):
        if is_hf_dataset_dir(path):
            return
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise InputError(f"{path} is a datasets DatasetDict with splits {splits}; pass one split's directory, "
                             f"e.g. {os.path.join(path, splits[0] if splits else 'train')}")
        raise InputError(f"{path} is a directory but not a saved HF dataset (no state.json); pass a glob of its "
                         f"files instead, e.g. '{os.path.join(path, '*.jsonl.zst')}'")
    if not path.endswith(SUFFIXES):
        raise InputError(f"{path}: unsupported input type; expected one of {', '.join(SUFFIXES)} "
                         f"or a datasets.save_to_disk directory")


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Paths of all inputs, sorted: the position in this list is a file's ``file_index`` in the sample keys."""
    paths: set[str] = set()
    for pattern in patterns:
        matches = [pattern] if os.path.exists(pattern) else glob.glob(pattern, recursive=True)
        if not matches:
            raise InputError(f"--input {pattern!r} matches no file; check the path or quote the glob")
        for path in matches:
            _check_input(path)
            paths.add(path)
    return sorted(paths)


def input_record(path: str) -> dict:
    """The absolute path, bytes and newest modification time (ns) of an input (all files of a dataset directory):
    what the manifest records of it, so a run naming its inputs notices another file or a changed one."""
    files = [path] if not os.path.isdir(path) else [os.path.join(root, name) for root, _, names in os.walk(path)
                                                    for name in names]
    stats = [os.stat(f) for f in files]
    return {"path": os.path.abspath(path), "bytes": sum(s.st_size for s in stats),
            "mtime_ns": max((s.st_mtime_ns for s in stats), default=0)}


def input_size(path: str) -> int:
    """Bytes on disk (all files of a dataset directory): in the manifest's fingerprinted settings."""
    return input_record(path)["bytes"]


class _Truncated(Exception):
    pass


def _zstd_chunks(f) -> Iterator[bytes]:
    """Decompressed blocks of a (multi-frame) zstd stream; raises ``_Truncated`` if the last frame is cut short
    (the streaming reader would silently stop there)."""
    dctx = zstandard.ZstdDecompressor()
    dobj, in_frame = dctx.decompressobj(), False
    while data := f.read(CHUNK_BYTES):
        while data:
            out = dobj.decompress(data)
            in_frame = True
            if out:
                yield out
            if not dobj.eof:
                break
            data = dobj.unused_data
            dobj, in_frame = dctx.decompressobj(), False
    if in_frame:
        raise _Truncated("the zstd stream ends in the middle of a frame")


def _gzip_chunks(f) -> Iterator[bytes]:
    """Like ``_zstd_chunks`` for (multi-member) gzip."""
    dobj, in_member = zlib.decompressobj(16 + zlib.MAX_WBITS), False
    while data := f.read(CHUNK_BYTES):
        while data:
            out = dobj.decompress(data)
            in_member = True
            if out:
                yield out
            if not dobj.eof:
                break
            data = dobj.unused_data
            dobj, in_member = zlib.decompressobj(16 + zlib.MAX_WBITS), False
    if in_member:
        raise _Truncated("the gzip stream ends in the middle of a member")


def _plain_chunks(f) -> Iterator[bytes]:
    while data := f.read(CHUNK_BYTES):
        yield data


# a jsonl input's compression by its suffix: what yields its decompressed blocks (no suffix here: plain)
COMPRESSIONS: dict[str, Callable[[BinaryIO], Iterator[bytes]]] = {".zst": _zstd_chunks, ".gz": _gzip_chunks}
JSONL_SUFFIXES = (".jsonl", *(f".jsonl{suffix}" for suffix in COMPRESSIONS))


def _lines(path: str, stats: RecordStats) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a jsonl file; decompression damage ends the file with one ``corrupt_file`` record."""
    chunks = next((c for suffix, c in COMPRESSIONS.items() if path.endswith(suffix)), _plain_chunks)
    lineno, tail = 0, b""
    with open(path, "rb") as f:
        try:
            for chunk in chunks(f):
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    lineno += 1
                    yield lineno, line
        except (zstandard.ZstdError, zlib.error, _Truncated) as e:
            stats.add_bad("corrupt_file", f"{path}:{lineno + 1}", f"decompression failed ({e})")
            return
    if tail.strip():
        yield lineno + 1, tail


def _text_problem(value, name: str, first: bool) -> tuple[str, str] | None:
    """(bad reason, detail) when a field's value is not usable text; ``first`` is the document text field."""
    if value is None:
        return "missing_field", f"field {name!r} is missing or null"
    if not isinstance(value, str):
        return "not_string", f"field {name!r} is {type(value).__name__}"
    if not value.strip():
        return "empty", "empty document" if first else f"field {name!r} is empty"
    return None


def _check_record(values: tuple, where: str, fields: tuple[str, ...], stats: RecordStats,
                  source: SourceField | None = None, raw_source=None) -> tuple | None:
    """The record's field values (and its source's name last, with ``source``), or None after counting why the
    record is bad (its first bad field)."""
    for i, (value, name) in enumerate(zip(values, fields)):
        problem = _text_problem(value, name, i == 0)
        if problem is not None:
            reason, detail = problem
            stats.add_bad(reason, where, detail)
            return None
    if source is not None:
        name = source.name(raw_source)
        if name is None:
            stats.add_bad("missing_source", where, f"field {source.path!r} is "
                          + ("missing or null" if raw_source is None else f"{raw_source!r}"))
            return None
        values = (*values, name)
    stats.documents += 1
    return values


def has_surrogate(text: str) -> bool:
    """A JSON \\u escape can encode a lone surrogate, which is not text any tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_objects(path: str, stats: RecordStats) -> Iterator[tuple[str, str, dict]]:
    """(``path:line``, the line, its JSON object) of each line of a jsonl input that is one; other lines are
    counted in ``stats`` (``invalid_utf8``, ``not_json``). Blank lines are skipped."""
    for lineno, raw in _lines(path, stats):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            stats.add_bad("invalid_utf8", where, f"byte {e.start} is not UTF-8")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            at = "" if e.msg.endswith(" at") else " at"  # "Unterminated string starting at" names its column
            stats.add_bad("not_json", where, f"invalid JSON ({e.msg}{at} column {e.colno})")
            continue
        if not isinstance(record, dict):
            stats.add_bad("not_json", where, f"a JSON {type(record).__name__}, not an object")
            continue
        yield where, line, record


def _read_jsonl(path: str, fields: tuple[str, ...], stats: RecordStats,
                source: SourceField | None) -> Iterator[tuple]:
    for where, line, record in read_objects(path, stats):
        values = tuple(record.get(name) for name in fields)
        if ("\\ud" in line or "\\uD" in line) and any(isinstance(v, str) and has_surrogate(v) for v in values):
            stats.add_bad("invalid_utf8", where, "the text holds a lone surrogate (a \\ud800-\\udfff escape)")
            continue
        values = _check_record(values, where, fields, stats, source, source and source.lookup(record))
        if values is not None:
            yield values


def _columns_to_read(fields: tuple[str, ...], columns: list[str], source: SourceField | None) -> list[str]:
    """The text fields, then the source's column when the input has it."""
    column = source.column(columns) if source is not None else None
    return list(fields) + ([column] if column is not None else [])


def _read_columns(path: str, fields: tuple[str, ...], columns: list[str], num_rows: int, batches: Iterable[list],
                  stats: RecordStats, source: SourceField | None) -> Iterator[tuple]:
    """Rows of a columnar input (parquet file or HF dataset), where a missing text column makes every row bad.
    ``batches`` yields, per batch, one list of values per column of :func:`_columns_to_read`."""
    missing = [name for name in fields if name not in columns]
    if missing:
        stats.add_bad("missing_field", f"{path}: rows 1-{num_rows}", f"no column {missing[0]!r} "
                      f"(columns: {columns})", count=num_rows)
        return
    column = source.column(columns) if source is not None else None
    row = 0
    for values in batches:
        for record in zip(*values):
            row += 1
            raw = source.lookup({column: record[-1]}) if column is not None else None
            record = _check_record(record[: len(fields)], f"{path}: row {row}", fields, stats, source, raw)
            if record is not None:
                yield record


def _read_parquet(path: str, fields: tuple[str, ...], stats: RecordStats,
                  source: SourceField | None) -> Iterator[tuple]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns = pf.schema_arrow.names
        read = _columns_to_read(fields, columns, source)
        batches = ([c.to_pylist() for c in b.columns] for b in pf.iter_batches(columns=read))
        yield from _read_columns(path, fields, columns, pf.metadata.num_rows, batches, stats, source)
    except (pa.ArrowException, OSError) as e:
        stats.add_bad("corrupt_file", path, f"cannot read parquet ({e})")


def _read_hf_dataset(path: str, fields: tuple[str, ...], stats: RecordStats,
                     source: SourceField | None) -> Iterator[tuple]:
    import datasets

    ds = datasets.load_from_disk(path)
    read = _columns_to_read(fields, ds.column_names, source)
    batches = ([batch[name] for name in read] for batch in ds.select_columns(read).iter(batch_size=1024)) \
        if all(name in ds.column_names for name in fields) else iter(())
    yield from _read_columns(path, fields, ds.column_names, ds.num_rows, batches, stats, source)


# each input type by how a file's name ends (a directory is a saved HF dataset): its reader of ``fields``
READERS: dict[str, Callable[[str, tuple[str, ...], RecordStats, SourceField | None], Iterator[tuple]]] = {
    **dict.fromkeys(JSONL_SUFFIXES, _read_jsonl), ".parquet": _read_parquet}
SUFFIXES = tuple(READERS)


def read_records(path: str, fields: tuple[str, ...], stats: RecordStats,
                 source: SourceField | None = None) -> Iterator[tuple[str, ...]]:
    """The values of ``fields`` (all non-empty strings) of each record of one input, in file order, followed by
    the record's source name when ``source`` is given; a record with a bad field (or no source) is counted in
    ``stats`` and skipped."""
    if os.path.isdir(path):
        return _read_hf_dataset(path, fields, stats, source)
    reader = next((r for suffix, r in READERS.items() if path.endswith(suffix)), _read_jsonl)
    return reader(path, fields, stats, source)


def read_texts(path: str, text_field: str, stats: RecordStats) -> Iterator[str]:
    """The documents of one input, in file order; bad records are counted in ``stats`` and skipped."""
    return (text for (text,) in read_records(path, (text_field,), stats))
