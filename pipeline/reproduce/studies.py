"""The three studies of `make reproduce`: grid, evaluation tasks and options, paper numbers and claims to check.

Sizes (steps, examples, fine-tuning sweep) come in four scales: ``full`` (make reproduce, ~1.7-4 h on 2 cores),
``quick`` (make reproduce-quick: the grids' -smoke twins and a few examples, <= 20 min), ``paper`` (make
reproduce-paper: each study's paper.yaml grid, the papers' step counts and batch sizes on one GPU) and ``gpu-short``
(make reproduce-gpu-short: the from-scratch study alone at 210m in <= 8 min on one H200, with nothing to carry
there but the extracted data; its budget is in its grid, gpu_short.yaml). The budget behind the full sizes is in
docs/results.md.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from pipeline.eval.echo import ECHO
from pipeline.eval.embeddings import TASKS as EMBEDDING_TASKS
from pipeline.eval.report.papers import LLAMA2, MLM_VS_CLM
from pipeline.grid import SMOKE_SUFFIX

SMOLLM2 = "runs/models/smollm2-135m"


@dataclass(frozen=True)
class Baseline:
    """An untrained model evaluated as is: SmolLM2 read with causal or bidirectional attention, or as Echo embeddings
    (causal, each text given twice, the second copy pooled). No training: a baseline costs evaluation time only."""

    name: str
    attention: str
    layout: str | None = None  # encode()'s layout for the embedding tasks (None: the model's, BOS text EOS)

    def tasks(self, study_tasks: str) -> str:
        """The study's tasks this reading is evaluated on: a layout is a way to embed, so only the embedding tasks
        take it."""
        embedding = {t.spec.name for t in EMBEDDING_TASKS}
        return ",".join(t for t in study_tasks.split(",") if not self.layout or t in embedding)

    def describe(self, study_tasks: str) -> str:
        """One line for the dry run: what is read, how, on which tasks, and what it costs."""
        how = f"{self.attention} attention" + (f", layout {self.layout}" if self.layout else "")
        cost = (" (each text twice in Echo's template: over twice the tokens of the causal reading)"
                if self.layout == ECHO else "")
        return (f"baseline {self.name}: {SMOLLM2} as it is, {how}; {self.tasks(study_tasks)}: no training, "
                f"evaluation time only{cost}")


@dataclass(frozen=True)
class Study:
    name: str
    grid: str  # the CPU grid (its -smoke twins: the quick scale)
    paper_grid: str  # the paper scale's grid
    tasks: str
    options: dict[str, list[str]]  # scale -> evaluate.py --set values
    baselines: tuple[Baseline, ...] = ()
    rows: tuple[tuple[str, str], ...] = ()  # (label, run or baseline name, without -smoke)
    columns: tuple[tuple[str, str], ...] = ()  # (header, headline key)
    paper: dict[str, dict[str, float]] = field(default_factory=dict)  # label -> headline key -> the paper's number
    paper_model: str = "Llama-2-7B"  # what the paper's rows measured
    plots: tuple[str, ...] = ("loss_curves",)  # the report's PNGs (launch/report.py) that belong on the page
    # evaluated at every kept checkpoint of the study's runs (checkpoint.keep_every), with the study's options, and
    # plotted against steps as curves.png (pipeline/reproduce/curves.py): (header, headline key) per panel
    curve_tasks: str = ""
    curves: tuple[tuple[str, str], ...] = ()
    short_grid: str = ""  # the gpu-short scale's grid; "": the study does not run at that scale
    # a shell pattern of the grid's runs that only --seeds (make reproduce-seeds) trains: the headline claims' extra
    # seeds; "": every run of the grid is the study's own
    extra_seeds: str = ""

    def grid_for(self, scale: str) -> str:
        """The scale's grid ("": none)."""
        return {"paper": self.paper_grid, "gpu-short": self.short_grid}.get(scale, self.grid)

    def is_extra_seed(self, name: str) -> bool:
        """Whether run ``name`` (-smoke or not) is one of the extra seeds, which only --seeds trains."""
        return bool(self.extra_seeds) and fnmatch.fnmatchcase(name.removesuffix(SMOKE_SUFFIX), self.extra_seeds)


def _finetune(lrs: str, seeds: str, steps: int, batch: int = 32,
              tasks: tuple[str, ...] = ("classification", "token_classification")) -> list[str]:
    return [f"{task}.{k}={v}" for task in tasks
            for k, v in (("lrs", lrs), ("seeds", seeds), ("max_steps", steps), ("batch_size", batch))]


_PAPER_LRS = "[1.0e-5,2.0e-5,5.0e-5,1.0e-4,2.0e-4,5.0e-4]"  # EncodEval's six rates
_QUICK_STS = ["sts.max_length=64", "sts.max_examples=128"]  # studies 1 and 3 read the same STS (its results are shared)
_POS_PROBE = ["probing.directory=token_classification/wsj-pos", "probing.columns={pos: 1}"]  # LLM2Vec's word tasks
_MLM_PAPER = dict(zip(("sc_acc", "tc_f1"), MLM_VS_CLM[("610m", "mlm-40")][:2]))
_CLM_PAPER = dict(zip(("sc_acc", "tc_f1"), MLM_VS_CLM[("610m", "clm")][:2]))
_ECHO = Baseline("smollm2-echo", "causal", ECHO)  # Echo embeddings of the untrained model (studies 1 and 3)
_SWITCH_PAPER = dict(zip(("sc_acc", "tc_f1"), MLM_VS_CLM[("610m", "clm-25-mlm-40")][:2]))

STUDIES = (
    Study("llm2vec", "experiments/reproduce/llm2vec/grid.yaml", "experiments/reproduce/llm2vec/paper.yaml",
          "sts,clustering,zero_shot_retrieval,probing",
          {"quick": [*_QUICK_STS, "clustering.max_length=64",
                     "zero_shot_retrieval.max_examples=32", *_POS_PROBE, "probing.max_train_sentences=300"],
           "full": ["sts.max_length=512", *_POS_PROBE], "paper": ["sts.max_length=512", *_POS_PROBE]},
          baselines=(Baseline("smollm2-causal", "causal"), Baseline("smollm2-bidirectional", "bidirectional"),
                     _ECHO),
          rows=(("causal, mean pooling (untrained)", "smollm2-causal"),
                ("bidirectional, untrained", "smollm2-bidirectional"),
                ("Echo: causal, the text twice (untrained)", "smollm2-echo"),
                ("bidirectional + MNTP", "llm2vec-mntp"), ("bidirectional + MNTP + SimCSE", "llm2vec-simcse"),
                ("bidirectional + MNTP + supervised", "llm2vec-supervised")),
          columns=(("STS-B (Spearman x100)", "sts/stsb"), ("STS Clough (Spearman x100)", "sts/clough"),
                   ("Clustering Clough topics (V x100)", "clustering_avg"),
                   ("Retrieval replies (NDCG@10 x100)", "zs_ndcg/replies"),
                   ("Retrieval continuations (NDCG@10 x100)", "zs_ndcg/continuations"),
                   ("POS probe WSJ (word acc x100)", "probe_pos")),
          curve_tasks="sts,clustering",
          curves=(("STS-B (Spearman x100)", "sts/stsb"), ("STS Clough (Spearman x100)", "sts/clough"),
                  ("Clustering Clough topics (V x100)", "clustering_avg")),
          plots=("loss_curves", "curves"),
          extra_seeds="llm2vec-*-s[12]",
          paper={"causal, mean pooling (untrained)": {"sts/clough": LLAMA2["base"]["sts_avg"]},
                 "bidirectional + MNTP + SimCSE": {"sts/stsb": LLAMA2["llm2vec"]["sts/stsb"],
                                                   "sts/clough": LLAMA2["llm2vec"]["sts_avg"]}}),
    Study("mlm_vs_clm", "experiments/reproduce/mlm_vs_clm/grid.yaml", "experiments/reproduce/mlm_vs_clm/paper.yaml",
          "classification,token_classification",
          {"quick": _finetune("[1.0e-3]", "[0]", 20),
           # sentiment: one epoch of MR's 3000 sentences (40 steps left every model at the majority class); the rate
           # is the better on MR's dev set of a sweep of 1e-4, 3e-4 and 1e-3 for the CLM and MLM runs (results.md)
           "full": [*_finetune("[1.0e-3]", "[0]", 188, 16, ("classification",)),
                    *_finetune("[1.0e-3]", "[0,1]", 40, 16, ("token_classification",))],
           "paper": _finetune(_PAPER_LRS, "[0,1]", 1000),
           # one epoch of each at two rates chosen on dev (a 210m model after ~1M tokens: the CPU scale's 1e-3 and
           # a tenth of it); 580 fine-tuning steps a model, seconds on a GPU
           "gpu-short": [*_finetune("[1.0e-4,1.0e-3]", "[0]", 188, 16, ("classification",)),
                         *_finetune("[1.0e-4,1.0e-3]", "[0,1]", 51, 16, ("token_classification",))]},
          rows=(("CLM", "scratch-clm"), ("MLM 40 %", "scratch-mlm40"), ("CLM 50 % -> MLM 40 %", "scratch-clm50"),
                ("CLM (half) then MLM 40 % continued", "cpt"), ("CLM, half budget", "half-clm")),
          columns=(("MR sentiment acc", "sc_acc"), ("WSJ POS acc", "tc_f1")),
          paper={"CLM": _CLM_PAPER, "MLM 40 %": _MLM_PAPER, "CLM 50 % -> MLM 40 %": _SWITCH_PAPER},
          paper_model="610M, 42K steps; its switch is CLM 25 % -> MLM 40 %",
          plots=("loss_curves", "metrics_vs_clm_share"),
          short_grid="experiments/reproduce/mlm_vs_clm/gpu_short.yaml"),
    Study("magnet", "experiments/reproduce/magnet/grid.yaml", "experiments/reproduce/magnet/paper.yaml",
          "sts,clustering,repetition,infilling",  # STS and clustering: MAGNET's sentence-level table
          {"quick": [*_QUICK_STS, "clustering.max_length=64", "repetition.max_examples=3",
                     "repetition.decoding.max_new_tokens=32",
                     "infilling.max_examples=8", "infilling.generate=0"],
           "full": ["sts.max_length=512", "repetition.max_examples=16", "repetition.decoding.max_new_tokens=64",
                    "infilling.generate=0"],
           "paper": ["sts.max_length=512"]},  # every example; 128 new tokens, 20 infills generated
          baselines=(Baseline("smollm2-causal", "causal"), _ECHO),
          # the sentence-level table as MAGNET has it: the LLM alone (mean), LLM2Vec (mean), Echo, MAGNET (as its
          # record says: the last token, with SSCL's instruction)
          rows=(("SmolLM2 (untrained)", "smollm2-causal"), ("Echo (untrained)", "smollm2-echo"),
                ("LLM2Vec MNTP", "llm2vec-mntp"), ("LLM2Vec MNTP + SimCSE", "llm2vec-simcse"),
                ("MAGNET", "magnet-magnet")),
          columns=(("Rep-Sen Wiki", "rep_sen/wiki"), ("Rep-4 Wiki", "rep_4/wiki"),
                   ("Infill PPL (MAGNET attn)", "infill_ppl_magnet/wiki"),
                   ("Infill PPL (causal)", "infill_ppl_causal/wiki"), ("STS-B", "sts/stsb"),
                   ("STS Clough", "sts/clough"), ("Clustering Clough topics", "clustering_avg")),
          curve_tasks="sts,repetition,infilling",
          curves=(("Rep-4 Wiki (share of repeated 4-grams)", "rep_4/wiki"),
                  ("Rep-Sen Wiki (share of repeated sentences)", "rep_sen/wiki"),
                  ("Infill PPL (MAGNET attention)", "infill_ppl_magnet/wiki"),
                  ("Infill PPL (causal: left-to-right generation)", "infill_ppl_causal/wiki"),
                  ("STS-B (Spearman x100)", "sts/stsb")),
          plots=("loss_curves", "curves"),
          extra_seeds="magnet-magnet-s[12]",
          paper={label: {"rep_sen/wiki": LLAMA2[model]["rep_sen/wiki"], "rep_4/wiki": LLAMA2[model]["rep_4/wiki"],
                         "sts/clough": LLAMA2[model]["sts_avg"],
                         **({"sts/stsb": LLAMA2[model]["sts/stsb"]} if "sts/stsb" in LLAMA2[model] else {}),
                         **({"infill_ppl_magnet/wiki": LLAMA2[model]["infill_ppl_magnet/wiki"]}
                            if "infill_ppl_magnet/wiki" in LLAMA2[model] else {})}
                 for label, model in (("SmolLM2 (untrained)", "base"), ("LLM2Vec MNTP + SimCSE", "llm2vec"),
                                     ("MAGNET", "magnet"))}),
)
