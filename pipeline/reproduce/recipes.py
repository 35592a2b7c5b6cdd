"""Study 4 of docs/results.md (issue 52 item 7): where the embedding recipe's parts show at CPU scale, over three
seeds, from the LLM2Vec study's MNTP export (``experiments/reproduce/recipes/grid.yaml``):

(a) Matryoshka: SimCSE with and without it, STS-B read at 64, 128, 256 dims and the full 576;
(b) mining: the negatives ``data_prep/mine_negatives.py`` mines for the study's pairs with recipes-simcse-s0's export,
    with and without the filters, checked against the pair rules (``pipeline.data.prep.pairs_sample``: which document
    answers which query), and the supervised stage trained on mined against given negatives, read on retrieval;
(c) a linear merge of each seed's SimCSE and supervised exports (``launch/merge.py``), read on STS-B and retrieval.

``python launch/reproduce_recipes.py [--device auto|cuda|cpu] [--results DIR] [--page FILE]`` runs it into
runs/reproduce (beside the other studies' runs: llm2vec-mntp is theirs, trained only where missing), each step
skipped when its output exists (the sweep skips finished runs and resumes unfinished ones; mining, merges and
evaluations are each written whole), so the same command resumes. The records (each run's experiment, metrics and
results, the mining records) go to RESULTS/full/recipes, the stages' logs and seconds to its logs/ and
timings.json, and the study's block of the page is rewritten (``<!-- BEGIN full recipes -->``) with what exists so
far; it is not one of ``launch/reproduce.py``'s studies (its scales, seeds and summary are theirs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import defaultdict

import torch

from pipeline.data.format.index import MANIFEST
from pipeline.data.prep.pairs_sample import INSTRUCTIONS, task_rows
from pipeline.eval.config import EvalConfig
from pipeline.eval.results import EvalResults
from pipeline.eval.reuse import evaluate_missing, missing_tasks
from pipeline.export.merge import merge
from pipeline.io import REPO, read_json, repo_relative, write_json_atomic
from pipeline.mining.cli import main as mine
from pipeline.reproduce.data import RealDataError, _sample_texts
from pipeline.reproduce.driver import EVAL_THREADS, set_rank_defaults
from pipeline.reproduce.inputs import PAIR_SHARDS, REAL, prepare_inputs
from pipeline.reproduce.invocation import DEVICES, Reproduction, resolve_device
from pipeline.reproduce.records import step_seconds
from pipeline.reproduce.results import Measured, compare, replace_block
from pipeline.reproduce.stages import Stages
from pipeline.reproduce.studies import STUDIES
from pipeline.run_dir import RunDir
from pipeline.sweep.plan import SweepRequest, act, prepare

NAME = "recipes"
GRID = "experiments/reproduce/recipes/grid.yaml"
OUT = "runs/reproduce"  # the grid's shards and the LLM2Vec study's MNTP run are there
SEEDS = ("s0", "s1", "s2")
WIDTH = 576  # SmolLM2-135M's hidden size: the full embedding
DIMS = (64, 128, 256, WIDTH)
MINER = "recipes-simcse-s0"  # whose export mines
MINED_SHARDS = f"{OUT}/shards/smollm2-pairs-mined-64"  # what the grid's supervised-mined runs read
# the worked example's filters (docs/embedding-recipes.md): the 2 nearest skipped, NV-Retriever's 5 % margin; one
# negative a row, as the given pairs have
FILTERS = {"filtered": ["--range-min", "2", "--relative-margin", "0.05"], "unfiltered": []}
STSB = "sts/stsb"
STSB_ONLY = [f"sts.datasets=[{STSB}.jsonl]"]
RETRIEVAL = ("zs_ndcg/replies", "zs_ndcg/continuations", "zs_ndcg_avg")
PAIR_FILES = {f"{task}.jsonl" for task in INSTRUCTIONS}  # what runs/real/pairs holds
WITHIN = 2.0  # the Matryoshka claim's points


class RecipesRun(Reproduction):
    """The full scale's inputs (the LLM2Vec study's shards and SmolLM2), with this study's logs and seconds apart
    from ``launch/reproduce.py``'s."""

    @property
    def logs(self) -> str:
        return os.path.join(self.results, NAME, "logs")

    @property
    def ledger(self) -> str:
        return os.path.join(self.out, f"timings-{NAME}.json")


def runs(variant: str) -> list[str]:
    """The run directories of one arm (simcse, simcse-mrl, supervised-given, supervised-mined), seed by seed."""
    return [os.path.join(OUT, f"{NAME}-{variant}-{s}") for s in SEEDS]


def merges() -> list[str]:
    return [os.path.join(OUT, f"{NAME}-merge-{s}") for s in SEEDS]


def mined(variant: str) -> str:
    return os.path.join(OUT, f"mined-{variant}")


def results_file(model: str, dim: int = WIDTH) -> str:
    """Where the study's results of ``model`` at ``dim`` go: eval/recipes.json at full width, eval/recipes-dimN.json
    for a cut."""
    return RunDir(model).eval_results(NAME if dim == WIDTH else f"{NAME}-dim{dim}")


def evaluations() -> list[tuple[str, int, list[str], list[str]]]:
    """(model, dim, tasks, options) of every evaluation: STS-B at each width for the SimCSE arms; STS-B and
    retrieval at full width for the MNTP start, the supervised arms, plain SimCSE and the merges."""
    found = [(os.path.join(OUT, "llm2vec-mntp"), WIDTH, ["sts", "zero_shot_retrieval"], STSB_ONLY)]
    for path in runs("simcse") + runs("simcse-mrl"):
        found += [(path, d, ["sts"], STSB_ONLY) for d in DIMS]
    for path in runs("simcse") + runs("supervised-given") + runs("supervised-mined") + merges():
        found.append((path, WIDTH, ["sts", "zero_shot_retrieval"], STSB_ONLY))
    return found


def train(stages: Stages, only: list[str], what: str) -> None:
    request = SweepRequest(GRID, only=only, out=OUT, action="local")
    stages.run(f"train_{NAME}", f"{what}: the runs {', '.join(only)} of {GRID} into {OUT}",
               lambda: act(prepare(request)))


def mine_negatives(stages: Stages) -> None:
    """Each variant of mining (with and without the filters) of the given pairs with MINER's export; the filtered
    one's pair shards are what the supervised-mined runs read."""
    for variant, flags in FILTERS.items():
        shards = ["--shards", MINED_SHARDS] if variant == "filtered" else []
        argv = ["--input", PAIR_SHARDS, "--model", os.path.join(OUT, MINER, "hf"), "--output", mined(variant),
                "--num-negatives", "1", "--max-length", "64", "--no-progress", *flags, *shards]
        if not (mined_files(variant) >= PAIR_FILES and (not shards or os.path.isfile(os.path.join(MINED_SHARDS,
                                                                                               MANIFEST)))):
            stages.run(f"mine_{NAME}", f"{variant} mining: data_prep/mine_negatives.py {' '.join(argv)}",
                       lambda argv=argv: _checked(mine(argv), "mining"))


def mined_files(variant: str) -> set[str]:
    """The pairs files one mining has finished (its record names each when written whole)."""
    path = os.path.join(mined(variant), "mining.json")
    return set(read_json(path, what="mining record")["files"]) if os.path.isfile(path) else set()


def _checked(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} exited {rc}")


def merge_exports(stages: Stages) -> None:
    """Each seed's supervised (given) and SimCSE exports merged linearly, half each (the supervised one first:
    the merge keeps its instruction format)."""
    for seed, out in zip(SEEDS, merges()):
        if not os.path.isfile(os.path.join(out, "config.json")):
            models = [os.path.join(OUT, f"{NAME}-{variant}-{seed}", "hf") for variant in ("supervised-given", "simcse")]
            stages.run(f"merge_{NAME}", f"linear 0.5/0.5 merge of {' and '.join(models)} into {out}",
                       lambda models=models, out=out: merge("linear", models, out, [0.5, 0.5], progress=False))


def evaluate(stages: Stages, device: str) -> None:
    """Every evaluation whose model exists and whose results file lacks a task."""
    for model, dim, tasks, options in evaluations():
        out = results_file(model, dim)
        if not os.path.isfile(os.path.join(model, "config.json")) and not os.path.isdir(RunDir(model).hf):
            continue
        if not missing_tasks(out, tasks):
            continue
        config = EvalConfig(model=model, tasks=tasks, data_dir=REAL, overrides=options, device=device, batch_size=8,
                            progress=False, dim=None if dim == WIDTH else dim)
        stages.run(f"eval_{NAME}", f"{','.join(tasks)} at {dim} dims on {model} into {out}",
                   lambda config=config, out=out: evaluate_missing(config, out, [], OUT))


# ---- what the numbers say

def answers(documents: list[str]) -> dict[str, dict[str, set[str]]]:
    """Task -> query -> the documents that answer it by the pair rules over every row of ``documents`` (not just the
    study's first rows): a mined negative among them is a false negative."""
    found: dict[str, dict[str, set[str]]] = {}
    for task, rows in task_rows(documents, sys.maxsize).items():
        found[task] = defaultdict(set)
        for row in rows:
            found[task][row["query"]].add(row["positive"])
    return found


def false_negatives(directory: str, rules: dict[str, dict[str, set[str]]], given: str = os.path.join(REAL, "pairs")
                    ) -> dict[str, dict]:
    """Per mined file of ``directory``: its rows in and kept, its negatives, how many of them answer their query by
    the rules (false negatives), how many are the row's given negative (the file of that name in ``given``), and
    the candidates each filter dropped."""
    with open(os.path.join(directory, "mining.json")) as f:
        record = json.load(f)
    found = {}
    for name, counts in record["files"].items():
        task = os.path.splitext(name)[0]
        with open(os.path.join(given, name)) as f:
            ours = {(r["query"], r["positive"]): r["negative"] for r in map(json.loads, f)}
        with open(os.path.join(directory, name)) as f:
            rows = [json.loads(line) for line in f]
        negatives = [(r, n) for r in rows for n in r["negative"]]
        found[task] = {"rows": counts["rows"], "kept": counts["kept"], "negatives": len(negatives),
                       "false": sum(n in rules.get(task, {}).get(r["query"], ()) for r, n in negatives),
                       "given": sum(n == ours.get((r["query"], r["positive"])) for r, n in negatives),
                       "skipped": counts["skipped"]}
    return found


def mining_record() -> dict:
    """Both minings' counts (those that have run), with the rules' own multiplicity: how many queries have more
    than one answer."""
    rules = answers(_sample_texts("train"))
    record = {"rules": {t: {"queries": len(q), "with_several_answers": sum(len(a) > 1 for a in q.values())}
                        for t, q in rules.items()}}
    for variant in FILTERS:
        if os.path.isfile(os.path.join(mined(variant), "mining.json")):
            record[variant] = false_negatives(mined(variant), rules)
    return record


def headlines(paths: list[str], dim: int = WIDTH) -> list[dict]:
    return [EvalResults.read(f).headline for p in paths if os.path.isfile(f := results_file(p, dim))]


def measured(rows: list[dict], key: str) -> Measured | None:
    values = tuple(h[key] for h in rows if key in h)
    return Measured(values) if values else None


def drops(paths: list[str], dim: int) -> Measured | None:
    """STS-B at full width minus STS-B at ``dim``, per run that has both."""
    values = []
    for p in paths:
        full, cut = headlines([p]), headlines([p], dim)
        if full and cut and STSB in full[0] and STSB in cut[0]:
            values.append(full[0][STSB] - cut[0][STSB])
    return Measured(tuple(values)) if values else None


def both(first: tuple[str, str], second: tuple[str, str]) -> str:
    """The verdict of a claim made of two parts: reproduced when both are, not reproduced when either is not."""
    verdicts = (first[0], second[0])
    if "not reproduced" in verdicts:
        return "not reproduced"
    return "reproduced" if verdicts == ("reproduced", "reproduced") else "inconclusive"


def _cell(m: Measured | None) -> str:
    return m.cell() if m else "not run"


def _claim(claim: str, verdict: tuple[str, str]) -> str:
    return f"| {claim} | **{verdict[0]}** | {verdict[1]} |"


def matryoshka_section() -> list[str]:
    lines = ["| variant | " + " | ".join(f"STS-B at {d}" + (" (full)" if d == WIDTH else "") for d in DIMS)
             + " | drop 576 → 128 |", "|---|" + "---|" * (len(DIMS) + 1)]
    for label, variant in (("SimCSE", "simcse"), ("SimCSE + Matryoshka (576, 256, 128, 64)", "simcse-mrl")):
        lines.append(f"| {label} | " + " | ".join(_cell(measured(headlines(runs(variant), d), STSB)) for d in DIMS)
                     + f" | {_cell(drops(runs(variant), 128))} |")
    claims = matryoshka_claims(drops(runs("simcse-mrl"), 128), drops(runs("simcse"), 128))
    return [*lines, "", "| claim | verdict | measured |", "|---|---|---|", *(_claim(*c) for c in claims)]


def matryoshka_claims(with_mrl: Measured | None, without: Measured | None) -> list[tuple[str, tuple[str, str]]]:
    """The claim and its two parts, each (claim, (verdict, evidence)), from the seeds' STS-B drops from full width
    to 128 dims with and without Matryoshka."""
    within = compare(with_mrl, Measured((WITHIN,)), lower_is_better=True) if with_mrl else ("inconclusive",
                                                                                            "not measured")
    larger = compare(without, with_mrl)
    return [("Matryoshka keeps STS-B at 128 dims within 2 points of full, and without it the drop is larger",
             (both(within, larger), "both parts below")),
            ("↳ with Matryoshka, STS-B drops by less than 2 points from 576 to 128 dims (drop vs 2)", within),
            ("↳ without Matryoshka the drop is larger (drop without vs with)", larger)]


def mining_section(record: dict) -> list[str]:
    lines = ["| mining (recipes-simcse-s0's export, 1 negative a row) | task | rows kept | false negatives (the rules) "
             "| the row's given negative | candidates dropped by the margin |", "|---|---|---|---|---|---|"]
    for variant in FILTERS:
        for task, c in record.get(variant, {}).items():
            rate = c["false"] / c["negatives"] if c["negatives"] else 0.0
            lines.append(f"| {variant} ({' '.join(FILTERS[variant]) or 'no filter'}) | {task} | {c['kept']} of "
                         f"{c['rows']} | {c['false']} ({100 * rate:.1f} %) | {c['given']} | "
                         f"{c['skipped']['relative_margin']} |")
    if not any(variant in record for variant in FILTERS):
        lines.append("| not run | | | | | |")
    lines += ["", "By the rules over the whole train split, " + "; ".join(
        f"{c['with_several_answers']} of {c['queries']} {task} queries have more than one answer"
        for task, c in record["rules"].items()) + " (the miner never takes a query's own positives)."]
    table = ["", "| variant | STS-B | " + " | ".join(f"Retrieval {k.split('/')[-1].replace('zs_ndcg_avg', 'avg')} "
                                                      "(NDCG@10 x100)" for k in RETRIEVAL) + " |",
             "|---|" + "---|" * (1 + len(RETRIEVAL))]
    arms = (("bidirectional + MNTP (the start)", [os.path.join(OUT, "llm2vec-mntp")]),
            ("supervised, given negatives", runs("supervised-given")),
            ("supervised, mined negatives (filtered)", runs("supervised-mined")))
    for label, paths in arms:
        found = headlines(paths)
        table.append(f"| {label} | " + " | ".join(_cell(measured(found, k)) for k in (STSB, *RETRIEVAL)) + " |")
    claims = ["", "| claim | verdict | measured |", "|---|---|---|"]
    for key, name in (("zs_ndcg_avg", "both tasks"), *((k, k.split("/")[1]) for k in RETRIEVAL[:2])):
        claims.append(_claim(f"supervised on mined negatives > on given negatives on retrieval ({name})", compare(
            measured(headlines(runs("supervised-mined")), key), measured(headlines(runs("supervised-given")), key))))
    rates = {variant: Measured((sum(c["false"] for c in record[variant].values())
                             / max(1, sum(c["negatives"] for c in record[variant].values())),))
             for variant in FILTERS if variant in record}
    claims.append(_claim("the filters lower the false-negative rate of mined negatives (unfiltered vs filtered)",
                         compare(rates.get("unfiltered"), rates.get("filtered"))))
    return [*lines, *table, *claims]


def merge_section() -> list[str]:
    keys = (STSB, *RETRIEVAL)
    arms = (("SimCSE", runs("simcse")), ("supervised, given negatives", runs("supervised-given")),
            ("linear merge, 0.5 each", merges()))
    lines = ["| variant | STS-B | " + " | ".join(f"Retrieval {k.split('/')[-1].replace('zs_ndcg_avg', 'avg')}"
                                                for k in RETRIEVAL) + " |", "|---|" + "---|" * len(keys)]
    for label, paths in arms:
        found = headlines(paths)
        lines.append(f"| {label} | " + " | ".join(_cell(measured(found, k)) for k in keys) + " |")
    merged = headlines(merges())
    claims = ["", "| claim | verdict | measured |", "|---|---|---|"]
    for label, paths in arms[:2]:
        for key, task in ((STSB, "STS-B"), ("zs_ndcg_avg", "retrieval (both tasks)")):
            claims.append(_claim(f"the merge > {label} on {task}",
                                 compare(measured(merged, key), measured(headlines(paths), key))))
    return [*lines, *claims]


def markdown(record: dict, timings: dict) -> str:
    """The study's block: its three parts' tables and verdicts (the page's rule, ``results.compare``) and the
    seconds spent so far."""
    spent = timings.get("stages_s", {})
    cost = ", ".join(f"{stage} {s / 60:.1f} min" for stage, s in spent.items())
    steps = ", ".join(f"{run} {s} s" for run, s in timings.get("step_seconds_median", {}).items())
    return "\n".join(["*full run, generated by launch/reproduce_recipes.py*", "",
                      "**(a) Matryoshka** (STS-B Spearman x100, the whole test set; mean ± half the seed spread)", "",
                      *matryoshka_section(), "", "**(b) Mining**", "", *mining_section(record), "",
                      "**(c) Merging** (each seed's supervised and SimCSE exports)", "", *merge_section(), "",
                      f"Seconds so far (every invocation): {cost or 'none'}. Median seconds a step: {steps or 'none'}.",
                      ""])


def write_records(r: RecipesRun, stages: Stages, record: dict) -> dict:
    """RESULTS/full/recipes: each run's experiment, metrics and results files, the merges' results, the minings'
    records and counts, timings.json; returns the timings."""
    target = os.path.join(r.results, NAME)
    for model in sorted({m for m, *_ in evaluations()}):
        run = RunDir(model)
        for path in (run.experiment_json, run.metrics, *run.all_eval_results()):
            if os.path.isfile(path) and (os.path.basename(path) in ("experiment.json", "metrics.jsonl")
                                         or os.path.basename(path).startswith(NAME)):
                keep = os.path.join(target, "runs", os.path.relpath(path, OUT))
                os.makedirs(os.path.dirname(keep), exist_ok=True)
                shutil.copyfile(path, keep)
    os.makedirs(os.path.join(target, "mining"), exist_ok=True)
    for variant in FILTERS:
        if os.path.isfile(source := os.path.join(mined(variant), "mining.json")):
            kept = read_json(source, what="mining record")
            write_json_atomic(os.path.join(target, "mining", f"{variant}.json"), kept | {
                "model": repo_relative(kept["model"]),
                "model_read": kept["model_read"] | {"path": repo_relative(kept["model_read"]["path"])},
                "inputs": [i | {"path": repo_relative(i["path"])} for i in kept["inputs"]]})
    write_json_atomic(os.path.join(target, "mining", "false_negatives.json"), record)
    ours = {name: s for name, s in step_seconds(OUT).items() if name.startswith(NAME) or name == "llm2vec-mntp"}
    timings = {"stages_s": stages.spend({}), "step_seconds_median": ours}
    write_json_atomic(os.path.join(target, "timings.json"), timings)
    return timings


def write_block(page: str, body: str) -> None:
    with open(page) as f:
        text = f.read()
    with open(page, "w") as f:
        f.write(replace_block(text, "full", NAME, body, page))


def run(r: RecipesRun) -> None:
    """Every step in order from the repository root; each skipped when its output exists."""
    stages = Stages(r)
    os.chdir(REPO)
    prepare_inputs(r, stages)
    train(stages, ["llm2vec-mntp", f"{NAME}-simcse-*"], "MNTP (the LLM2Vec study's) and SimCSE with and without "
          "Matryoshka")
    mine_negatives(stages)
    train(stages, [f"{NAME}-supervised-*"], "the supervised stage on given and mined negatives")
    merge_exports(stages)
    evaluate(stages, r.device)
    record = mining_record()
    timings = write_records(r, stages, record)
    write_block(r.page, markdown(record, timings))
    print(f"wrote the {NAME} block of {r.page} and {os.path.join(r.results, NAME)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where runs train and tasks evaluate (auto: the GPU where torch sees one)")
    p.add_argument("--results", default="docs/results", help="records, logs and timings go to RESULTS/full/recipes")
    p.add_argument("--page", default="docs/results.md", help="the page whose full recipes block is rewritten")
    args = p.parse_args(argv)
    torch.set_num_threads(EVAL_THREADS)
    llm2vec = next(s for s in STUDIES if s.name == "llm2vec")  # whose inputs (SmolLM2, shards) this study reads
    try:
        r = RecipesRun("full", OUT, os.path.abspath(os.path.join(args.results, "full")), os.path.abspath(args.page),
                       resolve_device(args.device), (llm2vec,))
        set_rank_defaults(r.device)
        run(r)
    except (RealDataError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
