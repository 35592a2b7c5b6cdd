"""Every objective's typed config (the experiment's ``phases[i].objectives[j]``), apart from the objectives
themselves: loading and checking an experiment imports this module alone, so a config refusal is printed before
torch or transformers is imported (``pipeline.objectives`` loads the objectives on first use)."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pipeline.config import ConfigError
from pipeline.data.format.instructions import DEFAULT_FORMAT, check_format


@dataclass(frozen=True)
class Reading:
    """How a model this objective trained reads a text into one embedding: the pooling it trained (``encode()``'s
    and the export's default) and the instruction it trained before each text, if any. The export's record
    (``pipeline.export.record``) and the model card read it, so an embedding objective declares it here once."""

    pooling: str  # "mean" (over the text tokens) or "last" (the last token)
    instruction: str | None = None  # None: the objective trained without one
    instruction_format: str | None = None  # how an instruction joins a query, e.g. "{instruction}: "; None: verbatim


@dataclass
class BaseConfig:
    """The fields of every objective's config. Each objective's module defines its config on top, with ``name``
    fixed to one ``Literal`` so the experiment's ``{name: ..., ...}`` picks it (``pipeline.config.from_tagged``).
    Each config declares ``POOLING``: the pooling its objective trains embeddings with, None for an objective that
    trains no embedding (tests/unit/objectives/test_objectives.py holds every registered objective to it)."""

    name: str
    weight: float = 1.0  # weight of the objective's loss in the phase's sum
    log_as: str = ""  # the name its loss is logged (and normalised) under: set it for two objectives of one phase
    RANGES: ClassVar[dict[str, str]] = {"weight": "> 0"}
    POOLING: ClassVar[str | None]  # declared by each objective's config, no default: forgetting it fails the test

    def reading(self) -> Reading | None:
        """How the model this objective trains reads text into an embedding; None when it trains none."""
        return None if self.POOLING is None else Reading(self.POOLING)

    def nesting(self) -> Matryoshka | None:
        """The embedding dims this objective trains to stand alone (Matryoshka), None when it trains none."""
        return None

    def check_attention_dropout(self, dropout: float, where: str) -> None:
        """Refuse a ``model.attention_dropout`` this objective cannot train with (a config error at load time;
        contrastive objectives whose views differ by dropout alone need it > 0)."""
        return None

    def check_step(self, grad_accum: int, objectives: int, where: str) -> None:
        """Refuse a ``train.grad_accum`` or a phase of ``objectives`` objectives this objective cannot train with
        (a config error at load time; the supervised objective's contrastive batch spans the step)."""
        return None

    def check_schedule(self, where: str) -> None:
        """Refuse a schedule whose fields contradict its shape (a config error at load time; the masking ratio's)."""
        return None

    def check_embedding(self, where: str, hidden_size: int | None = None) -> None:
        """Refuse embedding options the model cannot train (a config error at load time, and again against the
        model's ``hidden_size`` once preflight knows it; contrastive objectives' Matryoshka dims)."""
        return None


def phase_fraction(step: int, steps: int) -> float:
    """Where step ``step`` (from 0) of a phase of ``steps`` steps lies in it: its first step at 0, its last at 1."""
    return step / (steps - 1) if steps > 1 else 0.0


@dataclass
class RatioSchedule:
    """The masking ratio across a phase (Ettin decays MLM's from 30 % to 15 % over its decay phase): a function of
    the step's place in its phase alone, so a resume, or a stop at any step, masks as the uninterrupted run does;
    the shards' plans serve any ratio, so no data is rebuilt.

    ``linear`` and ``cosine`` go from the objective's ``ratio`` to ``final`` between fractions ``start`` and ``end``
    of the phase (``ratio`` before, ``final`` after); ``step`` masks at the ratio of the last ``[fraction, ratio]``
    of ``steps`` the phase has reached (``ratio`` before the first); ``constant`` keeps ``ratio``."""

    shape: Literal["constant", "linear", "cosine", "step"] = "constant"
    final: float | None = None  # linear, cosine: the ratio at fraction ``end`` of the phase
    start: float | None = None  # linear, cosine: fraction of the phase where the change begins (unset: 0)
    end: float | None = None  # linear, cosine: fraction where it reaches ``final`` (unset: 1)
    steps: list[tuple[float, float]] = field(default_factory=list)  # step: [fraction, ratio] pairs, fractions rising
    RANGES: ClassVar[dict[str, str]] = {"final": "(0, 1]", "start": "[0, 1]", "end": "[0, 1]"}

    def check(self, where: str) -> None:
        """Refuse fields the shape does not use, or lacks (one line naming ``where``, the schedule's key)."""
        smooth = self.shape in ("linear", "cosine")
        unused = [k for k in ("final", "start", "end") if getattr(self, k) is not None and not smooth]
        unused += ["steps"] if self.steps and self.shape != "step" else []
        if unused:
            uses = {"constant": "keeps the objective's ratio", "step": "takes its ratios from steps"}.get(
                self.shape, "goes from ratio to final between start and end")
            raise ConfigError(f"{where}.{unused[0]}: shape {self.shape} {uses}; drop {unused[0]} or pick the shape "
                              f"that uses it (linear/cosine: final, start, end; step: steps)")
        if smooth and self.final is None:
            raise ConfigError(f"{where}.final: missing; shape {self.shape} goes from the objective's ratio to final, "
                              f"e.g. {where}.final=0.15")
        if smooth and not self.window[0] < self.window[1]:
            raise ConfigError(f"{where}: start {self.window[0]:g} must come before end {self.window[1]:g} (fractions "
                              f"of the phase), e.g. start: 0.5, end: 1.0 for its second half")
        if self.shape == "step" and not self.steps:
            raise ConfigError(f"{where}.steps: missing; shape step needs [fraction, ratio] pairs, e.g. "
                              f"steps: [[0.5, 0.2], [0.75, 0.15]]")
        for i, (fraction, ratio) in enumerate(self.steps):
            if not (0.0 <= fraction <= 1.0 and 0.0 < ratio <= 1.0) or (i and fraction <= self.steps[i - 1][0]):
                raise ConfigError(f"{where}.steps.{i}: [{fraction:g}, {ratio:g}] is not allowed; each pair is "
                                  f"[fraction in [0, 1], ratio in (0, 1]], each fraction above the one before")

    @property
    def window(self) -> tuple[float, float]:
        """(start, end): the fractions of the phase a linear or cosine change spans."""
        return (0.0 if self.start is None else self.start), (1.0 if self.end is None else self.end)

    def ratio_at(self, ratio: float, fraction: float) -> float:
        """The masking ratio at ``fraction`` of the phase, starting from the objective's ``ratio``."""
        if self.shape == "constant":
            return ratio
        if self.shape == "step":
            return next((r for f, r in reversed(self.steps) if fraction >= f), ratio)
        start, end = self.window
        t = min(max((fraction - start) / (end - start), 0.0), 1.0)
        if self.shape == "cosine":
            t = (1.0 - math.cos(math.pi * t)) / 2.0
        return ratio * (1.0 - t) + self.final * t  # ratio at t = 0 and final at t = 1 exactly


@dataclass
class MaskedConfig(BaseConfig):
    """The config fields of an objective that reads the batch's masking plan (MLM, MNTP, MAGNET)."""

    ratio: float = 0.3  # masking ratio (a schedule's start value); any value in (0, 1] from the same shards
    policy: Literal["80-10-10", "mask"] = "80-10-10"  # replacement of masked tokens: BERT's split, or all [MASK]
    mask_token: str | None = None  # None: the tokenizer's mask token; or an ordinary token such as "_" (LLM2Vec)
    ratio_schedule: RatioSchedule = field(default_factory=RatioSchedule)  # the ratio across the phase
    RANGES: ClassVar[dict[str, str]] = {**BaseConfig.RANGES, "ratio": "(0, 1]"}

    def check_schedule(self, where: str) -> None:
        self.ratio_schedule.check(f"{where}.ratio_schedule")

    def ratio_at_step(self, step: int, steps: int) -> float:
        """The masking ratio of step ``step`` (from 0) of a phase of ``steps`` steps."""
        return self.ratio_schedule.ratio_at(self.ratio, phase_fraction(step, steps))

    def mean_ratio(self, steps: int) -> float:
        """The mean masking ratio over a phase of ``steps`` steps (the planner's share of tokens through the head)."""
        if self.ratio_schedule.shape == "constant":
            return self.ratio
        return math.fsum(self.ratio_at_step(i, steps) for i in range(steps)) / steps


@dataclass
class Matryoshka:
    """Embedding dims trained to stand alone (sentence-transformers' ``matryoshka_dims`` / ``matryoshka_weights``),
    so an export can be cut to any of them (``encode(..., dim=)``, ``truncate_dim``)."""

    dims: tuple[int, ...] = ()  # strictly descending, each <= the model's hidden size (e.g. [768, 256, 64])
    weights: tuple[float, ...] = ()  # one per dim (empty: 1 each, sentence-transformers' default)
    RANGES: ClassVar[dict[str, str]] = {"dims": ">= 1", "weights": "> 0"}

    def check(self, where: str, hidden_size: int | None = None) -> None:
        """One line naming ``where`` (the ``matryoshka`` key) and the fix; ``hidden_size`` where the model is known."""
        if not self.dims:
            raise ConfigError(f"{where}.dims: missing; list the embedding dims to train, largest first, e.g. "
                              f"{where}.dims=[256,128,64]")
        if any(a <= b for a, b in zip(self.dims, self.dims[1:])):
            raise ConfigError(f"{where}.dims: {list(self.dims)} must descend strictly; write them largest first, "
                              f"e.g. {sorted(set(self.dims), reverse=True)}")
        if self.weights and len(self.weights) != len(self.dims):
            raise ConfigError(f"{where}.weights: {len(self.weights)} weight(s) for {len(self.dims)} dims; give one "
                              f"per dim, e.g. {[1.0] * len(self.dims)}, or leave weights out (1 each)")
        if hidden_size is not None and self.dims[0] > hidden_size:
            fitting = [d for d in self.dims if d <= hidden_size] or [hidden_size]
            raise ConfigError(f"{where}.dims: {self.dims[0]} is above the model's hidden size {hidden_size}; use "
                              f"dims of at most {hidden_size}, e.g. {fitting}")

    def terms(self) -> list[tuple[int, float]]:
        """(dim, weight) of each InfoNCE term."""
        return list(zip(self.dims, self.weights or [1.0] * len(self.dims)))


@dataclass
class ContrastiveConfig(BaseConfig):
    """The fields every InfoNCE objective shares (SimCSE, SSCL, supervised)."""

    matryoshka: Matryoshka | None = None  # None: one InfoNCE on the full embedding

    def check_embedding(self, where: str, hidden_size: int | None = None) -> None:
        if self.matryoshka is not None:
            self.matryoshka.check(f"{where}.matryoshka", hidden_size)

    def nesting(self) -> Matryoshka | None:
        return self.matryoshka


@dataclass
class CLMConfig(BaseConfig):
    name: Literal["clm"] = "clm"
    POOLING: ClassVar[str | None] = None


@dataclass
class MLMConfig(MaskedConfig):
    name: Literal["mlm"] = "mlm"
    POOLING: ClassVar[str | None] = None


@dataclass
class MNTPConfig(MaskedConfig):
    name: Literal["mntp"] = "mntp"
    POOLING: ClassVar[str | None] = None


@dataclass
class MagnetConfig(MaskedConfig):
    """``mntp_weight`` / ``msg_weight`` are the paper's lambda1 / lambda3 (the trainer multiplies them by ``weight``);
    0 turns a loss off. ``own_span_only``: span tokens attend to earlier tokens of their own span only, instead of
    all earlier span tokens of the document."""

    name: Literal["magnet"] = "magnet"
    mntp_weight: float = 1.0
    msg_weight: float = 1.0
    own_span_only: bool = False
    POOLING: ClassVar[str | None] = None

    def validate(self) -> None:
        if min(self.mntp_weight, self.msg_weight) < 0 or self.mntp_weight + self.msg_weight == 0:
            raise ConfigError(f"magnet: mntp_weight and msg_weight must be >= 0 and not both 0, got "
                              f"{self.mntp_weight} and {self.msg_weight}; drop the objective instead")


@dataclass
class SimCSEConfig(ContrastiveConfig):
    name: Literal["simcse"] = "simcse"
    scale: float = 20.0  # InfoNCE logit scale, 1 / temperature
    RANGES: ClassVar[dict[str, str]] = {**ContrastiveConfig.RANGES, "scale": "> 0"}
    POOLING: ClassVar[str | None] = "mean"  # over the unit's text tokens, as LLM2Vec's encode()

    def check_attention_dropout(self, dropout: float, where: str) -> None:
        if not dropout:
            raise ConfigError(f"{where} (simcse): the two views of a unit differ by dropout alone, but "
                              f"model.attention_dropout is 0, so they would be identical; set model.attention_dropout "
                              f"(LLM2Vec: 0.3)")


INSTRUCTION = "Given the sentence, find its representation:"


Augment = Literal["dropout", "delete", "crop", "swap", "paraphrase"]  # dropout, the token EDITS, paraphrase


AUGMENTS = typing.get_args(Augment)


@dataclass
class SSCLConfig(ContrastiveConfig):
    """``scale`` is 1 / temperature (20: tau = 0.05, as SimCSE and LLM2Vec); ``seed`` seeds the token edits."""

    name: Literal["sscl"] = "sscl"
    augment: Augment = "dropout"  # how x+ is made (module docstring)
    edit_ratio: float = 0.1  # share of tokens a token edit changes
    scale: float = 20.0
    instruction: str = INSTRUCTION
    seed: int = 0
    RANGES: ClassVar[dict[str, str]] = {**ContrastiveConfig.RANGES, "edit_ratio": "(0, 1)", "scale": "> 0",
                                        "seed": ">= 0"}
    POOLING: ClassVar[str | None] = "last"  # MAGNET's: the last token, after the instruction

    def reading(self) -> Reading:
        return Reading(self.POOLING, self.instruction)  # type: ignore[arg-type]

    def check_attention_dropout(self, dropout: float, where: str) -> None:
        if self.augment == "dropout" and not dropout:
            raise ConfigError(f"{where} (sscl): augment 'dropout' makes x+ differ from x by dropout alone, but "
                              f"model.attention_dropout is 0, so both views would be identical; set "
                              f"model.attention_dropout (e.g. 0.1; LLM2Vec's SimCSE uses 0.3) or pick another "
                              f"augment ({', '.join(a for a in AUGMENTS if a != 'dropout')})")


@dataclass
class TokenChunks:
    """GradCache's chunks cut by tokens, not by micro-batch (sentence-transformers' ``mini_batch_num_tokens``): the
    step's rows in order, each chunk as many as fit in ``tokens`` real (unpadded) tokens, a longer row alone, so a
    chunk of short rows holds more of them and long and short rows cost alike (``pipeline/train/grad_cache.py``)."""

    tokens: int | None = None  # a chunk's budget: its rows' real tokens, all slots (query, positive, negatives)
    RANGES: ClassVar[dict[str, str]] = {"tokens": ">= 1"}


@dataclass
class SupervisedConfig(ContrastiveConfig):
    name: Literal["supervised"] = "supervised"
    scale: float = 50.0  # InfoNCE logit scale, 1 / temperature (LLM2Vec's supervised loss_scale)
    hard_negatives: bool = True  # score every row's hard negatives too (LLM2Vec); false: in-batch positives only
    # false: each query against its own positive and hard negatives only, no other row's (NV-Embed's stage 2)
    in_batch_negatives: bool = True
    mask_collisions: bool = True  # leave a query's false negatives (its positive's text elsewhere) out of its softmax
    # the step's grad_accum micro-batches form one contrastive batch (GradCache), chunked by micro-batch (true) or
    # by a token budget ({tokens: N})
    grad_cache: bool | TokenChunks = False
    # how the pair shards joined instructions to texts (checked against their manifest); recorded in the export
    # so encode(), sentence-transformers and MTEB format a task's instruction the same way
    instruction_format: str = DEFAULT_FORMAT
    instruction: str = ""  # the export's default query instruction ("": none), formatted as above
    RANGES: ClassVar[dict[str, str]] = {**ContrastiveConfig.RANGES, "scale": "> 0"}
    POOLING: ClassVar[str | None] = "mean"  # each slot over its text tokens, the instruction left out

    def reading(self) -> Reading:
        return Reading(self.POOLING, self.instruction or None, self.instruction_format)  # type: ignore[arg-type]

    def validate(self) -> None:
        try:
            check_format(self.instruction_format)
        except ValueError as e:
            raise ConfigError(f"instruction_format: {e}") from None

    def check_embedding(self, where: str, hidden_size: int | None = None) -> None:
        """Matryoshka's dims, and that the negatives leave something to score: without in-batch negatives only the
        hard ones are left. (Whether the pair shards hold hard negatives is preflight's check.)"""
        super().check_embedding(where, hidden_size)
        if not self.in_batch_negatives and not self.hard_negatives:
            raise ConfigError(f"{where}.in_batch_negatives: false leaves each query its own hard negatives only, and "
                              f"{where}.hard_negatives is false: no negative is left; set {where}.hard_negatives=true "
                              f"(or {where}.in_batch_negatives=true)")

    def check_step(self, grad_accum: int, objectives: int, where: str) -> None:
        if isinstance(self.grad_cache, TokenChunks) and self.grad_cache.tokens is None:
            raise ConfigError(f"{where}.grad_cache.tokens: missing; give each chunk's token budget, e.g. "
                              f"{where}.grad_cache={{tokens: 4096}}, or set {where}.grad_cache=true (a chunk per "
                              f"micro-batch)")
        if self.grad_cache and objectives > 1:
            raise ConfigError(f"{where} (supervised): grad_cache runs the step's micro-batches itself, so it must be "
                              f"the phase's only objective; give the other objectives a phase of their own")
        if grad_accum > 1 and not self.grad_cache:
            raise ConfigError(f"{where} (supervised): train.grad_accum {grad_accum} would make each micro-step its "
                              f"own contrastive batch, with fewer negatives than the step's rows; set "
                              f"{where}.grad_cache=true (one contrastive batch over the micro-steps) or "
                              f"train.grad_accum=1")


@dataclass
class DistillConfig(BaseConfig):
    name: Literal["distill"] = "distill"
    teacher: str = ""  # required: the directory data_prep/teacher_embed.py wrote (its default: <pair shards>/teacher)
    embedding_loss: Literal["cosine", "mse"] = "cosine"  # student-to-teacher term (projected where dims differ)
    embedding_weight: float = 1.0  # weight of that term
    kl_weight: float = 1.0  # weight of KL(teacher || student) over each query's in-batch similarities
    temperature: float = 0.05  # of both softmaxes over cosine similarities
    RANGES: ClassVar[dict[str, str]] = {**BaseConfig.RANGES, "embedding_weight": ">= 0", "kl_weight": ">= 0",
                                        "temperature": "> 0"}
    POOLING: ClassVar[str | None] = "mean"  # each text over its text tokens (pool_spans), as supervised

    def check_embedding(self, where: str, hidden_size: int | None = None) -> None:
        if not self.teacher:
            raise ConfigError(f"{where}.teacher: missing; name the directory data_prep/teacher_embed.py wrote, e.g. "
                              f"{where}.teacher=data/pairs-shards/teacher")
        if self.embedding_weight == 0 and self.kl_weight == 0:
            raise ConfigError(f"{where}.embedding_weight and {where}.kl_weight are both 0: nothing to train; set "
                              "either above 0")


# an experiment's objective: its ``name`` picks the config (pipeline.config.from_tagged)
ObjectiveConfig = (CLMConfig | MLMConfig | MNTPConfig | MagnetConfig | SSCLConfig | SimCSEConfig | SupervisedConfig
                   | DistillConfig)
