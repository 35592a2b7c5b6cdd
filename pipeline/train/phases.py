"""A phase's objectives, built once from the experiment config and the tokenizer."""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.data.format.index import ShardKind
from pipeline.experiment import PhaseSpec
from pipeline.model.moe import ROUTER_AUX
from pipeline.objectives import Objective, make_objective
from pipeline.objectives.base import MaskTokenError


@dataclass(frozen=True)
class WeightedObjective:
    name: str
    weight: float
    objective: Objective
    log_as: str = ""  # the config's ``log_as``: its losses' names in the phase (``loss/<name>``)

    def loss_name(self, loss: str) -> str:
        """The phase's name of the objective's ``loss``: ``log_as`` for a one-loss objective, ``log_as/loss`` for
        one with several (MAGNET's ``mntp`` and ``msg``). An MoE model's router loss is the model's, one for the
        phase."""
        if not self.log_as or loss == ROUTER_AUX:
            return loss
        return self.log_as if list(self.objective.loss_weights) == [self.objective.name] else f"{self.log_as}/{loss}"


# tried in order when a mask token is missing: one of them usually is a single token of the vocabulary
MASK_TOKEN_CANDIDATES = ("<mask>", "[MASK]", "_", "▁_", "<unk>")


def suggest_mask_token(tokenizer, wanted: str | None) -> str:
    """A token that exists in ``tokenizer``: the closest to ``wanted``, else a usual mask stand-in."""
    vocab = tokenizer.hf.get_vocab()
    close = difflib.get_close_matches(wanted, list(vocab), n=1) if wanted else []
    found = close or [t for t in MASK_TOKEN_CANDIDATES if t in vocab]
    return found[0] if found else tokenizer.hf.convert_ids_to_tokens(int(tokenizer.regular_ids()[0]))


def build_objectives(phase: PhaseSpec, tokenizer, key: str = "phase") -> list[WeightedObjective]:
    """``key`` names the phase in errors (``phases[1]``)."""
    out = []
    for j, spec in enumerate(phase.objectives):
        where = f"{key}.objectives[{j}]"
        try:  # a masking objective resolves its mask token (objectives.base.resolve_mask_id) as it is made
            # from its own copy of its config: training reads the objective, never the experiment
            objective = make_objective(copy.deepcopy(spec), tokenizer, phase.document_masking)
        except MaskTokenError as e:
            raise ConfigError(f"{where}.mask_token: {e.what}; set it to a token of its vocabulary, e.g. "
                              f"{where}.mask_token={suggest_mask_token(tokenizer, spec.mask_token)!r}") from None
        out.append(WeightedObjective(spec.name, spec.weight, objective, spec.log_as))
    check_loss_names(out, key)
    return out


def check_loss_names(objectives: list[WeightedObjective], key: str) -> None:
    """Each loss of a phase needs its own name: the step normalises, weighs and logs losses by name, so two
    objectives with one name (two ``mlm`` at different ratios, ``mntp`` beside MAGNET's ``mntp``) would merge."""
    seen: dict[str, int] = {}
    for j, o in enumerate(objectives):
        for loss in o.objective.loss_weights:
            name = o.loss_name(loss)
            if name in seen:
                raise ConfigError(f"{key}.objectives[{j}]: its loss {name!r} has the name of a loss of "
                                  f"{key}.objectives[{seen[name]}], so the two would be merged; give one of them its "
                                  f"own name, e.g. {key}.objectives[{j}].log_as={o.name}{j}")
            seen[name] = j


def at_step(objectives: list[WeightedObjective], step: int, steps: int) -> dict[str, float]:
    """Give the phase's objectives the settings of its ``step`` (from 0) of ``steps`` (the masking-ratio
    schedules); the ``mask_ratio/<loss>`` scalars of the step's masked losses."""
    ratios = {}
    for o in objectives:
        o.objective.at_phase_step(step, steps)
        ratios |= {f"mask_ratio/{o.loss_name(loss)}": o.objective.masking.ratio
                   for loss in (o.objective.masked_losses if o.objective.masks else ())}
    return ratios


def shard_kind_readers(objectives: list[list[WeightedObjective]]) -> dict[ShardKind, list[str]]:
    """Each shard kind -> the objectives of any phase that read it."""
    return {kind: sorted({o.name for phase in objectives for o in phase if o.objective.shard_kind == kind})
            for kind in ShardKind}
