"""The evaluation results of an exported step as the Hub's ``model-index`` (huggingface_hub's ``EvalResult``s),
so the model page shows them: the results files ``launch/evaluate.py`` wrote for that step of the run
(``RUN/eval/*.json``, ``RUN/eval/stepN/*.json``) whose model was read as the export's record says, and what the
training-time evaluators scored at that step (``RUN/eval/training/stepN.json``: ``hf-best``'s card carries the
best step's scores without an evaluation). An offline export puts them in its card; ``launch/evaluate.py`` puts them
in the card of the export it evaluated. How each task is listed is its spec's (:class:`pipeline.tasks.HubTask`); a
results file is read as the JSON ``pipeline.eval.results.EvalResults`` writes, since evaluation stands above the
export."""

from __future__ import annotations

import os

from huggingface_hub import EvalResult, ModelCard

from pipeline.io import read_json
from pipeline.run_dir import RunDir
from pipeline.tasks import SPECS


def eval_results(results: dict) -> list[EvalResult]:
    """One ``EvalResult`` per task, dataset and metric of a results file's JSON ``results``."""
    return [r for task, result in results["results"].items()
            for r in task_results(task, result, results["options"].get(task, {}).get("split"))]


def task_results(task: str, result: dict, split: str | None) -> list[EvalResult]:
    """One ``EvalResult`` per dataset and metric of one task's ``result`` (as a results file holds it), as its spec
    lists them; none for a task no spec describes."""
    spec = SPECS.get(task)
    if spec is None:
        return []
    return [EvalResult(task_type=spec.hub.task_type, task_name=spec.hub.task_name,
                       dataset_type=os.path.basename(dataset),
                       dataset_name=os.path.basename(dataset),  # a dataset named by a path: never the machine's
                       dataset_split=split, metric_type=metric, metric_value=float(value))
            for dataset, metric, value in spec.model_index(result)]


def training_results(run: RunDir, step: int, attention: str) -> list[EvalResult]:
    """What ``eval.evaluators`` scored at step ``step`` during training, read with ``attention``: the same numbers
    ``launch/evaluate.py --step`` gives (``pipeline.train.evaluators``); none where the step was not validated."""
    path = run.training_eval_results(step)
    if not os.path.isfile(path):
        return []
    record = read_json(path, "written by the training-time evaluators (eval.evaluators)")
    if record["attention"] != attention:
        return []
    return [r for t in record["tasks"] for r in task_results(t["task"], t["result"], t["split"])]


def results_at(run: RunDir, step: int, attention: str) -> list[EvalResult]:
    """The results of ``run``'s evaluations of step ``step`` read with ``attention`` (the export's) and its default
    dims (no ``--dim``: a cut embedding scores another model), the training-time evaluators' of the step first; for
    one task, dataset and metric in several files, the newest file's."""
    by_key = {(*r.unique_identifier, r.metric_type): r for r in training_results(run, step, attention)}
    for path in sorted([*run.all_eval_results(), *run.step_eval_results()], key=os.path.getmtime):
        results = read_json(path, "results of launch/evaluate.py")
        model = results["model"]
        if model["step"] != step or model["attention"] != attention or results["config"].get("dim") is not None:
            continue
        for r in eval_results(results):
            by_key[(*r.unique_identifier, r.metric_type)] = r
    return list(by_key.values())


def refresh_card(run: RunDir, hf_dir: str, step: int, attention: str) -> int:
    """Rewrite the ``model-index`` of ``hf_dir``'s card (the export of ``run``'s step ``step`` that an evaluation
    read) from the run's evaluations of that step; returns how many results it holds (0: no card)."""
    from pipeline.export.card import model_name  # the card module imports this one

    path = os.path.join(hf_dir, "README.md")
    if not os.path.isfile(path):
        return 0
    card, results = ModelCard.load(path), results_at(run, step, attention)
    card.data.eval_results = results or None
    card.data.model_name = model_name(run.experiment()) if results else None
    card.save(path)
    return len(results)
