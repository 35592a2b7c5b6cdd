"""The evaluation results of an exported step as the Hub's ``model-index`` (huggingface_hub's ``EvalResult``s),
so the model page shows them: the results files ``launch/evaluate.py`` wrote for that step of the run
(``RUN/eval/*.json``, ``RUN/eval/stepN/*.json``) whose model was read as the export's record says, and what the
training-time evaluators scored at that step (``RUN/eval/training/stepN.json``: ``hf-best``'s card carries the
best step's scores without an evaluation). An offline export puts them in its card; ``launch/evaluate.py`` puts them
in the card of the export it evaluated."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from huggingface_hub import EvalResult, ModelCard

from pipeline.io import read_json
from pipeline.run_dir import RunDir

if TYPE_CHECKING:
    from pipeline.eval.results import EvalResults

# evaluation task -> (the Hub's task type, its pretty name): pipeline tags where one fits, MTEB's names elsewhere
HUB_TASKS = {"sts": ("sentence-similarity", "Semantic textual similarity"),
             "clustering": ("Clustering", "Clustering"),
             "zero_shot_retrieval": ("Retrieval", "Zero-shot retrieval"),
             "retrieval": ("Retrieval", "Fine-tuned retrieval"),
             "classification": ("text-classification", "Fine-tuned classification"),
             "token_classification": ("token-classification", "Fine-tuned token classification"),
             "qa": ("question-answering", "Fine-tuned extractive QA"),
             "probing": ("token-classification", "Linear probing"),
             "perplexity": ("text-generation", "Held-out perplexity"),
             "mlm": ("fill-mask", "Held-out MLM"),
             "mntp": ("fill-mask", "Held-out MNTP"),
             "infilling": ("text-generation", "Infilling"),
             "repetition": ("text-generation", "Repetition")}
# embedding tasks: the per-dataset score and its metric id (MTEB's)
EMBEDDING_METRICS = {"sts": ("spearman", "cos_sim_spearman"), "clustering": ("v_measure", "v_measure"),
                     "zero_shot_retrieval": ("ndcg", "ndcg_at_{k}")}
FINETUNED = ("classification", "token_classification", "qa", "retrieval")


def _scores(task: str, result: dict, headline: dict[str, float]) -> list[tuple[str, str, float]]:
    """(dataset, metric id, value) of one task's results: each dataset's score where the results name datasets,
    else the task's headline numbers ("metric/dataset" or "metric")."""
    if task in EMBEDDING_METRICS:
        key, metric = EMBEDDING_METRICS[task]
        return [(name, metric.format(k=r.get("k")), r[key]) for name, r in result["datasets"].items()]
    if task in FINETUNED:
        return [(name, r["metric"].replace("@", "_at_"), r["test"]["mean"]) for name, r in result["datasets"].items()]
    return [(key.split("/", 1)[1] if "/" in key else task, key.split("/", 1)[0], value)
            for key, value in headline.items()]


def eval_results(results: EvalResults) -> list[EvalResult]:
    """One ``EvalResult`` per task, dataset and metric of ``results``."""
    return [r for task, result in results.results.items()
            for r in task_results(task, result, results.options.get(task, {}).get("split"))]


def task_results(task: str, result: dict, split: str | None) -> list[EvalResult]:
    """One ``EvalResult`` per dataset and metric of one task's ``result`` (as a results file holds it)."""
    from pipeline.eval.registry import TASKS  # pipeline.eval imports the exports: not at import time

    task_type, task_name = HUB_TASKS.get(task, (task, task))
    headline = TASKS[task].spec.headline(result) if task in TASKS else {}
    return [EvalResult(task_type=task_type, task_name=task_name, dataset_type=os.path.basename(dataset),
                       dataset_name=os.path.basename(dataset),  # a dataset named by a path: never the machine's
                       dataset_split=split, metric_type=metric, metric_value=float(value))
            for dataset, metric, value in _scores(task, result, headline)]


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
    from pipeline.eval.results import EvalResults

    by_key = {(*r.unique_identifier, r.metric_type): r for r in training_results(run, step, attention)}
    for path in sorted([*run.all_eval_results(), *run.step_eval_results()], key=os.path.getmtime):
        results = EvalResults.read(path)
        if results.model.step != step or results.model.attention != attention or results.config.dim is not None:
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
