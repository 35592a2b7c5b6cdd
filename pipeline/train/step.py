"""One optimizer step: the objectives of a phase on their batches, losses normalised over the global batch.

The loop around it (data, checkpoints, metrics, stop signals) is :class:`pipeline.train.trainer.Trainer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.train.phases import WeightedObjective


def train_step(engine, step_objs: list[WeightedObjective], batches: dict[str, list], world: int,
               grad_accum: int) -> tuple[dict[str, float], dict[str, float], float]:
    """One optimizer step over ``grad_accum`` micro-steps; returns (loss per output, accuracy per output, lr).

    Every loss is normalised by its target count over the whole global batch (all ranks, all micro-steps), so
    the step equals one big-batch step whatever the split; DeepSpeed averages gradients over ranks and
    micro-steps, hence the ``world * grad_accum`` factor.
    """
    counts: dict[str, float] = {}
    weights: dict[str, float] = {}
    for o in step_objs:
        for b in batches[o.objective.source]:
            for own, n in o.objective.num_targets(b).items():
                name = o.loss_name(own)
                counts[name] = counts.get(name, 0.0) + float(n)
                weights[name] = o.weight * o.objective.loss_weights[own]
    names = list(counts)
    device = next(engine.module.parameters()).device
    total = torch.tensor([counts[n] for n in names], device=device)
    dist.all_reduce(total)
    total = dict(zip(names, total.clamp(min=1).tolist()))
    sums = torch.zeros(len(names), 2, device=device)
    lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves on inside the last step()
    for micro in range(grad_accum):
        loss = 0.0
        for o in step_objs:
            for own, (loss_sum, _, correct) in engine(o.objective, batches[o.objective.source][micro]).items():
                name = o.loss_name(own)
                loss = loss + weights[name] * loss_sum * (world * grad_accum / total[name])
                sums[names.index(name)] += torch.stack([loss_sum.detach().float(), correct.float()])
        engine.backward(loss)
        engine.step()
    dist.all_reduce(sums)
    return ({n: sums[i, 0].item() / total[n] for i, n in enumerate(names)},
            {n: sums[i, 1].item() / total[n] for i, n in enumerate(names)}, lr)
