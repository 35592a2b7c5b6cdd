"""The papers' tables: which of our headline numbers fill each column, and the papers' own numbers (from the
research notes, ``methods.md`` §1.6, §2.5, §3.6; LLM2Vec's Table 1 for its comparison with Echo) for the variants and
model scales they report.

A paper row is shown beside one of ours only where the scale matches: the same preset shape (210m / 610m / 1b for
MLM-vs-CLM, whose numbers are after 42K steps of 2.4M tokens; 7b, i.e. Llama-2-7B, for LLM2Vec and MAGNET) and the
same kind of variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.eval.report.runs import Recipe

Numbers = dict[str, float]


@dataclass(frozen=True)
class Paper:
    name: str
    title: str
    columns: tuple[tuple[str, str], ...]  # (header, headline key)
    reference: Callable[[Recipe], tuple[str, Numbers] | None]  # the paper's row for a variant, if it has one
    note: str


def _row(keys: tuple[str, ...], values: tuple[float, ...]) -> Numbers:
    return dict(zip(keys, values))


# --- Should We Still Pretrain Encoders with MLM? (arXiv 2507.00994), category averages --------------------------
MLM_KEYS = ("sc_acc", "tc_f1", "qa_f1", "ir_ndcg10")
MLM_VS_CLM = {
    ("210m", "mlm-40"): (84.89, 92.13, 49.43, 75.78), ("210m", "clm"): (82.80, 92.18, 39.26, 72.83),
    ("610m", "mlm-40"): (87.00, 92.21, 62.77, 79.55), ("610m", "clm"): (83.58, 92.69, 42.09, 76.20),
    ("610m", "clm-25-mlm-40"): (87.85, 93.07, 67.77, 79.88),
    ("1b", "mlm-40"): (88.23, 92.51, 70.28, 79.95), ("1b", "clm"): (82.68, 92.46, 44.48, 78.68),
}


def _mlm_vs_clm_kind(v: Recipe) -> str | None:
    if v.objectives == {"clm"}:
        return "clm"
    if v.objectives == {"mlm"} and v.mask_ratio == 0.4:
        return "mlm-40"
    if v.objectives == {"clm", "mlm"} and v.mask_ratio == 0.4 and abs(v.clm_share - 0.25) < 1e-6:
        return "clm-25-mlm-40"
    return None


def _mlm_vs_clm(v: Recipe) -> tuple[str, Numbers] | None:
    kind = _mlm_vs_clm_kind(v)
    values = MLM_VS_CLM.get((v.scale, kind))
    return (f"{v.scale} {kind}, 42K steps", _row(MLM_KEYS, values)) if values else None


# --- LLM2Vec and MAGNET on Llama-2-7B (MAGNET Tables 1, 2, 4, 5) ---------------------------------------------------
PROBE_KEYS = ("probe_chunk", "probe_ner", "probe_pos")
STS_KEYS = ("sts/stsb", "sts/sickr", "sts_avg")
INFILL_KEYS = ("infill_ppl_magnet/roc", "infill_ppl_magnet/wiki")
REP_KEYS = ("rep_sen/wiki", "rep_4/wiki", "rep_sen/roc", "rep_4/roc")
LLAMA2 = {
    "base": {**_row(PROBE_KEYS, (88.23, 96.59, 91.53)), "sts_avg": 65.25, **_row(INFILL_KEYS, (13.93, 22.04)),
             **_row(REP_KEYS, (0.0056, 0.0601, 0.0381, 0.0163))},
    "llm2vec-mntp": _row(PROBE_KEYS, (91.61, 97.16, 92.61)),
    "llm2vec": {**_row(STS_KEYS, (78.32, 71.77, 75.92)), **_row(REP_KEYS, (0.2044, 0.4747, 0.2945, 0.5243))},
    "magnet": {**_row(PROBE_KEYS, (92.64, 98.31, 93.34)), **_row(STS_KEYS, (82.88, 78.77, 79.36)),
               **_row(INFILL_KEYS, (9.52, 15.46)), **_row(REP_KEYS, (0.0151, 0.2047, 0.0737, 0.2573))},
}


# LLM2Vec's unsupervised MTEB table (BehnamGhader et al., arXiv 2404.05961v3 / COLM 2024, Table 1 "Unsupervised
# results on MTEB", p. 6), its LLaMA-2-7B rows: category averages over MTEB's 15 retrieval, 11 clustering and 10 STS
# sets. "uni" is its causal baseline "Uni + w. Mean" (weighted mean pooling), "echo" Echo embeddings run by LLM2Vec's
# authors with the same model and instructions (its Appendix E.1).
LLM2VEC_MTEB_CITATION = "LLM2Vec (arXiv 2404.05961v3), Table 1, p. 6"
LLM2VEC_MTEB_CATEGORIES = {"retrieval": "MTEB retrieval, 15 sets", "clustering": "MTEB clustering, 11 sets",
                           "sts": "MTEB STS, 10 sets"}
LLM2VEC_MTEB = {
    "uni": {"retrieval": 15.16, "clustering": 36.85, "sts": 63.42},
    "llm2vec": {"retrieval": 36.75, "clustering": 40.83, "sts": 76.41},
    "echo": {"retrieval": 16.16, "clustering": 34.25, "sts": 67.95},
}


def _llama2_kind(v: Recipe) -> str | None:
    if "magnet" in v.objectives:
        return "magnet"
    if "mntp" in v.objectives:
        return "llm2vec" if "simcse" in v.objectives else "llm2vec-mntp"
    return "base" if v.objectives == {"clm"} else None


def _llama2(v: Recipe) -> tuple[str, Numbers] | None:
    kind = _llama2_kind(v) if v.scale == "7b" else None
    return (f"Llama-2-7B {kind}", LLAMA2[kind]) if kind else None


PAPERS = (
    Paper("mlm_vs_clm", "Should We Still Pretrain Encoders with MLM? (fine-tuned, mean over seeds)",
          (("SC acc", "sc_acc"), ("TC F1", "tc_f1"), ("QA F1", "qa_f1"), ("IR NDCG@10", "ir_ndcg10")),
          _mlm_vs_clm, "paper rows: 210M/610M/1B after 42K steps (~100B tokens); category averages of 12 datasets"),
    Paper("llm2vec", "LLM2Vec (word probes: accuracy; STS: Spearman x100)",
          (("Chunk", "probe_chunk"), ("NER", "probe_ner"), ("POS", "probe_pos"), ("STS-B", "sts/stsb"),
           ("SICK-R", "sts/sickr"), ("STS avg", "sts_avg")),
          _llama2, "paper rows: Llama-2-7B; the paper's STS avg is over STS12-16, STS-B and SICK-R"),
    Paper("magnet", "MAGNET (probes, STS, infilling perplexity, repetition)",
          (("Chunk", "probe_chunk"), ("NER", "probe_ner"), ("POS", "probe_pos"), ("STS avg", "sts_avg"),
           ("Infill PPL ROC", "infill_ppl_magnet/roc"), ("Infill PPL Wiki", "infill_ppl_magnet/wiki"),
           ("Causal PPL ROC", "infill_ppl_causal/roc"), ("Rep-Sen Wiki", "rep_sen/wiki"),
           ("Rep-4 Wiki", "rep_4/wiki"), ("Rep-Sen ROC", "rep_sen/roc"), ("Rep-4 ROC", "rep_4/roc")),
          _llama2, "paper rows: Llama-2-7B fine-tuned on Wikitext-103; decoding settings of the paper unknown"),
)
