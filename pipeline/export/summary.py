"""The model card's account of training in words: what each phase's objectives did (masking ratio and policy,
contrastive views, loss weights), on which data, for how many steps, and the optimiser around them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.data.format.index import ShardKind
from pipeline.data.format.teacher import RECORD, TeacherError, read_record
from pipeline.experiment import ExperimentConfig
from pipeline.export.hub import local_name
from pipeline.objectives import (
    OBJECTIVES,
    DistillConfig,
    MagnetConfig,
    MaskedConfig,
    ObjectiveConfig,
    SimCSEConfig,
    SSCLConfig,
    SupervisedConfig,
)
from pipeline.objectives.configs import Matryoshka

POOLED = {"mean": "mean-pooled states", "last": "the last token"}  # an objective's declared POOLING in words
POLICIES = {"80-10-10": "80% replaced by the mask token, 10% by a random token, 10% kept",
            "mask": "all replaced by the mask token"}
PREDICTS = {"mlm": "each predicted at its own position (BERT)",
            "mntp": "each predicted from the position before it (LLM2Vec's masked next-token prediction)"}


def _masking(o: MaskedConfig) -> str:
    """The masked share of tokens, across the phase when a schedule changes it, and the replacement policy."""
    s = o.ratio_schedule
    if s.shape in ("linear", "cosine"):
        start, end = s.window
        span = "over the phase" if (start, end) == (0.0, 1.0) else f"between {start:.0%} and {end:.0%} of the phase"
        change = f" (going to {s.final:.0%}, {s.shape}, {span})"
    elif s.shape == "step":
        change = " (then " + ", ".join(f"{r:.0%} from {f:.0%} of the phase" for f, r in s.steps) + ")"
    else:
        change = ""
    token = f" (mask token {o.mask_token!r})" if o.mask_token else ""
    return f"{o.ratio:.0%} of the tokens masked{change}, {POLICIES[o.policy]}{token}"


def _masked(o: MaskedConfig) -> str:
    return f"{o.name.upper()}: {_masking(o)}, {PREDICTS[o.name]}"


def _magnet(o: MagnetConfig) -> str:
    return (f"MAGNET: masked next-token prediction on the context ({_masking(o)}; weight {o.mntp_weight:g}) and "
            f"generation of the missing spans from the context (weight {o.msg_weight:g}) in one pass")


def _info_nce(scale: float, m: Matryoshka | None, pooled: str = "") -> str:
    """A contrastive objective's InfoNCE: on what, at which scale, and over which leading dims (Matryoshka)."""
    on = f" on {pooled}" if pooled else ""
    if m is None:
        return f"InfoNCE{on}, scale {scale:g}"
    weights = "" if not m.weights else " (weights " + ", ".join(f"{w:g}" for _, w in m.terms()) + ")"
    return (f"InfoNCE{on}, scale {scale:g}, summed over the leading {', '.join(map(str, m.dims))} dims{weights} "
            f"(Matryoshka: an export cut to any of them stands alone)")


def _simcse(o: SimCSEConfig) -> str:
    return (f"unsupervised SimCSE: each sentence against its own copy under other dropout, the batch's other "
            f"sentences the negatives ({_info_nce(o.scale, o.matryoshka, POOLED[o.POOLING])})")


def _sscl(o: SSCLConfig) -> str:
    return (f"MAGNET's self-supervised contrastive learning: each sentence against its {o.augment} view, "
            f"both after the instruction {o.instruction!r} ({_info_nce(o.scale, o.matryoshka, POOLED[o.POOLING])})")


def _supervised(o: SupervisedConfig) -> str:
    negatives = ("its own hard negatives (no other rows')" if not o.in_batch_negatives else
                 "its hard negatives and the batch's other positives" if o.hard_negatives else
                 "the batch's other positives")
    collisions = "; a candidate with the text of the query's own positive left out" if o.mask_collisions else ""
    by = ("a chunk per micro-batch" if o.grad_cache is True else
          f"chunks of at most {o.grad_cache.tokens} real tokens" if o.grad_cache else None)
    chunks = f"; the step's micro-batches one contrastive batch (GradCache, {by})" if by else ""
    return (f"supervised contrastive learning: each query against its positive, {negatives} the negatives "
            f"({_info_nce(o.scale, o.matryoshka)}{collisions}){chunks}")


def _distill(o: DistillConfig) -> str:
    distance = "1 - cosine" if o.embedding_loss == "cosine" else "mean squared error"
    return (f"embedding distillation from {teacher_words(o.teacher)}: each text's {distance} to the teacher's "
            f"embedding (weight {o.embedding_weight:g}) and the KL divergence of the student's in-batch "
            f"query-candidate similarities from the teacher's at temperature {o.temperature:g} (weight "
            f"{o.kl_weight:g})")


# each objective's words by its name (tests/unit/export/test_summary.py holds every registered objective to them);
# its pooling in words is the one its config declares (POOLING)
WORDS: dict[str, Callable[[Any], str]] = {
    "clm": lambda o: "causal language modelling: every token predicted from the ones before it",
    "magnet": _magnet, "mlm": _masked, "mntp": _masked, "simcse": _simcse, "sscl": _sscl,
    "supervised": _supervised, "distill": _distill}


def objective_words(o: ObjectiveConfig) -> str:
    """One objective as a sentence fragment."""
    return WORDS[o.name](o) + (f"; loss weight {o.weight:g}" if o.weight != 1 else "")


def teacher_words(directory: str) -> str:
    """The teacher as its record names it (its path, how it was read, its width), or its directory when the record
    is not where the run read it (an export made elsewhere)."""
    try:
        record = read_record(directory)
    except (TeacherError, OSError):
        return f"the teacher embeddings in `{local_name(directory)}` ({RECORD} not found at export)"
    t = record["teacher"]
    return (f"the teacher `{local_name(t['path'])}` ({t['encoder']} encoder, {record['dim']} dims, "
            f"{record['pooling']} pooling)")


def _data(exp: ExperimentConfig, i: int, o: ObjectiveConfig) -> str:
    kind = OBJECTIVES[o.name].shard_kind
    if kind == ShardKind.UNITS:
        return f"sentence units of `{local_name(exp.data.unit_shards)}`"
    if kind == ShardKind.PAIRS:
        return f"training pairs of `{local_name(exp.data.pair_shards)}`"
    data = exp.phase_data(i)
    theta = f", RoPE θ {data.rope_theta:g}" if data.rope_theta is not None else ""
    return f"`{local_name(data.shards)}` at sequence length {data.seq_len}{theta}"


def phases(exp: ExperimentConfig) -> str:
    """A Markdown list: each phase's steps, attention, objectives and data."""
    lines = []
    for i, (p, steps) in enumerate(zip(exp.phases, exp.phase_lengths())):
        causal = all(OBJECTIVES[o.name].causal for o in p.objectives)
        data = sorted({_data(exp, i, o) for o in p.objectives})
        lines.append(f"- **{p.name}** ({steps} steps, {p.share:.0%} of the run; "
                     f"{'causal' if causal else 'bidirectional'} attention; data: {', '.join(data)}):\n"
                     + "\n".join(f"  - {objective_words(o)}" for o in p.objectives))
    return "\n".join(lines)


def optimiser(exp: ExperimentConfig) -> str:
    """The optimiser and learning-rate schedule in one sentence."""
    o, steps = exp.optim, exp.train.steps
    decay = f", {o.decay(steps)} decay steps" if o.schedule == "wsd" else ""
    return (f"AdamW (peak learning rate {o.lr:g}, weight decay {o.weight_decay:g}), {o.schedule} schedule with "
            f"{o.warmup(steps)} warmup steps{decay}; {exp.train.micro_batch} samples per rank per micro-step, "
            f"{exp.train.grad_accum} micro-step(s) per step; seed {exp.train.seed}.")
