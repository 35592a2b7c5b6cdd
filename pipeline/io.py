"""The project's JSON, JSONL and YAML files: readers whose errors name the file, what is wrong and the fix, and the
atomic JSON writer; the checkout (``REPO``) and the paths records keep relative to it (:func:`repo_relative`).

A reader raises ``missing`` when the file does not exist and ``error`` when it is not valid JSON/YAML or its top
level is not ``top``; a caller passes its own classes (``ConfigError`` for experiment files, ``DataError`` for
evaluation data) so its users see the errors they already handle. Messages read ``{path}: {what is wrong}; {fix}``.
Writers finish a temporary file and rename it (:func:`fsync_replace`), so a killed writer leaves no half file;
a directory is written beside its place and renamed into it the same way (:func:`directory_beside`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOP_NAMES = {dict: "a mapping", list: "a list"}


def repo_relative(path: str) -> str:
    """``path`` as records hold it: relative to the repository root when inside the repository (the commands run
    from there), so committed records read the same in every clone; absolute when outside it."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else full


def _fail(error: type[Exception], path: str, problem: str, fix: str) -> Exception:
    return error(f"{path}: {problem}" + (f"; {fix}" if fix else ""))


def _check_top(data: Any, path: str, top: type | None, what: str, fix: str, error: type[Exception]) -> Any:
    if top is not None and not isinstance(data, top):
        raise _fail(error, path, f"the {what}'s top level must be {_TOP_NAMES.get(top, top.__name__)}, got "
                                 f"{type(data).__name__}", fix)
    return data


def _read(path: str, load, bad: type[Exception], kind: str, fix: str, what: str, top: type | None,
          error: type[Exception], missing: type[Exception]) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            data = load(f)
    except FileNotFoundError as e:
        raise _fail(missing, path, f"{what} not found", fix) from e
    except bad as e:
        raise _fail(error, path, f"not valid {kind} ({e})", fix) from e
    return _check_top(data, path, top, what, fix, error)


def read_json(path: str, fix: str = "", *, what: str = "file", top: type | None = dict,
              error: type[Exception] = ValueError, missing: type[Exception] = FileNotFoundError) -> Any:
    """The JSON value in ``path`` (a mapping unless ``top`` says otherwise; None accepts any value)."""
    return _read(path, json.load, json.JSONDecodeError, "JSON", fix, what, top, error, missing)


def _load_yaml(f) -> Any:
    data = yaml.safe_load(f)
    return {} if data is None else data


def read_yaml(path: str, fix: str = "", *, what: str = "file", top: type | None = dict,
              error: type[Exception] = ValueError, missing: type[Exception] = FileNotFoundError) -> Any:
    """The YAML value in ``path``; an empty file is an empty mapping."""
    return _read(path, _load_yaml, yaml.YAMLError, "YAML", fix, what, top, error, missing)


def read_jsonl(path: str, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a .jsonl file; a bad line is an ``error`` naming it."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(error, f"{path}:{line_no}", f"not valid JSON ({e})",
                            "a .jsonl file holds one object per line") from e
            if not isinstance(record, dict):
                raise _fail(error, f"{path}:{line_no}", f"expected a JSON object, got {type(record).__name__}", "")
            yield line_no, record


def fsync_replace(tmp: str, final: str) -> None:
    """Give the finished file ``tmp`` the name ``final`` once its bytes are on disk: a reader or a killed writer
    never sees half a file under the final name."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` through the temporary file ``{path}.tmp{pid}`` (:func:`fsync_replace`)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    fsync_replace(tmp, path)


@contextlib.contextmanager
def directory_beside(out: str) -> Iterator[str]:
    """Yield ``{out}.partial``, emptied, to write a directory into; once the block ends it takes ``out``'s place by
    rename (a previous ``out`` moved aside first, then removed). A writer killed or failed on the way leaves no
    partial directory under ``out``'s name: the previous one, or none."""
    out = os.path.normpath(out)
    tmp, old = f"{out}.partial", f"{out}.old"
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(out):
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
