"""Evaluators during training (``eval.evaluators``), as sentence-transformers' ``evaluator=``: tasks of
``launch/evaluate.py`` (STS, zero-shot retrieval, clustering, infilling, repetition) run on the model being trained
at every validation, beside the loss probes, and logged to every tracker as ``eval/<headline key>``.

Each task runs through the evaluation code itself (:data:`pipeline.eval.registry.TASKS`) on an
:class:`~pipeline.eval.load.EvalModel` that wraps the engine's model with the run's record (the attention, pooling
and layout its export records) and ``launch/evaluate.py``'s defaults (seed, batch sizes), so a score equals that
command's on the step's checkpoint (``--step N``). Every rank runs every task: ``encode()`` splits its batches over
the ranks and keeps them in step under ZeRO-3 (:func:`pipeline.eval.ranks.lockstep`), the generation tasks run the
same forwards on every rank, and every rank gets the same scores. The RNG state of training is put back after, so
evaluating does not change what the run trains on.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.eval.data import dataset_name
from pipeline.eval.encode import MAX_TOKENS
from pipeline.eval.load import EvalModel
from pipeline.eval.registry import TASKS
from pipeline.eval.task import EvalContext
from pipeline.experiment import EvaluatorConfig
from pipeline.export.record import EncoderRecord
from pipeline.io import write_json_atomic
from pipeline.run_dir import RunDir
from pipeline.tasks import SPECS
from pipeline.tokenizer import Tokenizer

BATCH_SIZE, SEED = 16, 0  # launch/evaluate.py's --batch-size and --seed defaults
# tasks whose headline leaves a score out when nothing was scored: repetition's Rep-Sen and Rep-4 of a dataset whose
# continuations are all too short (pipeline.tasks.repetition_headline)
LEAVES_OUT = frozenset({"repetition"})


class _AnyResult(dict):
    """A task's result in which every key holds more of the same: its headline's keys, without running the task."""

    def __missing__(self, key):
        return _AnyResult()


def logged(configs: list[EvaluatorConfig]) -> tuple[set[str], set[str]]:
    """The ``eval/`` scalars :meth:`TrainingEvaluators.run` logs: (at every validation, only at those that had
    something to score: :data:`LEAVES_OUT`'s), named by each task's own headline over its datasets' names."""
    always, sometimes = set(), set()
    for config in configs:
        result = _AnyResult(datasets={dataset_name(d): _AnyResult() for d in config.datasets})
        names = {f"eval/{k}" for k in SPECS[config.task].headline(result)}
        (sometimes if config.task in LEAVES_OUT else always).update(names)
    return always, sometimes


@dataclass(frozen=True)
class EvaluatorTask:
    """One entry of ``eval.evaluators`` as preflight parsed it: the task and its typed options."""

    task: str
    options: Any


def evaluator_tasks(configs: list[EvaluatorConfig]) -> tuple[EvaluatorTask, ...]:
    return tuple(EvaluatorTask(c.task, c.task_options(f"eval.evaluators[{i}]")) for i, c in enumerate(configs))


@dataclass
class TrainingEvaluators:
    tasks: tuple[EvaluatorTask, ...]
    tokenizer: Tokenizer
    record: EncoderRecord  # how the run's export reads the model (pipeline.export.record.from_experiment)
    run_dir: str

    @torch.no_grad()
    def run(self, engine, lm: torch.nn.Module, step: int, device: torch.device) -> dict[str, float]:
        """Collective: every rank calls it at the same step. The tasks' headline scores as ``eval/<key>`` and
        ``eval/evaluators_seconds``; dropout is off while they run and the engine is back in train mode after. Rank 0
        keeps the tasks' whole results (:meth:`RunDir.training_eval_results`) for the model-index of the step's card,
        should it become ``hf-best``."""
        started = time.time()
        model = EvalModel(lm=lm, tokenizer=self.tokenizer, hf_dir="", run_dir=self.run_dir, step=step,
                          record=self.record, attention=self.record.attention)
        ctx = EvalContext(model, "", BATCH_SIZE, progress=False, seed=SEED, max_tokens=MAX_TOKENS)
        scalars: dict[str, float] = {}
        tasks = []  # each task's result as launch/evaluate.py's results file holds it, with its split
        engine.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                for entry in self.tasks:
                    torch.manual_seed(SEED)  # as launch/evaluate.py seeds each task
                    task = TASKS[entry.task]
                    result = task.run(ctx, entry.options)
                    scalars |= {f"eval/{k}": float(v) for k, v in task.spec.headline(result).items()}
                    tasks.append({"task": entry.task, "split": getattr(entry.options, "split", None),
                                  "result": result})
        finally:
            engine.train()
        if not dist.is_initialized() or dist.get_rank() == 0:
            path = RunDir(self.run_dir).training_eval_results(step)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_json_atomic(path, {"step": step, "attention": self.record.attention, "tasks": tasks})
        return scalars | {"eval/evaluators_seconds": time.time() - started}
