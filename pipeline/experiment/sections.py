"""The experiment's sections (``data``, ``model``, ``phases``, ``optim``, ``train``, ``checkpoint``, ``eval``,
``export``) as dataclasses, each checked on its own when it loads; checks across sections are checks.py's."""

from __future__ import annotations

import difflib
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pipeline.config import ConfigError, from_dict
from pipeline.data.prep.input_shards import input_shards
from pipeline.experiment.mixture import SourceMixture
from pipeline.experiment.sample import SAMPLE_DIR, SAMPLE_INPUTS, is_sample, sample_shards
from pipeline.model.lora import LLM2VEC_TARGETS
from pipeline.model.presets import PRESETS
from pipeline.objectives import ObjectiveConfig
from pipeline.tasks import IN_TRAINING, SPECS


@dataclass
class DataConfig:
    # shard directory; "": the directory of build_inputs when they are named (shards_at), else sample_shards(seq_len),
    # runs/shards/sample-<seq_len>
    shards: str = ""
    tokenizer: str = os.path.join(SAMPLE_DIR, "tokenizer")
    seq_len: int = 128
    num_workers: int = 0  # DataLoader worker processes per rank; the order does not depend on it
    # files rank 0 builds data.shards from when it has no shards ([]: the sample corpus, for sample_shards only, so
    # a mistyped data.shards is an error instead of a run on the sample); named with data.shards unset, they are
    # built into a directory of their own (shards_at), never the sample's
    build_inputs: list[str] = field(default_factory=list)
    build_if_missing: bool = True  # rank 0 builds the shards from build_inputs when the directory has none
    # a shard directory built otherwise than build_inputs would build it (other or changed files, another tokenizer,
    # seq_len or build_source_*) is refused; true: rank 0 rebuilds it beside the old one and swaps it in when complete
    rebuild: bool = False
    # the build's --source-field / --source-default (docs/data_prep.md, "Sources"): the sources data.mixture mixes
    build_source_field: str = ""  # record field naming each document's source (SlimPajama: meta.redpajama_set_name)
    build_source_default: str = ""  # the source of records without one ("": such a record is bad)
    unit_shards: str = ""  # sentence-unit shards (build_shards.py --units) for contrastive objectives
    unit_micro_batch: int = 0  # sentence units per rank per micro-step (0: train.micro_batch)
    pair_shards: str = ""  # (query, positive, negatives) shards (build_shards.py --pairs) for the supervised objective
    # task -> target ratio (or {ratio, max_repetition}) of pair_shards' tasks, as data.mixture; {}: one permutation
    pair_mixture: dict[str, Any] = field(default_factory=dict)  # as written; typed: task_mixture
    # same_task: every global batch of pair_shards from one task of pair_mixture (FlagEmbedding's
    # same_dataset_within_batch); mixed: the tasks mixed within each batch. docs/embedding-recipes.md
    pair_batching: Literal["mixed", "same_task"] = "mixed"
    verify_shards: bool = True  # sha256 of each shard on first open, token ids against the vocabulary
    # shards (or unit_shards) at a URL: downloaded whole into cache_dir ("": $TMPDIR/decoder-encoders-shards, shared
    # by the node's ranks), least recently used evicted beyond cache_max_gb; each transfer tried fetch_attempts times
    cache_dir: str = ""
    cache_max_gb: float = 64.0
    fetch_attempts: int = 5
    fetch_timeout_s: float = 60.0  # per connect or read on the socket
    # source -> target ratio (or {ratio, max_repetition}) of data.shards' sources (built with --source-field);
    # {}: no mixture, the directory's samples in one permutation. docs/training.md, "Source mixtures"
    mixture: dict[str, Any] = field(default_factory=dict)  # as written; typed: source_mixture
    mixture_max_repetition: float = 1.0  # times over a source's samples may be read, unless its own says otherwise
    RANGES: ClassVar[dict[str, str]] = {"seq_len": ">= 8", "num_workers": ">= 0", "unit_micro_batch": ">= 0",
                                        "cache_max_gb": "> 0", "fetch_attempts": ">= 1", "fetch_timeout_s": "> 0",
                                        "mixture_max_repetition": "> 0"}

    # data.shards was left at its default and data.build_inputs named files: it is their own directory
    # (shards_at), set by validate (not a field: the config records the directory it resolved to)
    shards_from_inputs = False

    def validate(self) -> None:
        if not self.shards and self.build_inputs and not is_sample(self.build_inputs):
            self.shards_from_inputs = True
        self.shards = self.shards or self.shards_at(self.seq_len)
        if os.path.normpath(self.shards) == sample_shards(self.seq_len):
            if self.build_inputs and not is_sample(self.build_inputs):
                raise ConfigError(f"data.shards: {self.shards} is the sample corpus's directory, but "
                                  f"data.build_inputs names {self.build_inputs}; leave data.shards unset to build "
                                  f"them into a directory of their own, or name another directory")
            self.build_inputs = self.build_inputs or list(SAMPLE_INPUTS)
        if self.rebuild and not self.build_inputs:
            raise ConfigError(f"data.rebuild: true, but data.build_inputs names nothing to rebuild {self.shards} "
                              f"from; set data.build_inputs=[FILES], or leave data.rebuild false to read it as built")
        if self.build_source_default.strip() != self.build_source_default:
            raise ConfigError(f"data.build_source_default: {self.build_source_default!r} must be a source name "
                              f"without surrounding blanks")
        if self.build_source_field.strip() != self.build_source_field:
            raise ConfigError(f"data.build_source_field: {self.build_source_field!r} must be a record field, dotted "
                              f"into objects (meta.redpajama_set_name), without surrounding blanks")
        for typed in ("source_mixture", "task_mixture"):  # parsed now, at load: a bad mixture fails here
            self.__dict__.pop(typed, None)
            getattr(self, typed)

    def shards_at(self, seq_len: int) -> str:
        """The default shard directory at ``seq_len``: the named inputs' own (``input_shards``) when
        :attr:`shards_from_inputs`, else the sample corpus's."""
        if not self.shards_from_inputs:
            return sample_shards(seq_len)
        try:
            return input_shards(self.build_inputs, self.tokenizer, seq_len,
                                (self.build_source_field, self.build_source_default))
        except ValueError as e:
            raise ConfigError(f"data.build_inputs: {str(e).removeprefix('--input ')}") from None

    @functools.cached_property
    def source_mixture(self) -> SourceMixture:
        """``mixture`` typed (:meth:`SourceMixture.parse`), parsed once."""
        return SourceMixture.parse(self.mixture, self.mixture_max_repetition)

    @functools.cached_property
    def task_mixture(self) -> SourceMixture:
        """``pair_mixture`` typed (:meth:`SourceMixture.parse`; a task's sources are its pair shards'), parsed once."""
        return SourceMixture.parse(self.pair_mixture, self.mixture_max_repetition, "data.pair_mixture")


@dataclass
class LoraConfig:
    """LoRA adapters (pipeline/model/lora.py) instead of full-parameter training; ``r`` 0 is off. LLM2Vec's
    defaults: r 16, alpha 32, dropout 0.05 on every projection."""

    r: int = 0
    alpha: float = 32.0
    dropout: float = 0.05
    targets: list[str] = field(default_factory=lambda: list(LLM2VEC_TARGETS))
    RANGES: ClassVar[dict[str, str]] = {"r": ">= 0", "alpha": "> 0", "dropout": "[0, 1)"}

    def validate(self) -> None:
        unknown = [t for t in self.targets if t not in LLM2VEC_TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"model.lora.targets: {unknown or 'empty'}; choose among {list(LLM2VEC_TARGETS)}")

    @property
    def scale(self) -> float:
        """What the adapter's product is multiplied by (0 when LoRA is off)."""
        return self.alpha / self.r if self.r else 0.0


@dataclass
class ModelConfig:
    init: str = "tiny"  # a preset name (tiny, 20m, 210m, 610m, 1b, 7b, 8b, tiny-moe) or a local HF checkpoint directory
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # auto: on CUDA flash varlen for packed causal/bidirectional batches, FlexAttention block masks for MAGNET;
    # SDPA on CPU (no varlen kernel, no flex backward there)
    attn_implementation: Literal["auto", "sdpa", "eager", "flex", "varlen"] = "auto"
    # torch.compile each decoder layer's forward; auto: on CUDA, off on CPU (pipeline.model.build.compiles)
    compile: bool | Literal["auto"] = "auto"
    lm_head_chunk: int = 1024  # target rows per chunk of the LM head loss (0: unchunked fp32 logits of all targets)
    # recompute activations in the backward: true every layer, k (an integer >= 1) every k-th layer, selective the
    # cheap ops of every layer (pipeline.model.checkpointing)
    activation_checkpointing: bool | Literal["selective"] | int = False
    attention_dropout: float = 0.0  # dropout on attention probabilities (SimCSE's positives need > 0, e.g. 0.3)
    shape: str = ""  # a preset whose shape the checkpoint in `init` must have (continued pretraining); "": unchecked
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters only (lora.r > 0)
    # weight of a mixture-of-experts model's router load-balancing loss; None: the checkpoint's router_aux_loss_coef
    router_aux_coef: float | None = None
    RANGES: ClassVar[dict[str, str]] = {"attention_dropout": "[0, 1)", "lm_head_chunk": ">= 0",
                                        "router_aux_coef": ">= 0"}

    def validate(self) -> None:
        ac = self.activation_checkpointing
        if not isinstance(ac, (bool, str)) and ac < 1:
            raise ConfigError(f"model.activation_checkpointing: {ac} layers; use false, true, selective or k >= 1 "
                              f"(every k-th layer)")
        if self.shape and self.shape not in PRESETS:
            raise ConfigError(f"model.shape: {self.shape!r} is not a preset; choose one of {list(PRESETS)} (or \"\")")


@dataclass
class PhaseSpec:
    objectives: list[ObjectiveConfig]  # each typed by its name (pipeline/objectives/<name>.py, docs/training.md)
    share: float = 1.0  # fraction of train.steps; shares of all phases sum to 1
    name: str = ""
    document_masking: bool = True  # attend only within the document inside packed samples
    # context extension (docs/training.md, "Context extension"): the phase's own packed shards and sequence length
    # ("" / 0: data.shards / data.seq_len; "" at another seq_len: the sample corpus at it when data.shards is),
    # its micro-batch (0: the run's tokens per micro-batch, train.micro_batch x data.seq_len / seq_len), and the
    # RoPE theta from its first step on (None: the one before, the start model's in the first phase)
    shards: str = ""
    seq_len: int = 0
    micro_batch: int = 0
    rope_theta: float | None = None
    RANGES: ClassVar[dict[str, str]] = {"share": "(0, 1]", "seq_len": ">= 0", "micro_batch": ">= 0",
                                        "rope_theta": "> 0"}

    def validate(self) -> None:
        if not self.objectives:
            raise ConfigError(f"phase {self.name!r}: needs at least one objective")
        self.name = self.name or "+".join(o.name for o in self.objectives)



@dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: Literal["wsd", "cosine", "constant"] = "wsd"
    # the linear warmup and wsd's final linear decay, in optimizer steps, or (None) as fractions of train.steps,
    # as HF Trainer's warmup_ratio, so one config fits a run of any length
    warmup_steps: int | None = None
    warmup_ratio: float = 0.1
    decay_steps: int | None = None
    decay_ratio: float = 0.2
    min_lr_ratio: float = 0.0  # lr at the end of the decay, as a fraction of lr
    # AdamW kernel when the DeepSpeed JSON has no optimizer section: auto = torch's fused AdamW on CUDA, torch's
    # default (foreach) AdamW on CPU; torch / deepspeed = torch's fused / DeepSpeed's FusedAdam (CUDA only)
    fused: Literal["auto", "torch", "deepspeed", "none"] = "auto"
    RANGES: ClassVar[dict[str, str]] = {"lr": "> 0", "betas": "[0, 1)", "eps": "> 0", "weight_decay": ">= 0",
                                        "grad_clip": ">= 0", "warmup_steps": ">= 0", "decay_steps": ">= 0",
                                        "warmup_ratio": "[0, 1]", "decay_ratio": "[0, 1]", "min_lr_ratio": "[0, 1]"}

    def warmup(self, total: int) -> int:
        """Warmup steps of a run of ``total`` optimizer steps."""
        return self.warmup_steps if self.warmup_steps is not None else _fraction_of(self.warmup_ratio, total)

    def decay(self, total: int) -> int:
        """Steps of wsd's final decay in a run of ``total`` optimizer steps (0 for the other schedules)."""
        if self.schedule != "wsd":
            return 0
        return self.decay_steps if self.decay_steps is not None else _fraction_of(self.decay_ratio, total)


def _fraction_of(ratio: float, total: int) -> int:
    """Whole steps of ``ratio`` x ``total``, rounded down (so ratios that sum to <= 1 fit), and 0.1 x 300 is 30."""
    return math.floor(round(ratio * total, 6))


@dataclass
class BatchWarmupConfig:
    """The global batch's warmup (key ``train.batch_warmup``), as ModernBERT's and Ettin's: ``start`` of the batch
    at step 0, growing linearly to all of it at optimizer step ``steps``, in whole ``multiple``s of samples. The
    learning-rate schedule stays per optimizer step."""

    start: float = 0.25  # share of the global batch at step 0
    steps: int = 0  # optimizer steps until the whole batch (0: no warmup)
    # samples the batch grows by (0: train.micro_batch x the world size); a resume on another world size inside the
    # warmup needs the same batches, so set it to a multiple of micro_batch x each world size the run will use
    multiple: int = 0
    RANGES: ClassVar[dict[str, str]] = {"start": "(0, 1]", "steps": ">= 0", "multiple": ">= 0"}


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch: int = 4  # samples per rank per micro-step
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    peak_tflops: float = 0.0  # per device, for MFU; 0 = look up the GPU, none on CPU
    export_hf: bool = True  # write an HF directory at the end
    # also make that directory a sentence-transformers model (docs/export.md): the run's pooling, the layout that
    # library reproduces (the text alone for mean pooling), which the export's record then says for encode() too
    export_sentence_transformers: bool = False
    stop_at_step: int = 0  # checkpoint and exit after this global step (0: run to train.steps); e.g. to fit a time slot
    max_bad_steps: int = 3  # stop after this many steps in a row with a skipped update or a non-finite loss
    # where rank 0 logs the step's scalars besides metrics.jsonl (always written); pipeline/train/trackers.py
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    tracker_project: str = "decoder-encoders"  # the W&B project and the MLflow experiment; the run is `name`
    wandb_mode: Literal["online", "offline"] = "online"  # offline: RUN/wandb only, uploaded later by `wandb sync`
    mlflow_tracking_uri: str = ""  # "": a local store in the run directory (sqlite:///RUN/mlflow.db)
    batch_warmup: BatchWarmupConfig = field(default_factory=BatchWarmupConfig)  # docs/training.md, "Batch warmup"
    RANGES: ClassVar[dict[str, str]] = {"steps": ">= 1", "micro_batch": ">= 1", "grad_accum": ">= 1", "seed": ">= 0",
                                        "log_every": ">= 1", "peak_tflops": ">= 0", "stop_at_step": ">= 0",
                                        "max_bad_steps": ">= 1"}

    def validate(self) -> None:
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if twice:
            raise ConfigError(f"train.trackers: {twice[0]} is listed twice; name each tracker once")
        if not self.tracker_project.strip():
            raise ConfigError("train.tracker_project: empty; name the W&B project and MLflow experiment, e.g. "
                              "train.tracker_project=decoder-encoders")
        multiple = self.batch_warmup.multiple
        if multiple > 0 and multiple % self.micro_batch:
            raise ConfigError(f"train.batch_warmup.multiple: {multiple} samples are not whole micro-batches of "
                              f"train.micro_batch {self.micro_batch}; set a multiple of micro_batch x the world size")

    def global_batch(self, world: int, micro_batch: int | None = None) -> int:
        """Samples per optimizer step over ``world`` ranks: ``micro_batch`` (default ``train.micro_batch``; a phase's
        or the units' own) x ``grad_accum`` x ``world``, the one place this product is written."""
        return (micro_batch or self.micro_batch) * self.grad_accum * world


@dataclass
class CheckpointConfig:
    every: int = 50
    keep_last: int = 2
    keep_every: int = 0  # also keep every N-th step for good (0: none)
    resume: bool = True  # continue from the newest complete checkpoint in run_dir
    allow_global_batch_change: bool = False  # resume on a world size that changes the global batch
    # write the files in a background thread after a copy to host memory (pinned on CUDA): training goes on while
    # they are written; costs one more copy of each rank's checkpoint state in host memory
    async_save: bool = False
    # an eval/ scalar (eval/sts_avg, eval/loss/clm): its best step's checkpoint is kept from the keep_last rotation
    # and exported at the end to RUN/hf-best ("": none); keep_best_mode auto: higher is better for scores and
    # accuracies, lower for losses, perplexities and repetition rates (metric_mode)
    keep_best: str = ""
    keep_best_mode: Literal["auto", "max", "min"] = "auto"
    RANGES: ClassVar[dict[str, str]] = {"every": ">= 1", "keep_last": ">= 1", "keep_every": ">= 0"}




@dataclass
class EvaluatorConfig:
    """One task of ``launch/evaluate.py`` run on the model being trained at every validation (``eval.evaluators``,
    docs/training.md "Evaluators during training"); it logs that task's headline scores as ``eval/<key>``."""

    task: str  # one of pipeline.tasks.IN_TRAINING: sts, zero_shot_retrieval, clustering, infilling, repetition
    datasets: list[str] = field(default_factory=list)  # its data files (launch/evaluate.py --set TASK.datasets=...)
    options: dict[str, Any] = field(default_factory=dict)  # its other options, as --set TASK.KEY=VALUE

    def task_options(self, where: str) -> Any:
        """The task's typed options dataclass (``where``: the entry's config key, for errors)."""
        return from_dict(SPECS[self.task].options, {**self.options, "datasets": list(self.datasets)},
                         f"{where}.options")

    def check(self, where: str) -> None:
        """The task runs during training, it names data files and its options parse; else a ConfigError. Whether
        the files exist is preflight's check (:meth:`check_files`): a finished run's experiment loads without them."""
        if self.task not in IN_TRAINING:
            raise ConfigError(f"{where}.task: {self.task!r} does not run during training; choose one of "
                              f"{list(IN_TRAINING)} (launch/evaluate.py runs the others on an export)")
        if "datasets" in self.options:
            raise ConfigError(f"{where}.options.datasets: name the task's files in {where}.datasets instead")
        if not self.datasets:
            raise ConfigError(f"{where}.datasets: empty; name the {self.task} task's data files (their layout: "
                              f"docs/evaluation.md), e.g. {where}.datasets=[tests/fixtures/eval/sts/stsb.tsv]")
        self.task_options(where)

    def check_files(self, where: str) -> None:
        for i, path in enumerate(self.datasets):
            if not os.path.isfile(path):
                raise ConfigError(f"{where}.datasets[{i}]: {path}: no such file; name an existing {self.task} file "
                                  f"(relative to the directory training starts in)")


@dataclass
class ValidationConfig:
    """Validation during training (key ``eval``): a fixed set of held-out samples scored every ``every`` steps and
    at the end, with the phase's objectives and the fixed probes that compare runs across objectives and phases.
    Not ``pipeline.eval``'s config: that one evaluates an exported model."""

    every: int = 0  # steps between evaluations, and one at the end; 0: no validation
    shards: str = ""  # held-out shard directory; "": the `holdout` of data.shards, which training never reads
    holdout: float = 0.0  # fraction of each source's samples of data.shards (its last ones) held out when shards is ""
    samples: int = 256  # held-out samples scored each time (each source's first ones, in proportion; 0: all)
    micro_batch: int = 0  # rows per rank per forward (0: train.micro_batch)
    probes: bool = True  # CLM perplexity, MLM at 15 % (80-10-10), MNTP at 20 %, whatever the phase trains
    mask_token: str | None = None  # the probes' mask token (None: the tokenizer's), as objectives' mask_token
    # launch/evaluate.py's tasks run on the training model at every validation, logged as eval/<headline key>
    evaluators: list[EvaluatorConfig] = field(default_factory=list)
    RANGES: ClassVar[dict[str, str]] = {"every": ">= 0", "holdout": "[0, 1)", "samples": ">= 0",
                                        "micro_batch": ">= 0"}

    def validate(self) -> None:
        if self.shards and self.holdout:
            raise ConfigError(f"eval.holdout: {self.holdout} holds samples of data.shards out, but eval.shards "
                              f"({self.shards}) is the held-out directory; set one of them")
        if self.every and not (self.shards or self.holdout):
            raise ConfigError("eval.every: validation needs held-out samples; set eval.shards to a held-out shard "
                              "directory or eval.holdout to a fraction of data.shards (e.g. eval.holdout=0.01)")
        if self.evaluators and not self.every:
            raise ConfigError("eval.evaluators: they run at each validation; set eval.every (and eval.holdout or "
                              "eval.shards), e.g. eval.every=50 eval.holdout=0.01")
        for i, evaluator in enumerate(self.evaluators):
            evaluator.check(f"eval.evaluators[{i}]")


# The license ids the Hub accepts in a model card's `license` (those of
# https://huggingface.co/docs/hub/repositories-licenses; `other` for one not listed there), checked offline
HUB_LICENSES = frozenset("""
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0 bigcode-openrail-m
afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0
cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0
cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0
cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 eupl-1.2 agpl-3.0 gfdl
gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc h-research intel-research lppl-1.3c ms-pl apple-ascl apple-amlr
mpl-2.0 odc-by odbl openmdw-1.0 openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr
deepfloyd-if-license fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2 llama3.3 llama4 gemma
unknown other
""".split())


@dataclass
class ExportConfig:
    """What the model card of the run's HF exports tells the Hub (key ``export``; docs/export.md, "The model card").
    Never a local path: the card travels with the directory."""

    repo_id: str = ""  # the Hub repo the export goes to: the card's snippet loads it ("": the card's own directory)
    base_model: str = ""  # Hub id of the start model ("": the start model's card's or HF cache path's; none for a preset)
    license: str = ""  # Hub license id ("": the start model's card's; a preset start: apache-2.0, the project's own)
    datasets: list[str] = field(default_factory=list)  # Hub dataset ids of the training data (local data: none)

    def validate(self) -> None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        for key, value in (("repo_id", self.repo_id), ("base_model", self.base_model),
                           *((f"datasets.{i}", d) for i, d in enumerate(self.datasets))):
            if not value:
                continue
            try:
                validate_repo_id(value)
            except HFValidationError as e:
                raise ConfigError(f"export.{key}: {value!r} is not a Hub id ({e}); name it as namespace/name, "
                                  f"e.g. HuggingFaceTB/SmolLM2-135M") from None
            if key != "repo_id" and os.path.exists(value):
                raise ConfigError(f"export.{key}: {value!r} is a local path, which the Hub cannot link; name the "
                                  f"Hub id it came from (namespace/name), or leave it empty")
        if self.license and self.license not in HUB_LICENSES:
            near = difflib.get_close_matches(self.license.lower(), HUB_LICENSES, n=3, cutoff=0.5)
            raise ConfigError(f"export.license: {self.license!r} is not a Hub license id; "
                              + (f"did you mean {' or '.join(near)}? " if near else "")
                              + "the ids are those of https://huggingface.co/docs/hub/repositories-licenses "
                                "(pipeline/experiment/sections.py: HUB_LICENSES), e.g. apache-2.0 or mit")

