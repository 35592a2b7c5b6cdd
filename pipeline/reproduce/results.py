"""The results page of `make reproduce`: per study a table of measured numbers beside the papers', and a verdict
per claim from the measured means and their seed spread (max - min over seeds).

A claim "A beats B" is *reproduced* when mean(A) - mean(B) exceeds the larger seed spread of the two, *not
reproduced* when it is below minus that spread, *inconclusive* in between. With one run per variant (the LLM2Vec and
MAGNET studies adapt one pretrained model once) the spread is 0 and the verdict says "one run".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from statistics import mean

from pipeline.reproduce.curves import Curve, over_steps
from pipeline.reproduce.studies import Study


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
                 "bidirectional + MNTP", "bidirectional, untrained", "probe_pos", False)),
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
                "infill_ppl_magnet/wiki", True)),
}


def measured(headlines: dict[str, list[dict]], run: str, key: str) -> Measured | None:
    values = tuple(h[key] for h in headlines.get(run, []) if key in h)
    return Measured(values) if values else None


def study_markdown(study: Study, headlines: dict[str, list[dict]], plots: list[str], mode: str,
                   curves: dict[str, Curve] | None = None) -> str:
    """``headlines``: row run name -> one headline dict per seed; ``curves``: row run name -> its numbers over the
    chain's steps (``pipeline.reproduce.curves``), which add each claim's verdict at every evaluated budget."""
    runs, curves = dict(study.rows), curves or {}
    head = "| variant | " + " | ".join(h for h, _ in study.columns) + " |"
    lines = [head, "|" + "---|" * (len(study.columns) + 1)]
    for label, run in study.rows:
        cells = [(m.cell() if (m := measured(headlines, run, k)) else "not run") for _, k in study.columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if label in study.paper:
            ref = study.paper[label]
            lines.append(f"| ↳ paper ({study.paper_model}) | " + " | ".join(
                f"{ref[k]:.4g}" if k in ref else "—" for _, k in study.columns) + " |")
    steps = " | over steps (the chain's steps)" if curves else ""
    lines += ["", f"| claim | verdict | measured{steps} |", "|---|---|---|" + ("---|" if curves else "")]
    for claim, better, worse, key, lower in CLAIMS[study.name]:
        if better not in runs or worse not in runs:  # a row the scale does not run (gpu-short: the CPT chain)
            continue
        verdict, evidence = compare(measured(headlines, runs[better], key), measured(headlines, runs[worse], key),
                                    lower)
        budgets = ""
        if curves:
            a, b = (_curve(runs[row], curves, headlines, curves.get(runs[other], {})) for row, other in
                    ((better, worse), (worse, better)))
            budgets = f" | {over_steps(a, b, key, lower)}"
        lines.append(f"| {claim} | **{verdict}** | {evidence}{budgets} |")
    lines.append("")
    lines += [f"![{os.path.splitext(os.path.basename(p))[0]}]({p})" for p in plots]
    return "\n".join([f"*{mode} run, generated by launch/reproduce.py*", "", *lines, ""])


def _curve(run: str, curves: dict[str, Curve], headlines: dict[str, list[dict]], other: Curve) -> Curve:
    """A run's curve; an untrained model (no curve, one headline) holds at every step of the other side's."""
    if run in curves:
        return curves[run]
    found = headlines.get(run, [])
    return {x: found[0] for x in other} if len(found) == 1 else {}


def replace_block(page: str, mode: str, study: str, body: str, path: str) -> str:
    begin, end = f"<!-- BEGIN {mode} {study} -->", f"<!-- END {mode} {study} -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(page):
        raise ValueError(f"{path}: no '{begin}' ... '{end}' block; restore it where the {study} study's {mode} "
                         "results go")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", page)
