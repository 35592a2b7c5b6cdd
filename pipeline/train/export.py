"""HF export: a ``save_pretrained`` directory with the training record (docs/export.md), from the running engine
at the end of training (:func:`export_engine`) or, offline in one process, from a run's checkpoint
(:func:`export_checkpoint`, behind ``launch/export_hf.py`` and evaluation's exports of checkpoints)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from pipeline.config import to_dict
from pipeline.export.record import EncoderRecord, from_experiment, write_record
from pipeline.run_dir import RunDir, tag
from pipeline.train.module import PREFIX

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExportError(ValueError):
    """An export that cannot be written; the message names the run and the fix."""


def save_hf(lm: PreTrainedModel, state_dict: dict, tokenizer, out: str, record: EncoderRecord) -> str:
    """Write an HF ``save_pretrained`` directory (weights, config with the training ``record``, tokenizer) from an
    engine-module state dict."""
    sd = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in state_dict.items()}
    os.makedirs(out, exist_ok=True)
    lm.config.use_cache = True
    lm.save_pretrained(out, state_dict=sd, safe_serialization=True)
    write_record(out, record)
    tokenizer.save(out)
    return out


def export_engine(engine, lm: PreTrainedModel, tokenizer, out: str, record: EncoderRecord) -> str:
    """Collective under ZeRO-3: every rank takes part in the 16-bit gather; rank 0 writes."""
    stage3 = engine.zero_optimization_stage() == 3
    sd = engine._zero3_consolidated_16bit_state_dict() if stage3 else engine.module.state_dict()
    if dist.get_rank() == 0:
        save_hf(lm, sd, tokenizer, out, record)
        print(f"exported HF model to {out}", flush=True)
    dist.barrier()
    return out


def export_checkpoint(run: RunDir, out: str, step: int | None = None, dtype: str = "fp32",
                      sentence_transformers: bool = False, pooling: str | None = None,
                      layout: str | None = None) -> int:
    """Export the checkpoint of ``step`` (default: the newest complete one) from the fp32 master weights of the
    ZeRO checkpoint (DeepSpeed's ``zero_to_fp32``), with the run's model config and tokenizer; ``pooling`` /
    ``layout`` override the recorded defaults; ``sentence_transformers`` also writes that library's files.
    Returns the step exported."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from pipeline.export.sentence_transformers import check_expressible, write_sentence_transformers
    from pipeline.tokenizer import load_tokenizer

    steps = run.complete_steps()
    if not steps:
        raise ExportError(f"{run.path} has no complete checkpoint (looked in {run.checkpoints})")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ExportError(f"{run.path} has no complete checkpoint at step {step}; complete steps: {steps}")
    exp = run.experiment()
    tokenizer = load_tokenizer(exp.data.tokenizer)
    record = replace(from_experiment(to_dict(exp), tokenizer),
                     **{k: v for k, v in (("pooling", pooling), ("layout", layout)) if v})
    if sentence_transformers:
        try:  # before reading the weights
            check_expressible(record)
        except ValueError as e:
            raise ExportError(str(e)) from None
    sd = get_fp32_state_dict_from_zero_checkpoint(run.checkpoints, tag=tag(step))
    lm = AutoModelForCausalLM.from_config(run.model_config(), dtype=DTYPES[dtype])
    save_hf(lm, {k: v.to(DTYPES[dtype]) for k, v in sd.items()}, tokenizer, out, record)
    if sentence_transformers:
        write_sentence_transformers(out, record)
    return step
