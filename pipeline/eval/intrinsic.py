"""Intrinsic tasks on held-out shards: CLM perplexity, and MLM / MNTP loss and accuracy at a masking ratio.

The losses are the training objectives themselves (``pipeline.objectives``) over every sample of a shard directory
built by ``data_prep/build_shards.py`` from held-out text with the model's tokenizer (``iter_eval``: each sample
once, in stored order). Losses are summed over all targets and divided once, so the numbers do not depend on the
batch size. The masks come from the shards' precomputed plans, so every model is scored on the same masked tokens.
"""

from __future__ import annotations

import math
import os

import torch
from tqdm import tqdm

from pipeline.data.format.index import check_compatible, load_index
from pipeline.data.loading.loader import iter_eval
from pipeline.eval.task import EvalContext, Task
from pipeline.objectives import CLMConfig, MaskedConfig, MLMConfig, MNTPConfig, make_objective
from pipeline.tasks import SPECS, HeldOutOptions, MaskedHeldOutOptions


@torch.no_grad()
def score(ctx: EvalContext, objective, opts: HeldOutOptions) -> dict:
    """Summed loss, targets and correct predictions of ``objective`` over the held-out shards."""
    path = opts.shards if os.path.isabs(opts.shards) else os.path.join(ctx.data_dir, opts.shards)
    index = load_index(path)
    check_compatible(index, ctx.model.tokenizer.info.fingerprint, index.seq_len)
    total = math.ceil(index.num_samples / ctx.batch_size)
    if opts.max_batches:
        total = min(total, opts.max_batches)
    loss = targets = correct = 0.0
    for i, batch in enumerate(tqdm(iter_eval(index, ctx.batch_size), total=total, desc=objective.name,
                                   disable=not ctx.progress, leave=False)):
        if i == total:
            break
        out = objective(ctx.model.lm, batch.to(ctx.model.device))[objective.name]
        loss, targets, correct = loss + float(out.loss_sum), targets + int(out.num_targets), correct + int(
            out.num_correct)
    if not targets:
        raise ValueError(f"{path}: no {objective.name} targets in the evaluated samples")
    return {"loss": loss / targets, "accuracy": correct / targets, "targets": int(targets),
            "samples": min(index.num_samples, total * ctx.batch_size), "shards": path}


def perplexity(ctx: EvalContext, opts: HeldOutOptions) -> dict:
    result = score(ctx, make_objective(CLMConfig(), document_masking=opts.document_masking), opts)
    return {**result, "perplexity": math.exp(result["loss"])}


def masked(config_type: type[MaskedConfig]):
    def run(ctx: EvalContext, opts: MaskedHeldOutOptions) -> dict:
        config = config_type(ratio=opts.ratio, policy=opts.policy,
                             mask_token=opts.mask_token or ctx.model.record.mask_token)
        objective = make_objective(config, ctx.model.tokenizer, opts.document_masking)
        return {**score(ctx, objective, opts), "ratio": opts.ratio, "policy": opts.policy}
    return run


TASKS = (Task(SPECS["perplexity"], perplexity), Task(SPECS["mlm"], masked(MLMConfig)),
         Task(SPECS["mntp"], masked(MNTPConfig)))
