"""Experiment grids: one base experiment and named axis values; each group's combinations are concrete runs.

A grid file (YAML; paths relative to the file) holds::

    base: base.yaml                  # the experiment every variant starts from
    ds_config: ../../ds_configs/zero3.json
    global_batch: 1152               # samples per optimizer step: grad_accum follows from a run's ranks
    resources: {nodes: 12, gpus_per_node: 8, time: "2-00:00:00"}
    switch_before_decay: true        # a phase switch inside the WSD decay is an error
    smoke: {...}                     # how the CPU twin of every variant differs (see SmokeSpec)
    axes:                            # axis -> value name -> overrides {dotted key: value (replaces what is there)}
      size: {210m: {model.init: 210m}, 610m: {model.init: 610m}}
    groups:                          # group -> the values it takes of each axis
      scratch: {axes: {size: [210m, 610m], objective: [clm, mlm40]}}

A variant is the base with the group's ``set`` and then each picked value applied, in the group's axis order. Its
name is the group's prefix (default: the group name) and the value names joined by "-": ``scratch-610m-mlm40``.
A string may hold ``${run:NAME}``, the run directory of variant NAME (of its twin, in a twin): the variant reads
that run's output (continued pretraining from its HF export) and starts after it.

Every variant and its ``-smoke`` twin is a validated :class:`ExperimentConfig`; a wrong axis, value or variant
name is an error naming the grid file, the key and what exists.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
from dataclasses import dataclass, field

from pipeline.config import ConfigError, from_dict, load_experiment_file, load_yaml, set_path, to_dict
from pipeline.experiment import ExperimentConfig
from pipeline.io import REPO
from pipeline.model.presets import PRESETS

RUN_REF = re.compile(r"\$\{run:([^}]*)\}")
SMOKE_SUFFIX = "-smoke"
# step counts a twin divides by smoke.step_divisor (train.steps exactly; the others rounded down, at least 1)
STEP_KEYS = ("train.steps", "optim.warmup_steps", "optim.decay_steps", "checkpoint.every", "checkpoint.keep_every",
             "train.stop_at_step")


@dataclass(frozen=True)
class Resources:
    nodes: int = 1
    gpus_per_node: int = 1
    time: str = ""  # SLURM --time of one job (a requeued job resumes); "": the partition's default
    gpu: bool = True  # ranks are GPUs (sbatch --gpus-per-node); false: CPU ranks, one core each
    # GPU runs: cores a rank gets (sbatch --cpus-per-task = gpus_per_node x this) for its data workers and compile
    # workers; SLURM would give the whole node's ranks one core
    cpus_per_gpu: int = 8

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.cpus_per_gpu < 1:
            raise ConfigError("resources: nodes, gpus_per_node and cpus_per_gpu must be >= 1, got "
                              f"{self.nodes}, {self.gpus_per_node}, {self.cpus_per_gpu}")


@dataclass
class SmokeSpec:
    """The CPU twin: same phases, objectives and schedule shape, on a tiny model and the sample corpus."""

    step_divisor: int = 1000  # every step count divided by this: 12K steps with a 3K CLM phase -> 12 and 3
    preset: str = "tiny"  # replaces every preset name in model.init and model.shape
    global_batch: int = 8
    resources: Resources = field(default_factory=lambda: Resources(nodes=1, gpus_per_node=2, gpu=False))
    ds_config: str = ""  # the twins' DeepSpeed JSON (relative to the grid file); "": the grid's
    set: dict = field(default_factory=dict)  # overrides applied last (data paths, sequence length, ...)

    def validate(self) -> None:
        if self.step_divisor < 1:
            raise ConfigError(f"smoke.step_divisor must be >= 1, got {self.step_divisor}")
        if self.preset not in PRESETS:
            raise ConfigError(f"smoke.preset: {self.preset!r} is not a preset; choose one of {list(PRESETS)}")


@dataclass
class GroupSpec:
    axes: dict  # axis name -> list of value names
    prefix: str = ""  # first part of the run names (default: the group name)
    set: dict = field(default_factory=dict)  # overrides applied before the axis values
    exclude: list[str] = field(default_factory=list)  # variant names left out (e.g. duplicates of another group)


@dataclass
class GridSpec:
    base: str
    groups: dict  # group name -> GroupSpec
    axes: dict = field(default_factory=dict)  # axis -> value name -> overrides
    ds_config: str = ""  # DeepSpeed JSON for every run (relative to the grid file); "": ds_configs/zero3.json
    global_batch: int = 0  # 0: keep each experiment's train.grad_accum
    resources: Resources = field(default_factory=Resources)
    switch_before_decay: bool = False
    smoke: SmokeSpec = field(default_factory=SmokeSpec)


@dataclass(frozen=True)
class Variant:
    name: str
    group: str
    values: dict  # axis -> value name
    experiment: ExperimentConfig
    resources: Resources
    ds_config: str  # the DeepSpeed JSON it trains with (absolute)
    after: tuple[str, ...] = ()  # variants whose output this one reads (run first)


@dataclass
class Grid:
    path: str
    spec: GridSpec
    base: dict
    groups: dict[str, GroupSpec]

    def ds_config(self, smoke: bool = False) -> str:
        """The runs' DeepSpeed JSON (the twins' own where smoke.ds_config names one)."""
        path = (smoke and self.spec.smoke.ds_config) or self.spec.ds_config
        if not path:
            return os.path.join(REPO, "ds_configs", "zero3.json")
        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(self.path)), path))

    def variants(self, smoke: bool = False, out: str = "runs", overrides: dict | None = None,
                 resources: Resources | None = None) -> list[Variant]:
        """Every variant (or its smoke twin) as a validated experiment with run_dir ``out/NAME``; ``overrides``
        (dotted key -> value, e.g. data paths) are applied last; ``resources`` replace the grid's (grad_accum
        follows, so the global batch stays)."""
        combos = self._combinations()
        built: dict[str, Variant] = {}
        for name, (group, values, data) in combos.items():
            variant = self._materialise(name, group, values, data, combos, smoke, out, overrides or {}, resources)
            built[variant.name] = variant
        for variant in built.values():
            self._check_start(variant, built)
        return list(built.values())

    def _error(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.path}: {msg}")

    def _combinations(self) -> dict[str, tuple[str, dict, dict]]:
        """name -> (group, axis values, experiment dict before twin changes), in file order."""
        out: dict[str, tuple[str, dict, dict]] = {}
        for gname, group in self.groups.items():
            picks = []
            for axis, names in group.axes.items():
                if axis not in self.spec.axes:
                    raise self._error(f"groups.{gname}.axes: unknown axis {axis!r}; axes: {list(self.spec.axes)}")
                if not isinstance(names, list) or not names:
                    raise self._error(f"groups.{gname}.axes.{axis}: expected a non-empty list of value names")
                for v in names:
                    if v not in self.spec.axes[axis]:
                        raise self._error(f"groups.{gname}.axes.{axis}: unknown value {v!r}; values of {axis}: "
                                          f"{list(self.spec.axes[axis])}")
                picks.append([(axis, v) for v in names])
            produced = []
            for combo in itertools.product(*picks):
                name = "-".join([group.prefix or gname, *(str(v) for _, v in combo)])
                produced.append(name)
                if name in group.exclude:
                    continue
                if name in out:
                    raise self._error(f"groups.{gname}: variant {name!r} is also made by group {out[name][0]!r}; "
                                      "give one of the groups another prefix")
                data = copy.deepcopy(self.base)
                for overrides in (group.set, *(self.spec.axes[a][v] for a, v in combo)):
                    for key, value in overrides.items():
                        set_path(data, key, copy.deepcopy(value))
                out[name] = (gname, dict(combo), data)
            unknown = [n for n in group.exclude if n not in produced]
            if unknown:
                raise self._error(f"groups.{gname}.exclude: {unknown} name no variant of this group; its variants: "
                                  f"{produced}")
        return out

    def _materialise(self, name: str, group: str, values: dict, data: dict, combos: dict, smoke: bool, out: str,
                     overrides: dict, resources: Resources | None) -> Variant:
        full = to_dict(self._experiment(name, {**data, "name": name}))  # paper scale, validated even for a twin
        suffix = SMOKE_SUFFIX if smoke else ""
        if smoke:
            full = self._twin_dict(name, full)
        refs = sorted({r for s in _strings(full) for r in RUN_REF.findall(s)})
        for ref in refs:
            if ref not in combos:
                raise self._error(f"{name}: ${{run:{ref}}} names no variant of this grid; variants: {list(combos)}")
        full["name"], full["run_dir"] = name + suffix, os.path.join(out, name + suffix)
        for key, value in overrides.items():
            set_path(full, key, copy.deepcopy(value))
        exp = self._experiment(name + suffix, _map_strings(
            full, lambda s: RUN_REF.sub(lambda m: os.path.join(out, m.group(1) + suffix), s)))
        resources = resources or (self.spec.smoke.resources if smoke else self.spec.resources)
        global_batch = self.spec.smoke.global_batch if smoke else self.spec.global_batch
        if global_batch:
            per_step = exp.train.micro_batch * resources.world_size
            if global_batch % per_step:
                raise self._error(f"{exp.name}: global_batch {global_batch} is not a multiple of train.micro_batch "
                                  f"{exp.train.micro_batch} x {resources.world_size} ranks ({resources.nodes} nodes "
                                  f"x {resources.gpus_per_node}); change the resources or train.micro_batch")
            exp.train.grad_accum = global_batch // per_step
        return Variant(exp.name, group, values, exp, resources, self.ds_config(smoke),
                       tuple(r + suffix for r in refs))

    def _experiment(self, name: str, data: dict) -> ExperimentConfig:
        try:
            exp = from_dict(ExperimentConfig, data)
        except ConfigError as e:
            raise self._error(f"{name}: {e}") from e
        starts = [*exp.phase_starts(), exp.train.steps]
        for phase, start, end in zip(exp.phases, starts, starts[1:]):
            if end <= start:
                raise self._error(f"{name}: phase {phase.name!r} gets no step of train.steps {exp.train.steps} "
                                  f"(share {phase.share}); raise its share or the steps")
        if self.spec.switch_before_decay:
            self._check_switch(exp)
        return exp

    def _twin_dict(self, name: str, data: dict) -> dict:
        smoke = self.spec.smoke
        data = copy.deepcopy(data)
        steps = data["train"]["steps"]
        if steps % smoke.step_divisor:
            raise self._error(f"{name}: train.steps {steps} is not a multiple of smoke.step_divisor "
                              f"{smoke.step_divisor}, so its twin would not keep the phase shares")
        for key in STEP_KEYS:
            section, leaf = key.split(".")
            value = data[section][leaf]
            if value:
                data[section][leaf] = max(1, value // smoke.step_divisor)
        data["train"]["steps"] = steps // smoke.step_divisor
        for key in ("init", "shape"):
            if data["model"][key] in PRESETS:
                data["model"][key] = smoke.preset
        for key, value in smoke.set.items():
            set_path(data, key, copy.deepcopy(value))
        return data

    def _check_switch(self, exp: ExperimentConfig) -> None:
        if exp.optim.schedule != "wsd":
            return
        decay_start = exp.train.steps - exp.optim.decay(exp.train.steps)
        for start, phase in zip(exp.phase_starts()[1:], exp.phases[1:]):
            if start > decay_start:
                raise self._error(f"{exp.name}: phase {phase.name!r} starts at step {start}, inside the learning-rate "
                                  f"decay (steps {decay_start}-{exp.train.steps}); the switch must come before the "
                                  "decay: lower the earlier phases' share or optim.decay_steps")

    def _check_start(self, variant: Variant, built: dict[str, Variant]) -> None:
        """A run that continues another one (model.shape set) must name a start run of that shape."""
        shape = variant.experiment.model.shape
        for ref in variant.after:
            start = built[ref].experiment.model.init
            if shape and start in PRESETS and start != shape:
                raise self._error(f"{variant.name}: continues {ref}, a {start} model, but its model.shape is {shape!r}")


def load_grid(path: str) -> Grid:
    raw = load_yaml(path)
    try:
        spec = from_dict(GridSpec, raw)
        groups = {name: from_dict(GroupSpec, g if isinstance(g, dict) else {}, f"groups.{name}")
                  for name, g in spec.groups.items()}
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    for axis, values in spec.axes.items():
        if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
            raise ConfigError(f"{path}: axes.{axis}: expected value name -> {{dotted key: value}} mappings")
    base_path = os.path.join(os.path.dirname(path), spec.base)
    return Grid(path=path, spec=spec, base=load_experiment_file(base_path), groups=groups)


def _strings(obj) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def _map_strings(obj, fn):
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_strings(v, fn) for v in obj]
    return obj
