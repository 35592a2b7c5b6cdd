"""The HF export at the end of training, from the running engine (the directory's writer and the offline export of
a checkpoint: :mod:`pipeline.export.hf`)."""

from __future__ import annotations

import torch.distributed as dist
from transformers import PreTrainedModel

from pipeline.experiment import ExperimentConfig
from pipeline.export.hf import save_hf
from pipeline.export.record import EncoderRecord
from pipeline.export.sentence_transformers import st_record


def export_engine(engine, lm: PreTrainedModel, tokenizer, out: str, record: EncoderRecord, exp: ExperimentConfig,
                  step: int, tokens: int) -> str:
    """Collective under ZeRO-3: every rank takes part in the 16-bit gather; rank 0 writes (a LoRA adapter merged),
    with the sentence-transformers files when ``train.export_sentence_transformers``."""
    stage3 = engine.zero_optimization_stage() == 3
    sd = engine._zero3_consolidated_16bit_state_dict() if stage3 else engine.module.state_dict()
    if dist.get_rank() == 0:
        st = exp.train.export_sentence_transformers
        save_hf(lm, sd, tokenizer, out, st_record(record) if st else record, exp, step, tokens, st)
        print(f"exported HF model to {out}", flush=True)
    dist.barrier()
    return out
