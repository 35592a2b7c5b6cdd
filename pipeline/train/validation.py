"""Validation during training: the fixed held-out samples scored with the phase's objectives and the fixed probes.

The probes compare runs whatever they train: CLM perplexity, MLM at 15 % with the 80-10-10 policy (ModernBERT's
and Ettin's setting) and MNTP at 20 %, each the training objective itself built from its config. The masks come
from the shards' precomputed plans, so every evaluation scores the same masked positions. Every rank runs the same
forwards (``iter_eval`` pads the last round), and the sums of losses, targets and correct predictions are reduced
once, so the numbers do not depend on the number of ranks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.data.format.index import ShardKind
from pipeline.data.loading.holdout import ValidationSamples
from pipeline.data.loading.loader import iter_eval
from pipeline.experiment import ValidationConfig
from pipeline.objectives import CLMConfig, MLMConfig, MNTPConfig, make_objective
from pipeline.tokenizer import Tokenizer
from pipeline.train.phases import WeightedObjective


def probes(config: ValidationConfig, tokenizer: Tokenizer) -> list[WeightedObjective]:
    """The fixed probes, named by objective and ratio (``eval/probe/mlm15``)."""
    specs = {"clm": CLMConfig(), "mlm15": MLMConfig(ratio=0.15, policy="80-10-10", mask_token=config.mask_token),
             "mntp20": MNTPConfig(ratio=0.2, policy="80-10-10", mask_token=config.mask_token)}
    return [WeightedObjective(spec.name, 1.0, make_objective(spec, tokenizer), name) for name, spec in specs.items()]


def forward_of(o: WeightedObjective) -> str:
    """What the objective's forward computes: its class, its config but for the loss's weight and name, and its
    attention. Objectives alike in these (a phase's CLM and the CLM probe) run once and are logged under both names."""
    config = dataclasses.replace(o.objective.config, weight=1.0, log_as="")
    return repr((type(o.objective).__name__, config, o.objective.document_masking))


def scored(phase: list[WeightedObjective], probes: list[WeightedObjective]) -> list[tuple[str, str, WeightedObjective]]:
    """What a validation scores, with the names of its loss and accuracy scalars: the phase's objectives that read
    packed samples (``loss``, ``acc``), and the probes (``probe``, ``probe_acc``)."""
    return [("loss", "acc", o) for o in phase if o.objective.shard_kind == ShardKind.PACKED] + [
        ("probe", "probe_acc", p) for p in probes]


def logged(phase: list[WeightedObjective], probes: list[WeightedObjective],
           sources: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """The ``eval/`` scalars :meth:`Validator.run` logs for ``phase`` on held-out shards of ``sources``: (at every
    validation, only at those that scored the source: each source's scalars, with several)."""
    always, sometimes = set(), set()
    for kind, acc, o in scored(phase, probes):
        for name in map(o.loss_name, o.objective.loss_weights):
            always |= {f"eval/{kind}/{name}", f"eval/{acc}/{name}"}
            sometimes |= {f"eval/source_{kind}/{name}/{src}" for src in sources if len(sources) > 1}
    return always | ({"eval/probe_ppl/clm"} if "eval/probe/clm" in always else set()), sometimes


@dataclass(frozen=True)
class ValidationSpec:
    """What a validation scores and how, as preflight decided it (when: the plan's ``validate_every``)."""

    samples: ValidationSamples
    probes: tuple[WeightedObjective, ...]
    micro_batch: int  # rows per rank per forward
    verify: bool  # data.verify_shards: checked on the first evaluation, which reads every held-out sample


class Validator:
    def __init__(self, spec: ValidationSpec):
        self.samples, self.probes, self.micro_batch = spec.samples, list(spec.probes), spec.micro_batch
        self.verify = spec.verify  # until the first evaluation has read every held-out sample

    @torch.no_grad()
    def run(self, engine, phase: list[WeightedObjective], device: torch.device) -> dict[str, float]:
        """``eval/loss/<name>`` and ``eval/acc/<name>`` of the phase's objectives that read packed samples,
        ``eval/probe/<probe>`` and ``eval/probe_acc/<probe>``, ``eval/probe_ppl/clm``, and ``eval/seconds``; for
        held-out shards of several sources also ``eval/source_loss/<name>/<source>`` and
        ``eval/source_probe/<probe>/<source>`` (what :func:`logged` lists).
        Dropout is off while it runs (eval mode) and the engine is back in train mode after."""
        started = time.time()
        scores = scored(phase, self.probes)
        forwards = {forward_of(o): o.objective for _, _, o in scores}
        sums: dict[tuple[str, str, str], torch.Tensor] = {}
        h = self.samples
        sources = h.index.sources
        by_source: dict[tuple[str, str, str], torch.Tensor] = {}  # with sources: [S, 2] loss sum, targets
        engine.eval()
        try:
            for batch in iter_eval(h.index, self.micro_batch, dist.get_rank(), dist.get_world_size(),
                                   verify=self.verify, first=h.first, count=h.count, ids=h.ids):
                batch = batch.to(device)
                outputs = {f: engine(objective, batch) for f, objective in forwards.items()}
                for kind, acc, o in scores:
                    for own, out in outputs[forward_of(o)].items():
                        key = (kind, acc, o.loss_name(own))
                        total = torch.stack([t.detach().double() for t in (out.loss_sum, out.num_targets,
                                                                           out.num_correct)])
                        sums[key] = sums[key] + total if key in sums else total
                        if out.row_loss is not None:  # each row's loss and targets: the batch has source ids
                            into = by_source.setdefault(key, torch.zeros(len(sources), 2, dtype=torch.float64,
                                                                         device=device))
                            into.index_add_(0, batch.source_ids.clamp(min=0),
                                            torch.stack([out.row_loss.double(), out.row_targets.double()], -1))
        finally:
            engine.train()
        self.verify = False
        keys, source_keys = list(sums), list(by_source)
        reduced = torch.cat([torch.stack([sums[k] for k in keys]).flatten(),
                             *(by_source[k].flatten() for k in source_keys)])
        dist.all_reduce(reduced)
        values = reduced.tolist()
        scalars: dict[str, float] = {}
        for i, (kind, acc, name) in enumerate(keys):
            loss, targets, correct = values[3 * i : 3 * i + 3]
            scalars[f"eval/{kind}/{name}"] = loss / max(targets, 1.0)
            scalars[f"eval/{acc}/{name}"] = correct / max(targets, 1.0)
        per_source = values[3 * len(keys):]
        for i, (kind, _, name) in enumerate(source_keys):
            for j, src in enumerate(sources):
                loss, targets = per_source[2 * (i * len(sources) + j) : 2 * (i * len(sources) + j) + 2]
                if targets:
                    scalars[f"eval/source_{kind}/{name}/{src}"] = loss / targets
        if "eval/probe/clm" in scalars:
            scalars["eval/probe_ppl/clm"] = math.exp(scalars["eval/probe/clm"])
        return scalars | {"eval/seconds": time.time() - started}
