"""Every evaluation task described once (:class:`TaskSpec`), below everything that reads the descriptions: its name
and data, its options type (``launch/evaluate.py --set TASK.KEY=VALUE``, an ``eval.evaluators`` entry's options),
the headline numbers it reports and which way each is better, how the Hub's ``model-index`` names it, whether it
runs during training (``eval.evaluators``) and how the report plots its numbers.

The experiment config (which tasks run during training, their options, ``checkpoint.keep_best``'s direction), the
model card's ``model-index`` (``pipeline.export.model_index``), the report's plots, the training logs and
``EvalResults`` read these specs; ``pipeline.eval`` adds how each task runs (``eval.registry.TASKS``). Nothing here
imports torch or another module of the pipeline, so an experiment is checked without them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Score = tuple[str, str, float]  # (dataset, metric id, value): one entry of a model card's model-index


@dataclass(frozen=True)
class HeadlineKey:
    """One headline number, or a family of them named by the prefix they share (``sts/``: one per STS dataset)."""

    better: Literal["max", "min"]  # which way it improves (checkpoint.keep_best_mode auto)
    unit: str | None = None  # the report's y axis, where the unit is certain (None: the key itself)
    log: bool = False  # plotted on a log axis: perplexities span orders of magnitude across runs


@dataclass(frozen=True)
class HubTask:
    """How a model card's ``model-index`` lists a task (huggingface_hub's ``EvalResult``)."""

    task_type: str  # a Hub pipeline tag where one fits, MTEB's task type elsewhere
    task_name: str  # its pretty name
    scores: Callable[[dict], list[Score]] | None = None  # the entries of a result; None: its headline numbers


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str  # the DATA_DIR sub-directory it reads by default
    description: str
    options: type  # the dataclass of its settings, every field with a default
    headline: Callable[[dict], dict[str, float]]  # the few numbers of a result the report tabulates and plots
    keys: Mapping[str, HeadlineKey]  # every key ``headline`` returns starts with one of these
    hub: HubTask
    in_training: bool  # may run on the model being trained at each validation (eval.evaluators)

    def key(self, headline_key: str) -> HeadlineKey | None:
        """The declaration ``headline_key`` (a key ``headline`` returns) falls under."""
        return next((h for prefix, h in self.keys.items() if headline_key.startswith(prefix)), None)

    def model_index(self, result: dict) -> list[Score]:
        """(dataset, metric id, value) of one result as the card's model-index lists it: the hub's ``scores``, else
        each headline number ("metric/dataset", or "metric" of the task's own name)."""
        if self.hub.scores is not None:
            return self.hub.scores(result)
        return [(key.split("/", 1)[1] if "/" in key else self.name, key.split("/", 1)[0], value)
                for key, value in self.headline(result).items()]


def each_dataset(key: str, metric: str) -> Callable[[dict], list[Score]]:
    """Each dataset's ``key`` as the metric id ``metric`` (MTEB's; ``{k}``: the cut-off the result records)."""
    return lambda result: [(name, metric.format(k=r.get("k")), r[key]) for name, r in result["datasets"].items()]


def finetuned(result: dict) -> list[Score]:
    """Each dataset's test mean at the learning rate chosen on validation, under the metric it names."""
    return [(name, r["metric"].replace("@", "_at_"), r["test"]["mean"]) for name, r in result["datasets"].items()]


# ---- the options of each task (every field has a default; docs/evaluation.md describes them)

@dataclass
class EmbeddingOptions:
    datasets: list[str] = field(default_factory=list)  # files or HF names; default: all of DATA_DIR/<task>
    pooling: Literal["mean", "last", "weighted_mean"] | None = None  # None: the model's recorded pooling
    layout: Literal["bos_eos", "special", "text", "echo"] | None = None  # None: the model's recorded one
    instruction: str | None = None  # None: the model's recorded one ("" for none); left out of pooling
    attention: Literal["causal", "bidirectional"] | None = None  # None: the model's
    max_length: int = 512
    max_examples: int = 0  # 0: all
    split: str = "test"  # split of an HF dataset
    # zero-shot retrieval: how a query's instruction is joined for a model without a recorded instruction_format
    instruction_format: str = "{instruction}: "
    k: int = 10  # zero-shot retrieval: NDCG and MRR cut-off


@dataclass
class InfillOptions:
    datasets: list[str] = field(default_factory=list)  # files or HF names; default: all of DATA_DIR/infilling
    max_examples: int = 0  # 0: all
    generate: int = 20  # examples whose span is also generated (0: none)
    max_length: int = 512  # longer examples are skipped and counted


@dataclass
class Decoding:
    max_new_tokens: int = 128
    do_sample: bool = False  # False: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    temperature: float = 1.0
    seed: int = 0  # seeds sampling


@dataclass
class RepetitionOptions:
    datasets: list[str] = field(default_factory=list)  # files or HF names; default: all of DATA_DIR/repetition
    prefix: Literal["words", "sentence"] = "words"
    prefix_words: int = 5
    max_examples: int = 0  # 0: all
    decoding: Decoding = field(default_factory=Decoding)
    samples: int = 5  # continuations kept in the result, to read


@dataclass
class HeldOutOptions:
    shards: str = "heldout"  # shard directory, relative to --data-dir or absolute
    max_batches: int = 0  # 0: every sample
    document_masking: bool = True


@dataclass
class MaskedHeldOutOptions(HeldOutOptions):
    ratio: float = 0.3
    policy: Literal["80-10-10", "mask"] = "80-10-10"
    mask_token: str | None = None  # None: the model's recorded mask token, else the tokenizer's mask token


@dataclass
class ProbingOptions:
    directory: str = "conll"  # under --data-dir, or absolute
    columns: dict[str, int] = field(default_factory=lambda: {"pos": 1, "chunk": 2, "ner": 3})  # tag columns (token = 0)
    read: Literal["auto", "same", "previous"] = "auto"  # auto: previous for MNTP-trained models
    attention: Literal["causal", "bidirectional"] | None = None  # None: the model's
    lr: float = 5e-4
    batch_size: int = 32  # words per step
    max_epochs: int = 10
    max_steps: int = 4000
    patience: int = 2  # epochs without a better dev accuracy before stopping
    dropout: float = 0.1
    max_length: int = 512  # longer sentences are skipped (in every split) and counted
    max_train_sentences: int = 0  # the probe trains on the train file's first N sentences (0: all)


@dataclass
class FinetuneOptions:
    datasets: list[str] = field(default_factory=list)  # sub-directories of DATA_DIR/<family> or HF names
    lrs: list[float] = field(default_factory=lambda: [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    max_steps: int = 1000
    max_epochs: float = 1.0
    batch_size: int = 32
    warmup: float = 0.1  # fraction of the steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-5
    grad_clip: float = 1.0
    attention: Literal["auto", "causal", "bidirectional"] = "bidirectional"  # auto: the model's
    max_length: int = 512
    max_examples: int = 0  # per split, 0: all
    eval_batch_size: int = 32


@dataclass
class TokenOptions(FinetuneOptions):
    tag_column: int = -1  # column of the tag (the token is column 0; -1: the last)


@dataclass
class QAOptions(FinetuneOptions):
    max_answer_tokens: int = 30


@dataclass
class RetrievalOptions(FinetuneOptions):
    scale: float = 20.0  # InfoNCE logit scale, 1 / temperature
    k: int = 10  # NDCG cut-off


# ---- the headlines that are more than a lookup

INFILLING_MODES = ("magnet", "causal")  # how infilling reads the span: MAGNET's bidirectional infilling, or causally


def infilling_headline(result: dict) -> dict[str, float]:
    return {f"infill_ppl_{mode}/{name}": r[mode]["perplexity"] for name, r in result["datasets"].items()
            for mode in INFILLING_MODES}


def repetition_headline(result: dict) -> dict[str, float]:
    """Rep-Sen and Rep-4 per dataset; left out where nothing was scored (every continuation too short)."""
    return {f"{key}/{name}": r[key] for name, r in result["datasets"].items() for key in ("rep_sen", "rep_4")
            if r[key] is not None}


HIGHER, LOWER = "max", "min"
PERPLEXITY = HeadlineKey(LOWER, "perplexity", log=True)

# every evaluation task, those that run during training first
SPECS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("sts", "sts", "STS: Spearman x100 of cosine similarity against gold scores", EmbeddingOptions,
             lambda r: {"sts_avg": r["average"], **{f"sts/{k}": v["spearman"] for k, v in r["datasets"].items()}},
             {"sts_avg": HeadlineKey(HIGHER, "Spearman x100"), "sts/": HeadlineKey(HIGHER, "Spearman x100")},
             HubTask("sentence-similarity", "Semantic textual similarity", each_dataset("spearman", "cos_sim_spearman")),
             in_training=True),
    TaskSpec("zero_shot_retrieval", "zero_shot_retrieval",
             "zero-shot retrieval: NDCG@k x100 of the cosine ranking, instructed queries", EmbeddingOptions,
             lambda r: {"zs_ndcg_avg": r["average"], **{f"zs_ndcg/{k}": v["ndcg"] for k, v in r["datasets"].items()},
                        **{f"zs_mrr/{k}": v["mrr"] for k, v in r["datasets"].items()}},
             {"zs_ndcg_avg": HeadlineKey(HIGHER), "zs_ndcg/": HeadlineKey(HIGHER), "zs_mrr/": HeadlineKey(HIGHER)},
             HubTask("Retrieval", "Zero-shot retrieval", each_dataset("ndcg", "ndcg_at_{k}")), in_training=True),
    TaskSpec("clustering", "clustering", "clustering: V-measure x100 of k-means on embeddings", EmbeddingOptions,
             lambda r: {"clustering_avg": r["average"]}, {"clustering_avg": HeadlineKey(HIGHER, "V-measure x100")},
             HubTask("Clustering", "Clustering", each_dataset("v_measure", "v_measure")), in_training=True),
    TaskSpec("infilling", "infilling", "perplexity and generation of a missing span (MAGNET vs causal)",
             InfillOptions, infilling_headline, {"infill_ppl_": PERPLEXITY},
             HubTask("text-generation", "Infilling"), in_training=True),
    TaskSpec("repetition", "repetition", "Rep-Sen and Rep-2/3/4 of open-ended continuations", RepetitionOptions,
             repetition_headline, {"rep_sen/": HeadlineKey(LOWER, "share of repeated sentences"),
                                   "rep_4/": HeadlineKey(LOWER, "share of repeated 4-grams")},
             HubTask("text-generation", "Repetition"), in_training=True),
    TaskSpec("perplexity", "heldout", "held-out CLM loss and perplexity", HeldOutOptions,
             lambda r: {"ppl": r["perplexity"]}, {"ppl": PERPLEXITY},
             HubTask("text-generation", "Held-out perplexity"), in_training=False),
    TaskSpec("mlm", "heldout", "held-out MLM loss and accuracy at a masking ratio", MaskedHeldOutOptions,
             lambda r: {"mlm_acc": 100 * r["accuracy"]}, {"mlm_acc": HeadlineKey(HIGHER)},
             HubTask("fill-mask", "Held-out MLM"), in_training=False),
    TaskSpec("mntp", "heldout", "held-out MNTP loss and accuracy at a masking ratio", MaskedHeldOutOptions,
             lambda r: {"mntp_acc": 100 * r["accuracy"]}, {"mntp_acc": HeadlineKey(HIGHER)},
             HubTask("fill-mask", "Held-out MNTP"), in_training=False),
    TaskSpec("probing", "conll", "linear probes of frozen word states on CoNLL (POS, chunk, NER)", ProbingOptions,
             lambda r: {f"probe_{name}": v["accuracy"] for name, v in r["tasks"].items()},
             {"probe_": HeadlineKey(HIGHER)}, HubTask("token-classification", "Linear probing"), in_training=False),
    TaskSpec("classification", "classification", "fine-tuned sequence classification (accuracy), LR x seed sweep",
             FinetuneOptions, lambda r: {"sc_acc": r["average"]}, {"sc_acc": HeadlineKey(HIGHER, "accuracy (%)")},
             HubTask("text-classification", "Fine-tuned classification", finetuned), in_training=False),
    TaskSpec("token_classification", "token_classification",
             "fine-tuned token classification (entity F1), LR x seed sweep", TokenOptions,
             lambda r: {"tc_f1": r["average"]}, {"tc_f1": HeadlineKey(HIGHER, "F1 (%)")},
             HubTask("token-classification", "Fine-tuned token classification", finetuned), in_training=False),
    TaskSpec("qa", "qa", "fine-tuned extractive QA (SQuAD F1), LR x seed sweep", QAOptions,
             lambda r: {"qa_f1": r["average"]}, {"qa_f1": HeadlineKey(HIGHER, "F1 (%)")},
             HubTask("question-answering", "Fine-tuned extractive QA", finetuned), in_training=False),
    TaskSpec("retrieval", "retrieval", "fine-tuned bi-encoder retrieval (NDCG@10), LR x seed sweep", RetrievalOptions,
             lambda r: {"ir_ndcg10": r["average"]}, {"ir_ndcg10": HeadlineKey(HIGHER)},
             HubTask("Retrieval", "Fine-tuned retrieval", finetuned), in_training=False),
)}
IN_TRAINING = tuple(name for name, spec in SPECS.items() if spec.in_training)


def headline_key(key: str) -> HeadlineKey | None:
    """The declaration a headline number ``key`` of any task falls under (None: no task reports it)."""
    return next((h for spec in SPECS.values() if (h := spec.key(key)) is not None), None)
