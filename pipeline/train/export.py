"""The HF exports at the end of training: the running engine's, and the best checkpoint's (``checkpoint.keep_best``)
(the directory's writer and the offline export of a checkpoint: :mod:`pipeline.export.hf`)."""

from __future__ import annotations

import contextlib

from transformers import PreTrainedModel
from transformers.integrations import deepspeed as hf_deepspeed

from pipeline.export.hf import export_checkpoint, save_hf
from pipeline.export.record import EncoderRecord
from pipeline.export.sentence_transformers import st_record
from pipeline.run_dir import RunDir
from pipeline.train.distributed import on_rank_0


def export_engine(engine, lm: PreTrainedModel, tokenizer, run: RunDir, record: EncoderRecord, st: bool, step: int,
                  tokens: int) -> str:
    """Collective under ZeRO-3: every rank takes part in the 16-bit gather; rank 0 writes ``run``'s ``hf/`` (a
    LoRA adapter merged), with the sentence-transformers files when ``st`` (``train.export_sentence_transformers``).
    Its card describes the experiment the run recorded (``experiment.json``), as the export of a checkpoint
    does."""
    stage3 = engine.zero_optimization_stage() == 3
    sd = engine._zero3_consolidated_16bit_state_dict() if stage3 else engine.module.state_dict()

    def write() -> None:
        save_hf(lm, sd, tokenizer, run.hf, st_record(record) if st else record, run.experiment(), step, tokens, st)
        print(f"exported HF model to {run.hf}", flush=True)

    on_rank_0(write)
    return run.hf


@contextlib.contextmanager
def without_zero_init():
    """transformers builds every model under ``deepspeed.zero.Init`` while the trainer's ``HfDeepSpeedConfig`` lives
    (``pipeline.train.module``), a collective: rank 0 alone building a model would wait for the others forever.
    Inside, it builds whole models as in a process of its own."""
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def export_best(run: RunDir, step: int) -> str:
    """Collective: rank 0 exports the complete checkpoint of ``step`` (the best, which pruning spared) into
    ``RUN/hf-best`` as ``launch/export_hf.py --step`` would; the others wait for it (:func:`on_rank_0`)."""

    def write() -> None:
        with without_zero_init():
            export_checkpoint(run, run.hf_best, step)
        print(f"exported the best checkpoint (step {step}) to {run.hf_best}", flush=True)

    on_rank_0(write)
    return run.hf_best
