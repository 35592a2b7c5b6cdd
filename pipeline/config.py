"""Typed dataclass configs from YAML/dicts, validated at the edge, with ``--set a.b=c`` overrides.

Unknown keys, wrong types and values outside a ``Literal`` are errors that name the dotted key and what is allowed.
Dataclasses may define ``validate(self)`` for cross-field checks (raise :class:`ConfigError`). A union of dataclasses
that each fix ``name`` to one ``Literal`` value is tagged: ``name`` picks the dataclass (:func:`from_tagged`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

from pipeline.io import read_yaml

T = TypeVar("T")
_YAML11_FLOAT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


class ConfigError(ValueError):
    pass


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if _tags(tp):
            return from_tagged(tp, value, key)
        errors = []
        options = [a for a in args if a is not type(None)]
        if isinstance(value, dict) and any(dataclasses.is_dataclass(a) for a in options):
            options = [a for a in options if dataclasses.is_dataclass(a)]  # a mapping is one of them: its error alone
        for arg in options:
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(" / ".join(errors))
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(a, v, f"{key}.{i}") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_coerce(item, v, f"{key}.{i}") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        if not args:
            return dict(value)
        glued = [k for k, v in value.items() if v is None and isinstance(k, str) and ":" in k]
        if glued:  # YAML reads {pos:1} as the key "pos:1" with no value
            raise ConfigError(f"{key}: {glued[0]!r} has no value; YAML needs a space after the colon: "
                              f"{{{glued[0].replace(':', ': ', 1)}}}")
        return {_coerce(args[0], k, f"{key} key"): _coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp}")


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    where = prefix + "." if prefix else ""
    for k in data:
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"did you mean {where}{close[0]}? " if close else ""
            raise ConfigError(f"{where}{k}: unknown key; {hint}allowed keys: {names}")
    kwargs = {k: _coerce(hints[k], v, f"{where}{k}") for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def _tags(union: Any) -> dict[str, type]:
    """``name`` value -> dataclass of a tagged union; empty when ``union`` is not one."""
    tags = {}
    for arg in typing.get_args(union):
        name = typing.get_type_hints(arg).get("name") if dataclasses.is_dataclass(arg) else None
        values = typing.get_args(name) if typing.get_origin(name) is Literal else ()
        if len(values) != 1:
            return {}
        tags[values[0]] = arg
    return tags


def from_tagged(union: Any, data: Any, prefix: str = "") -> Any:
    """The dataclass of the tagged ``union`` that ``data["name"]`` names, built from ``data`` by :func:`from_dict`
    (``{name: mlm, ratio: 0.4}`` is the ``MLMConfig`` of a union of objective configs)."""
    tags = _tags(union)
    if isinstance(data, tuple(tags.values())):
        return data
    key = f"{prefix + '.' if prefix else ''}name"
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(f"{key}: missing in {data!r}; choose one of {list(tags)}")
    if data["name"] not in tags:
        raise ConfigError(f"{key}: {data['name']!r} is not allowed; choose one of {list(tags)}")
    return from_dict(tags[data["name"]], data, prefix)


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


_INDEX = re.compile(r"\[(\d+)\]")  # phases[0]: how the config's errors name a list item


def set_path(data: dict, key: str, value: Any) -> None:
    """``set_path(d, "a.b", v)`` sets d["a"]["b"] = v, creating mappings on the way; integer parts index lists,
    dotted or bracketed (``phases.0.ratio`` or ``phases[0].ratio``: the errors' names, so a suggestion they print
    is a key ``--set`` takes)."""
    parts = _INDEX.sub(r".\1", key.strip()).split(".")
    if not all(parts):
        raise ConfigError(f"--set {key}={value!r}: the key has an empty part; keys are dotted field names, e.g. "
                          f"train.steps=100")
    node: Any = data
    for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {where} has {len(node)} item(s) here (an index counts from 0 over "
                                  f"the list the experiment file gives), so {part!r} names none; set the whole list "
                                  f"instead, e.g. --set '{where}=[...]'")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {where} is {node!r}, not a mapping with the key {part!r}; set {where} "
                              f"itself")
        if i == len(parts) - 1:
            node[part] = value
        elif isinstance(node, list) or part in node:
            node = node[part]
        else:
            node = node.setdefault(part, [] if parts[i + 1].isdigit() else {})


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """The ``--set`` items ``a.b=c`` of every command as (dotted key, yaml(c)) pairs, in order."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.steps=100")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({_yaml_problem(e)}); quote the whole "
                              f"item and close every bracket, e.g. --set 'phases=[{{objectives: [{{name: mlm, "
                              f"ratio: 0.3}}]}}]'") from None
        parsed.append((key.strip(), value))
    return parsed


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's multi-line message in one line: what is wrong and where in the value."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} at character {mark.column + 1}" if mark is not None else problem


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``a.b=c`` sets data["a"]["b"] = yaml(c); integer parts index lists (``phases.1.share=0.75``)."""
    for key, value in parse_overrides(overrides):
        set_path(data, key, value)
    return data


def load_yaml(path: str) -> dict:
    """An experiment (or grid) file: a mapping of config sections; every problem is a ConfigError naming ``path``."""
    return read_yaml(path, what="experiment file", error=ConfigError, missing=ConfigError)


def _merged(base: dict, top: dict) -> dict:
    """``top`` over ``base``: mappings merge key by key, anything else (lists, values) replaces."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_experiment_file(path: str, _seen: tuple[str, ...] = ()) -> dict:
    """An experiment file with its ``base:`` resolved: ``base`` names another experiment file (relative to this
    one) whose sections this file's change, so a variant (a recipe with LoRA, say) says only what differs."""
    data = load_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: expected the path of another experiment file, relative to this one, "
                          f"got {base!r}")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
    if os.path.abspath(base_path) in _seen:
        chain = " -> ".join((*_seen, os.path.abspath(path), os.path.abspath(base_path)))
        raise ConfigError(f"{path}: base: {base} leads back to a file that names it ({chain}); remove one base:")
    return _merged(load_experiment_file(base_path, (*_seen, os.path.abspath(path))), data)


_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])$")


def in_range(value: float, spec: str) -> bool:
    """``spec`` is ``">= a"``, ``"> a"`` or an interval such as ``"(0, 1]"``; non-finite values are never in range."""
    if not math.isfinite(value):
        return False
    if spec.startswith(">="):
        return value >= float(spec[2:])
    if spec.startswith(">"):
        return value > float(spec[1:])
    m = _INTERVAL.match(spec)
    if m is None:
        raise ValueError(f"bad range spec {spec!r}")
    lo, hi = float(m[2]), float(m[3])
    return (lo <= value if m[1] == "[" else lo < value) and (value <= hi if m[4] == "]" else value < hi)


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Walk a config tree and check each dataclass's numeric fields against its ``RANGES`` class attribute
    ({field: spec of :func:`in_range`}; a tuple field's items each); the error names the dotted key, list items
    by index (``phases[1].objectives[0].ratio``), in one line."""
    ranges = getattr(type(obj), "RANGES", {})
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if value is None:  # an optional field left unset
            continue
        if dataclasses.is_dataclass(value):
            check_ranges(value, key + ".")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                check_ranges(item, f"{key}[{i}].")
        elif f.name in ranges:
            spec = ranges[f.name]
            for v in value if isinstance(value, tuple) else (value,):
                if not in_range(v, spec):
                    shown = f"{value!r}" if not isinstance(value, tuple) else f"{list(value)!r}"
                    raise ConfigError(f"{key}: {shown} is out of range; it must be {_describe(spec)}")


def _describe(spec: str) -> str:
    return spec if spec[0] in "<>" else f"in {spec}"
