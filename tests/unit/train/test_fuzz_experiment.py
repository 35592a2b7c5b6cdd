"""Every experiment field fuzzed on the real entry (issue 43): ``launch/train.py --check --set KEY=VALUE`` in process
(``entry.main``, preflight only: no process group, no engine) with values out of range, of the wrong type, unknown
keys, nested values of the wrong shape, and values each legal but contradicting each other. Each must end with exit
2 and one ``config error:`` line that names the field and says what to do, never a traceback, never a run.

The fields come from the dataclass configs (:class:`~pipeline.experiment.ExperimentConfig` and every objective's
config), so a new field is fuzzed without a change here. Bounded for ``make test``: a fixed number of examples,
derandomized (the same cases every run). The counts: docs/reliability.md, "Experiment fields, fuzzed".
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import keyword
import math
import os
import types
import typing
from typing import Any, Literal, Union

import pytest
import yaml
from helpers import REPO, cpu_env, in_process_entry
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pipeline.config import _tags, in_range
from pipeline.experiment import ExperimentConfig, PhaseSpec

# FUZZ_EXAMPLES=2000 FUZZ_SEED=1 explores beyond the fixed cases of make test (docs/reliability.md)
EXAMPLES, SEED = int(os.environ.get("FUZZ_EXAMPLES", 150)), os.environ.get("FUZZ_SEED")
FUZZ = settings(max_examples=EXAMPLES, derandomize=SEED is None, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# what the line says to do: the allowed values, the range, the key meant, or the setting to change
FIX = ("expected", "must be", "choose", "allowed keys", "did you mean", "set ", "use ", "write ", "e.g.", "lower",
       "remove", "is not allowed", "needs", "name ", "check ")


@dataclasses.dataclass(frozen=True)
class Field:
    """A leaf of the experiment: where it sits, its type, and its range (the owning class's RANGES)."""

    path: tuple[str | int, ...]  # ("train", "steps"), ("phases", 0, "share"), ("phases", 0, "objectives", 0, "ratio")
    hint: Any
    spec: str | None
    objective: str | None = None  # the objective's name, for its fields

    @property
    def name(self) -> str:
        return str(self.path[-1])


def _fields(cls: type, path: tuple = (), objective: str | None = None) -> list[Field]:
    """Every field of ``cls``, nested dataclasses walked: a list of dataclasses through its item 0, a tagged union
    (the objectives) through each of its dataclasses."""
    hints, ranges, out = typing.get_type_hints(cls), getattr(cls, "RANGES", {}), []
    for f in dataclasses.fields(cls):
        hint, where = hints[f.name], (*path, f.name)
        out.append(Field(where, hint, ranges.get(f.name), objective))
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            out += _fields(hint, where, objective)
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            out += _fields(args[0], (*where, 0), objective)
        elif typing.get_origin(hint) is list and args and _tags(args[0]):
            for name, tagged in _tags(args[0]).items():
                out += [fd for fd in _fields(tagged, (*where, 0), name) if fd.name != "name"]
    return out


FIELDS = _fields(ExperimentConfig)
assert {"steps", "share", "ratio", "holdout", "lora"} <= {f.name for f in FIELDS}  # the walk reaches every level


def flow(value: Any) -> str:
    """``value`` as one line of YAML, as a user writes it after ``--set KEY=``."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


# what an objective needs besides its own fields, so that only the fuzzed field is wrong
NEEDS = {"simcse": ["model.attention_dropout=0.1", "data.unit_shards=/u"],
         "sscl": ["model.attention_dropout=0.1", "data.unit_shards=/u"], "supervised": ["data.pair_shards=/p"]}


def _overrides(field: Field, value: Any) -> list[str]:
    """The ``--set`` items that give ``field`` the ``value``: a phase's or an objective's field inside a whole
    ``phases`` list, the others by their dotted key."""
    p = field.path
    if p[0] != "phases" or len(p) == 1:
        return [f"{'.'.join(map(str, p))}={flow(value)}"]
    objective = {"name": field.objective or "clm"}
    phase: dict = {"objectives": [objective]}
    if len(p) == 3:  # phases.0.FIELD (objectives itself too)
        phase[field.name] = value
    else:  # phases.0.objectives.0.FIELD
        objective[field.name] = value
    return [f"phases={flow([phase])}", *NEEDS.get(field.objective or "", [])]


def _base(hint: Any) -> tuple[Any, ...]:
    """The types a value of ``hint`` may take (None dropped: unset is legal)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def _is_legal(hint: Any, value: Any) -> bool:
    """Whether ``value`` has a type ``hint`` takes (ranges aside), so the wrong-type cases leave it out."""
    for t in _base(hint):
        origin = typing.get_origin(t)
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is str and isinstance(value, str):
            return True
        if origin is Literal and value in typing.get_args(t):
            return True
        if (origin in (list, tuple) and isinstance(value, list)) or (
                (t is dict or origin is dict) and isinstance(value, dict)) or t is Any:
            return True
        if dataclasses.is_dataclass(t) and isinstance(value, dict):
            return True
    return False


TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8)
ANY_VALUE = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                      TEXT, st.lists(st.integers(0, 9), max_size=3),
                      st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), min_size=1, max_size=2))


@st.composite
def wrong_type(draw) -> tuple[Field, list[str]]:
    """A field given a value of another type (a nested section given a scalar or a list: the wrong shape)."""
    field = draw(st.sampled_from(FIELDS))
    value = draw(ANY_VALUE.filter(lambda v: not _is_legal(field.hint, v)))
    return field, _overrides(field, value)


RANGED = [f for f in FIELDS if f.spec]


@st.composite
def out_of_range(draw) -> tuple[Field, list[str]]:
    """A numeric field outside its range: an integer field an integer, a float field a number (infinities and NaN
    too), a pair's first item."""
    field = draw(st.sampled_from(RANGED))
    base = _base(field.hint)
    numbers = (st.integers(-10**9, 10**9) if int in base else
               st.one_of(st.floats(-1e9, 1e9), st.sampled_from([math.inf, -math.inf, math.nan])))
    value = draw(numbers.filter(lambda v: not in_range(v, field.spec)))
    pair = any(typing.get_origin(t) is tuple for t in base)
    return field, _overrides(field, [value, 0.5] if pair else value)


# where a key may be added: the top, each section, a phase, an objective
PLACES = [(), *(f.path for f in FIELDS if dataclasses.is_dataclass(f.hint) and f.path[0] != "phases"), ("phases", 0),
          ("phases", 0, "objectives", 0)]
NAME = st.from_regex(r"[a-z][a-z_]{1,11}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))


@st.composite
def unknown_key(draw) -> tuple[Field, list[str]]:
    """A key no section has (a typo of a field, or a new name) at the top, in a section, a phase or an objective."""
    place = draw(st.sampled_from(PLACES))
    objective = draw(st.sampled_from(["clm", "mlm", "magnet"])) if "objectives" in place else None
    names = {f.name for f in FIELDS if f.path[:-1] == place and f.objective in (None, objective)} | {"name"}
    name = draw(NAME.filter(lambda n: n not in names))
    field = Field((*place, name), None, None, objective)
    return field, _overrides(field, 1)


SCALARS = [f for f in FIELDS if all(t in (int, float, bool, str) or typing.get_origin(t) is Literal
                                    for t in _base(f.hint))]


@st.composite
def malformed_key(draw) -> tuple[Field, list[str]]:
    """A dotted key mistyped: an empty part, a part below a value, or an index into a list the experiment does not
    give (``phases.0.share`` without an experiment file: the default phases are not in the file)."""
    field = draw(st.sampled_from(SCALARS))
    parts = [str(p) for p in field.path]
    kind = draw(st.sampled_from(["empty", "below", "index"]))
    if kind == "empty":
        parts.insert(draw(st.integers(1, len(parts))), "")
    elif kind == "below":
        parts.append(draw(NAME))
    elif "phases" not in parts:
        index = draw(st.integers(0, 3))
        return Field(("phases", index, field.name), None, None), [f"phases.{index}.{field.name}=1"]
    return field, [f"{'.'.join(parts)}=1"]


# values each legal alone that contradict each other: (the overrides, what the line must name)
CONTRADICTIONS = [
    (["eval.shards=/held", "eval.holdout=0.1"], "eval.holdout"),
    (["eval.every=5"], "eval.every"),
    (["phases=[{share: 0.5, objectives: [{name: clm}]}, {share: 0.4, objectives: [{name: mlm}]}]"], "phases"),
    (["train.steps=10", "optim.warmup_steps=8", "optim.decay_steps=8"], "optim"),
    (["optim.warmup_ratio=0.9", "optim.decay_ratio=0.5"], "optim"),
    (["train.steps=10", "train.batch_warmup.steps=20"], "train.batch_warmup.steps"),
    (["train.micro_batch=3", "train.batch_warmup.multiple=4"], "train.batch_warmup.multiple"),
    (["phases=[{objectives: [{name: simcse}]}]"], "attention_dropout"),
    (["train.trackers=[tensorboard, tensorboard]"], "train.trackers"),
    (["data.mixture={a: 0.5, b: 0.4}"], "data.mixture"),
    (["data.shards=/mine", "data.build_if_missing=false", "phases=[{seq_len: 64, objectives: [{name: clm}]}]"],
     "phases[0].shards"),
    (["model.attn_implementation=flex"], "model.attn_implementation"),
    (["optim.fused=torch"], "optim.fused"),
    (["model.shape=7b"], "model.shape"),
    (["model.attention_dropout=0.1", "phases=[{objectives: [{name: simcse}]}]"], "data.unit_shards"),
    (["data.pair_shards=/p", "train.grad_accum=2", "phases=[{objectives: [{name: supervised}]}]"],
     "phases[0].objectives[0]"),
    (["data.shards=/mine", "data.build_if_missing=false"], "data.shards"),
    (["data.shards=/mine", "data.build_inputs=[/nowhere/*.jsonl]"], "data.build_inputs"),
    (["train.micro_batch=3", "phases=[{seq_len: 256, objectives: [{name: clm}]}]", "data.seq_len=100"],
     "phases[0].micro_batch"),
    (["phases=[{objectives: [{name: supervised, matryoshka: {dims: [16, 32]}}]}]"], "matryoshka.dims"),
    (["phases=[{objectives: [{name: supervised, matryoshka: {dims: [32, 16], weights: [1]}}]}]"],
     "matryoshka.weights"),
    (["phases=[{objectives: [{name: supervised, matryoshka: {dims: [128, 64]}}]}]"], "matryoshka.dims"),  # > hidden
]


def check_line(tmp_path: str, overrides: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``launch/train.py --check`` with ``overrides``, in process."""
    out, err = io.StringIO(), io.StringIO()
    with in_process_entry() as main, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--check", "--set", f"run_dir={tmp_path}/run", *[a for o in overrides for a in ("--set", o)]])
    return rc, out.getvalue(), err.getvalue()


def assert_refused(tmp_path: str, overrides: list[str], *names: str) -> str:
    """Exit 2, one ``config error:`` line naming each of ``names`` and saying what to do; nothing else."""
    rc, out, err = check_line(tmp_path, overrides)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (overrides, rc, err[-2000:], out[-500:])
    line = lines[0]
    assert line.startswith("config error: ") and all(n in line for n in names), (overrides, line)
    assert any(word in line for word in FIX), (overrides, line)
    assert not os.path.exists(f"{tmp_path}/run"), overrides
    return line


def _names(field: Field) -> tuple[str, ...]:
    """What the line must name of ``field``: its section and its own name (list items in either spelling)."""
    return (str(field.path[0]), field.name) if len(field.path) > 1 else (field.name,)


@FUZZ
@given(st.one_of(wrong_type(), out_of_range(), unknown_key(), malformed_key()))
@(seed(int(SEED)) if SEED else lambda test: test)
def test_a_bad_field_is_one_line_naming_it(tmp_path_factory, case):
    field, overrides = case
    assert_refused(str(tmp_path_factory.getbasetemp()), overrides, *_names(field))


@FUZZ
@given(st.sampled_from(CONTRADICTIONS))
def test_legal_values_that_contradict_are_one_line_naming_the_field(tmp_path_factory, case):
    overrides, name = case
    assert_refused(str(tmp_path_factory.getbasetemp()), overrides, name)


def test_every_field_is_fuzzed():
    """The walk finds the fields of every section, phase and objective: a new field joins the cases by itself."""
    for cls, where in [(ExperimentConfig, ()), (PhaseSpec, ("phases", 0))]:
        assert {f.name for f in dataclasses.fields(cls)} <= {f.name for f in FIELDS if f.path[:-1] == where}
    objectives = {name for f in FIELDS if (name := f.objective)}
    assert objectives == set(_tags(typing.get_args(typing.get_type_hints(PhaseSpec)["objectives"])[0]))


@pytest.mark.e2e
@pytest.mark.parametrize("overrides,name", [
    (["train.steps=abc"], "train.steps"),
    (["phases=[{objectives: [{name: mlm, ratio: 2}]}]"], "phases[0].objectives[0].ratio"),
    (["eval.every=5"], "eval.every"),
])
def test_the_real_script_refuses_in_one_line_and_trains_nothing(tmp_path, overrides, name):
    """The same through ``python launch/train.py`` without --check: refused before anything trains."""
    import subprocess
    import sys

    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--set", f"run_dir={tmp_path}/run",
           *[a for o in overrides for a in ("--set", o)]]
    env = {k: v for k, v in cpu_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2 and len(lines) == 1 and name in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "run")
