"""The results page of `make reproduce`: per study a table of measured numbers beside the papers', and a verdict
per claim from the measured means and their seed spread (max - min over seeds).

A claim "A beats B" is *reproduced* when mean(A) - mean(B) exceeds the larger seed spread of the two, *not
reproduced* when it is below minus that spread, *inconclusive* in between. With one run per variant (the LLM2Vec and
MAGNET studies adapt one pretrained model once) the spread is 0 and the verdict says "one run". Where the paper that
makes a claim reports both sides (LLM2Vec against Echo: ``PAPER_CLAIMS``), a column gives its two numbers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from statistics import mean

from pipeline.eval.report.papers import LLM2VEC_MTEB, LLM2VEC_MTEB_CATEGORIES, LLM2VEC_MTEB_CITATION
from pipeline.reproduce.curves import Curve, over_steps
from pipeline.reproduce.studies import STUDIES, Study


@dataclass(frozen=True)
class Measured:
    values: tuple[float, ...]  # one per seed

    @property
    def mean(self) -> float:
        return mean(self.values)

    @property
    def spread(self) -> float:
        return max(self.values) - min(self.values)

    def cell(self) -> str:
        digits = 4 if abs(self.mean) < 1 else 2
        text = f"{self.mean:.{digits}f}"
        return text + (f" ± {self.spread / 2:.{digits}f} (n={len(self.values)})" if len(self.values) > 1 else "")


def compare(a: Measured | None, b: Measured | None, lower_is_better: bool = False) -> tuple[str, str]:
    """(verdict, evidence) for "a is better than b"."""
    if a is None or b is None:
        return "inconclusive", "not measured"
    diff = (b.mean - a.mean) if lower_is_better else (a.mean - b.mean)
    spread = max(a.spread, b.spread)
    runs = "one run each" if spread == 0 and len(a.values) == len(b.values) == 1 else f"seed spread {spread:.4g}"
    verdict = "reproduced" if diff > spread else "not reproduced" if diff < -spread else "inconclusive"
    return verdict, f"{a.mean:.4g} vs {b.mean:.4g} ({runs})"


_SIMCSE_ECHO = "MNTP + SimCSE > Echo (causal, the text twice, untrained)"
_ECHO1 = "Echo: causal, the text twice (untrained)"  # study 1's row
CLAIMS = {  # study -> (claim, better row, worse row, headline key, lower is better)
    "llm2vec": (("MNTP + SimCSE > causal mean pooling on STS-B", "bidirectional + MNTP + SimCSE",
                 "causal, mean pooling (untrained)", "sts/stsb", False),
                ("causal > bidirectional without training on STS-B", "causal, mean pooling (untrained)",
                 "bidirectional, untrained", "sts/stsb", False),
                ("MNTP + SimCSE > causal mean pooling on Clough (text reuse)", "bidirectional + MNTP + SimCSE",
                 "causal, mean pooling (untrained)", "sts/clough", False),
                ("causal > bidirectional without training on Clough (text reuse)",
                 "causal, mean pooling (untrained)", "bidirectional, untrained", "sts/clough", False),
                ("supervised > MNTP on retrieval (held-out plays, both tasks)", "bidirectional + MNTP + supervised",
                 "bidirectional + MNTP", "zs_ndcg_avg", False),
                ("supervised > MNTP + SimCSE on retrieval (held-out plays, both tasks)",
                 "bidirectional + MNTP + supervised", "bidirectional + MNTP + SimCSE", "zs_ndcg_avg", False),
                ("supervised > MNTP on STS-B (out of domain)", "bidirectional + MNTP + supervised",
                 "bidirectional + MNTP", "sts/stsb", False),
                ("causal > bidirectional without training on word probing (WSJ POS)",
                 "causal, mean pooling (untrained)", "bidirectional, untrained", "probe_pos", False),
                ("MNTP recovers word probing: bidirectional + MNTP > bidirectional untrained (WSJ POS)",
                 "bidirectional + MNTP", "bidirectional, untrained", "probe_pos", False),
                (_SIMCSE_ECHO + " on STS-B", "bidirectional + MNTP + SimCSE", _ECHO1, "sts/stsb", False),
                (_SIMCSE_ECHO + " on Clough (text reuse)", "bidirectional + MNTP + SimCSE", _ECHO1, "sts/clough",
                 False),
                (_SIMCSE_ECHO + " on clustering (Clough topics)", "bidirectional + MNTP + SimCSE", _ECHO1,
                 "clustering_avg", False),
                (_SIMCSE_ECHO + " on retrieval (held-out plays, both tasks)", "bidirectional + MNTP + SimCSE",
                 _ECHO1, "zs_ndcg_avg", False),
                ("Echo > causal mean pooling without training on STS-B", _ECHO1, "causal, mean pooling (untrained)",
                 "sts/stsb", False)),
    "mlm_vs_clm": (("CLM 50 % -> MLM 40 % >= MLM 40 % at equal budget (sentiment)", "CLM 50 % -> MLM 40 %",
                    "MLM 40 %", "sc_acc", False),
                   ("CLM 50 % -> MLM 40 % >= MLM 40 % at equal budget (POS)", "CLM 50 % -> MLM 40 %", "MLM 40 %",
                    "tc_f1", False),
                   ("CLM then MLM continued >= MLM 40 % at equal budget (sentiment)",
                    "CLM (half) then MLM 40 % continued", "MLM 40 %", "sc_acc", False),
                   ("CLM then MLM continued >= MLM 40 % at equal budget (POS)", "CLM (half) then MLM 40 % continued",
                    "MLM 40 %", "tc_f1", False),
                   ("CLM converges faster early: CLM > MLM 40 % after a short budget (sentiment)", "CLM", "MLM 40 %",
                    "sc_acc", False),
                   ("CLM converges faster early: CLM > MLM 40 % after a short budget (POS)", "CLM", "MLM 40 %",
                    "tc_f1", False)),
    "magnet": (("MAGNET repeats less than LLM2Vec (Rep-4)", "MAGNET", "LLM2Vec MNTP + SimCSE", "rep_4/wiki", True),
               ("MAGNET repeats less than LLM2Vec (Rep-Sen)", "MAGNET", "LLM2Vec MNTP + SimCSE", "rep_sen/wiki", True),
               ("MAGNET keeps left-to-right generation: causal span perplexity below LLM2Vec's", "MAGNET",
                "LLM2Vec MNTP + SimCSE", "infill_ppl_causal/wiki", True),
               ("MAGNET gains as an encoder: STS-B above the untrained model", "MAGNET", "SmolLM2 (untrained)",
                "sts/stsb", False),
               ("MAGNET gains as an encoder: Clough (text reuse) above the untrained model", "MAGNET",
                "SmolLM2 (untrained)", "sts/clough", False),
               ("MAGNET infills better than the untrained model (span perplexity, MAGNET attention)", "MAGNET",
                "SmolLM2 (untrained)",
                "infill_ppl_magnet/wiki", True),
               ("MAGNET > Echo as an encoder on STS-B", "MAGNET", "Echo (untrained)", "sts/stsb", False),
               ("MAGNET > Echo as an encoder on clustering (Clough topics)", "MAGNET", "Echo (untrained)",
                "clustering_avg", False)),
}
# A claim's numbers in the paper that makes it: (category of LLM2VEC_MTEB, its better row, its worse row). The
# paper's categories average MTEB's sets, not ours; its causal row pools by weighted mean, ours by mean.
PAPER_CLAIMS = {
    **{f"{_SIMCSE_ECHO} on {task}": (category, "llm2vec", "echo")
       for task, category in (("STS-B", "sts"), ("Clough (text reuse)", "sts"),
                              ("clustering (Clough topics)", "clustering"),
                              ("retrieval (held-out plays, both tasks)", "retrieval"))},
    "Echo > causal mean pooling without training on STS-B": ("sts", "echo", "uni"),
}


def measured(headlines: dict[str, list[dict]], run: str, key: str) -> Measured | None:
    values = tuple(h[key] for h in headlines.get(run, []) if key in h)
    return Measured(values) if values else None


def study_markdown(study: Study, headlines: dict[str, list[dict]], plots: list[str], mode: str,
                   curves: dict[str, Curve] | None = None, runs_of: dict[str, list[str]] | None = None) -> str:
    """``headlines``: row run name -> one headline dict per seed; ``curves``: row run name -> its numbers over the
    chain's steps (``pipeline.reproduce.curves``), which add each claim's verdict at every evaluated budget;
    ``runs_of``: row run name -> the runs of its seeds, named under the table where a row has several."""
    runs, curves = dict(study.rows), curves or {}
    head = "| variant | " + " | ".join(h for h, _ in study.columns) + " |"
    lines = [head, "|" + "---|" * (len(study.columns) + 1)]
    # a baseline read on some of the study's tasks (Echo: the embedding tasks) has no number in the others' columns
    some = {b.name for b in study.baselines if b.tasks(study.tasks) != study.tasks}
    for label, run in study.rows:
        absent = "—" if run in some and headlines.get(run) else "not run"
        cells = [(m.cell() if (m := measured(headlines, run, k)) else absent) for _, k in study.columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if label in study.paper:
            ref = study.paper[label]
            lines.append(f"| ↳ paper ({study.paper_model}) | " + " | ".join(
                f"{ref[k]:.4g}" if k in ref else "—" for _, k in study.columns) + " |")
    # the claims whose rows the scale has (gpu-short: no CPT chain)
    claims = [c for c in CLAIMS[study.name] if c[1] in runs and c[2] in runs]
    cited = any(c[0] in PAPER_CLAIMS for c in claims)
    paper = " | paper (Llama-2-7B)" if cited else ""
    steps = " | over steps (the chain's steps)" if curves else ""
    lines += ["", f"| claim | verdict | measured{paper}{steps} |", "|---|---|---|" + "---|" * (cited + bool(curves))]
    for claim, better, worse, key, lower in claims:
        verdict, evidence = compare(measured(headlines, runs[better], key), measured(headlines, runs[worse], key),
                                    lower)
        reference = f" | {_paper_cell(claim)}" if cited else ""
        budgets = ""
        if curves:
            a, b = (_curve(runs[row], curves, headlines, curves.get(runs[other], {})) for row, other in
                    ((better, worse), (worse, better)))
            budgets = f" | {over_steps(a, b, key, lower)}"
        lines.append(f"| {claim} | **{verdict}** | {evidence}{reference}{budgets} |")
    if cited:
        lines += ["", f"The paper column: {LLM2VEC_MTEB_CITATION}, its LLaMA-2-7B rows (LLM2Vec, Echo, and \"Uni + w. "
                      "Mean\": causal, weighted mean pooling), averaged over MTEB's sets of a category, not ours."]
    if seeds := seeds_note(study, runs_of or {}):
        lines += ["", seeds]
    lines.append("")
    lines += [f"![{os.path.splitext(os.path.basename(p))[0]}]({p})" for p in plots]
    return "\n".join([f"*{mode} run, generated by launch/reproduce.py*", "", *lines, ""])


def seeds_note(study: Study, runs_of: dict[str, list[str]]) -> str:
    """The runs behind each row of several seeds, those that only `--seeds` (make reproduce-seeds) trains marked;
    "" when no row has several."""
    several = [(label, runs_of[row]) for label, row in study.rows if len(runs_of.get(row, ())) > 1]
    if not several:
        return ""

    def name(run: str) -> str:
        return run + ("*" if any(s.is_extra_seed(run) for s in STUDIES) else "")

    return ("Seeds (the runs behind a row's mean and spread; * trained by `--seeds`, `make reproduce-seeds`): "
            + "; ".join(f"{label}: {', '.join(map(name, runs))}" for label, runs in several) + ".")


def _paper_cell(claim: str) -> str:
    """The paper's two numbers for a claim and the category they average ("—" for a claim it does not make)."""
    if claim not in PAPER_CLAIMS:
        return "—"
    category, better, worse = PAPER_CLAIMS[claim]
    return (f"{LLM2VEC_MTEB[better][category]:.2f} vs {LLM2VEC_MTEB[worse][category]:.2f} "
            f"({LLM2VEC_MTEB_CATEGORIES[category]})")


def _curve(run: str, curves: dict[str, Curve], headlines: dict[str, list[dict]], other: Curve) -> Curve:
    """A run's curve; an untrained model (no curve, one headline) holds at every step of the other side's."""
    if run in curves:
        return curves[run]
    found = headlines.get(run, [])
    return {x: found[0] for x in other} if len(found) == 1 else {}


VERDICTS = ("reproduced", "not reproduced", "inconclusive")
SUMMARY = "summary"  # the block, beside the studies' of a mode, that counts their verdicts
_CLAIM_LINE = re.compile(r"^\| (?P<claim>[^|]+?) \| \*\*(?P<verdict>[a-z ]+)\*\* \| (?P<measured>[^|]+?) \|", re.M)


def summary_markdown(page: str, mode: str) -> str:
    """The verdicts of the mode's study blocks on ``page`` (their claim tables, as :func:`study_markdown` wrote
    them), counted and listed per study with what each measured: the page's summary, made from the blocks alone."""
    table, counts = [], dict.fromkeys(VERDICTS, 0)
    for study in STUDIES:
        found = {v: [] for v in VERDICTS}
        for line in _CLAIM_LINE.finditer(block(page, mode, study.name)):
            found[line["verdict"]].append(f"{line['claim']}: {line['measured']}")
            counts[line["verdict"]] += 1
        if any(found.values()):
            table.append(f"| {study.name} | " + " | ".join("; ".join(found[v]) or "—" for v in VERDICTS) + " |")
    total = sum(counts.values())
    return "\n".join([f"*{mode} run, generated by launch/reproduce.py from the study blocks below*", "",
                      f"Of the {total} claims checked: {counts['reproduced']} *reproduced*, "
                      f"{counts['not reproduced']} *not reproduced*, {counts['inconclusive']} *inconclusive*.", "",
                      "| study | " + " | ".join(VERDICTS) + " |", "|---|---|---|---|", *table, ""])


def block(page: str, mode: str, name: str) -> str:
    """The text of the page's ``mode`` ``name`` block ("" without one)."""
    found = re.search(re.escape(f"<!-- BEGIN {mode} {name} -->") + "(.*?)" + re.escape(f"<!-- END {mode} {name} -->"),
                      page, re.S)
    return found[1] if found else ""


def replace_block(page: str, mode: str, study: str, body: str, path: str) -> str:
    begin, end = f"<!-- BEGIN {mode} {study} -->", f"<!-- END {mode} {study} -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(page):
        raise ValueError(f"{path}: no '{begin}' ... '{end}' block; restore it where the {study} study's {mode} "
                         "results go")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", page)
