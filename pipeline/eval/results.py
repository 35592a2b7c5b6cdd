"""One evaluation's results, as ``launch/evaluate.py`` writes them (``RUN_DIR/eval/*.json``) and the report, the
curves and ``make reproduce`` read them: what ran (config, model, options per task), what came out (results and
headline numbers per task, failed tasks, seconds per task) and on what (environment), plus the tasks copied from
another results file of the same model (``reused``, only when some were).

The JSON is the dataclass's fields as a mapping (``reused`` left out when empty), written with sorted keys, so a
file read and written again is the same bytes: the fields of the config and the model's record that an older
version wrote none of (``config.max_tokens``, ``config.step``, ``model.record.instruction_format``) are read as
their defaults and left out again (``unwritten``); those written only when set (``config.dim``, the record's
Matryoshka fields) are left out unset, so an evaluation without them writes what it wrote before they existed. Paths are relative to the results root
(:mod:`pipeline.eval.description`); files written before that may name absolute ones, read all the same."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace

from pipeline.eval.config import EvalConfig
from pipeline.eval.description import ModelDescription
from pipeline.export.record import WRITTEN_WHEN_SET, EncoderRecord
from pipeline.io import read_json, write_json_atomic
from pipeline.tasks import SPECS


@dataclass
class EvalResults:
    config: EvalConfig  # what ran, its paths relative to the results root
    model: ModelDescription  # EvalModel.describe()
    environment: dict  # python, torch, transformers, cpu, argv, lock (pipeline.constraints.lock_identity)
    options: dict[str, dict] = field(default_factory=dict)  # task -> its options
    results: dict[str, dict] = field(default_factory=dict)  # task -> its results
    headline: dict[str, float] = field(default_factory=dict)  # the few numbers the report shows, over all tasks
    failed: dict[str, dict] = field(default_factory=dict)  # task -> {"error", "where"}
    seconds: dict[str, float] = field(default_factory=dict)  # task -> wall seconds
    reused: dict[str, str] = field(default_factory=dict)  # task -> the results file (name) it was copied from
    # "config.KEY" / "model.record.KEY" an older version's file lacks: left out when written back
    unwritten: tuple[str, ...] = ()

    # the fields kept per task: what merge combines, the older file's under the newer one's
    PER_TASK = ("options", "results", "headline", "seconds", "reused")
    # the fields written as they are held
    MAPPINGS = ("environment", "options", "results", "headline", "failed", "seconds", "reused")

    def to_json(self) -> dict:
        config = {k: v for k, v in asdict(self.config).items() if v is not None or k not in EvalConfig.WRITTEN_WHEN_SET}
        data = {"config": config, "model": self.model.to_json(),
                **{key: getattr(self, key) for key in self.MAPPINGS}}
        if not self.reused:
            del data["reused"]
        for key in self.unwritten:
            *parents, name = key.split(".")
            where = data
            for parent in parents:
                where = where[parent]
            del where[name]
        return data

    @classmethod
    def from_json(cls, data: dict) -> EvalResults:
        config, model = data["config"], data["model"]
        unwritten = tuple([f"config.{f.name}" for f in fields(EvalConfig)
                           if f.name not in config and f.name not in EvalConfig.WRITTEN_WHEN_SET]
                          + [f"model.record.{f.name}" for f in fields(EncoderRecord)
                             if f.name not in model["record"] and f.name not in WRITTEN_WHEN_SET])
        return cls(EvalConfig(**config), ModelDescription.from_json(model),
                   **{key: data.get(key, {}) for key in cls.MAPPINGS}, unwritten=unwritten)

    @classmethod
    def read(cls, path: str) -> EvalResults:
        return cls.from_json(read_json(path, "results of launch/evaluate.py"))

    def write(self, out: str) -> bool:
        """Write to ``out`` when a task finished (atomically: a killed evaluation leaves no half file that a re-run
        would take as finished); returns whether it wrote."""
        if not self.results:
            return False
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_json_atomic(out, self.to_json())
        return True

    def failure_lines(self) -> list[str]:
        """One line per failed task."""
        return [f"task {name} failed: {why['error']} (raised at {why['where']})" for name, why in self.failed.items()]

    def with_task_of(self, other: EvalResults, task: str, results_file: str) -> None:
        """Take ``task`` from ``other`` (the results file ``results_file``, by name): its options, results and
        seconds, and the headline numbers its spec reads from those results."""
        self.options[task] = other.options[task]
        self.results[task] = other.results[task]
        self.seconds[task] = other.seconds[task]
        self.headline.update(SPECS[task].headline(other.results[task]))
        self.reused[task] = results_file

    def merge(self, older: EvalResults | None, order: list[str]) -> EvalResults:
        """These results over ``older``'s (same model; None: no older file): each per-task field holds both, this
        one's where both have a task; config, model, environment and failures are this one's, the config's tasks
        those with results in ``order``."""
        per_task = {key: {**(getattr(older, key) if older else {}), **getattr(self, key)} for key in self.PER_TASK}
        return replace(self, config=replace(self.config, tasks=[t for t in order if t in per_task["results"]]),
                       **per_task)
