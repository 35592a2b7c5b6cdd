"""The model under evaluation: a run directory of ``launch/train.py`` or an HF directory, with its tokenizer and
what its training says about how to read it.

A run directory (:class:`pipeline.run_dir.RunDir`) is evaluated through its ``hf/`` export, or, when training has not
exported one, through its newest complete checkpoint exported once (:func:`pipeline.export.hf.export_checkpoint`)
into ``RUN/eval/hf-stepNNNNNNNN`` (reused after).
How to read the model comes from the export's own ``config.json`` (``pipeline.export.record``), so a copied export
reads the same as the run's; an export written before records existed falls back to its run's ``experiment.json``,
and an HF directory with neither is a plain decoder (``causal``, ``EncoderRecord()``'s defaults):

- ``attention`` for embeddings, probing and fine-tuning inputs: ``bidirectional`` when the last phase trained any
  non-causal objective (MLM, MNTP, MAGNET, SimCSE, SSCL), else ``causal`` (overridable);
- ``reads_previous``: MNTP-trained models (any phase with ``mntp`` or ``magnet``) predict token i from position i-1,
  so word probes read the states one position earlier (LLM2Vec's ``retroactive_labels: next_token``);
- the mask token, and the default pooling, layout and instruction of ``encode``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pipeline.eval.description import ModelDescription, recorded_path
from pipeline.export.hf import export_checkpoint
from pipeline.export.record import EncoderRecord, from_experiment, read_record
from pipeline.model.build import DTYPES
from pipeline.model.load_hf import load_hf
from pipeline.run_dir import RunDir
from pipeline.tokenizer import Tokenizer, load_tokenizer

ATTENTIONS = ("auto", "causal", "bidirectional")


class ModelError(ValueError):
    """A model path that cannot be evaluated; the message names it and the fix."""


@dataclass
class EvalModel:
    lm: PreTrainedModel
    tokenizer: Tokenizer
    hf_dir: str
    run_dir: str | None  # the training run it came from, when known
    step: int | None  # the checkpoint step exported, when known
    record: EncoderRecord  # how its training says to read it
    attention: str  # "causal" | "bidirectional": how encoders read text (the record's unless overridden)

    @property
    def reads_previous(self) -> bool:
        """MNTP-trained: token i is read from position i - 1."""
        return self.record.reads_previous

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    @property
    def max_length(self) -> int:
        return int(getattr(self.lm.config, "max_position_embeddings", 2048))

    def describe(self, root: str) -> ModelDescription:
        """What its results record of it, paths relative to the results root ``root``."""
        return ModelDescription(hf_dir=recorded_path(self.hf_dir, root),
                                run_dir=self.run_dir and recorded_path(self.run_dir, root), step=self.step,
                                attention=self.attention, reads_previous=self.reads_previous, record=self.record,
                                tokenizer=recorded_path(self.tokenizer.path, root),
                                parameters=sum(p.numel() for p in self.lm.parameters()))


def checkpoint_export(run: RunDir, step: int) -> str:
    """``RUN/eval/hf-stepN``, exported once from the step's checkpoint."""
    out = run.eval_export(step)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    try:
        export_checkpoint(run, out, step)
    except (OSError, ValueError, RuntimeError) as e:  # ExportError, a missing file, DeepSpeed's conversion
        raise ModelError(f"{run.path}: exporting checkpoint step {step} failed: {e}") from e
    return out


def resolve(path: str, step: int | None = None) -> tuple[str, str | None, int | None]:
    """(HF directory, run directory or None, checkpoint step or None) for a run or HF directory; ``step``: that
    complete checkpoint of the run (e.g. one ``checkpoint.keep_every`` kept), exported once; the best one
    (``checkpoint.keep_best``) is read from ``RUN/hf-best``, whose card then gets its results."""
    run = RunDir(path)
    if step is not None:
        if not run.exists():
            raise ModelError(f"{path}: a checkpoint step ({step}) needs a run directory (with experiment.json)")
        if step not in run.complete_steps():
            raise ModelError(f"{path}: no complete checkpoint of step {step}; its complete steps: "
                             f"{run.complete_steps() or 'none'} (checkpoint.keep_every keeps steps for good)")
        best, exported = run.best(), os.path.join(run.hf_best, "config.json")
        if (best and best["step"] == step and os.path.isfile(exported)
                and os.path.getmtime(exported) >= os.path.getmtime(run.best_mark(step))):  # exported since it was best
            return run.hf_best, path, step
        return checkpoint_export(run, step), path, step
    if run.exists():
        steps = run.complete_steps()
        if run.has_hf():
            return run.hf, path, steps[-1] if steps else None
        if not steps:
            raise ModelError(f"{path}: a run directory without an hf/ export or a complete checkpoint; train it "
                             f"(launch/train.py) or pass an HF model directory")
        return checkpoint_export(run, steps[-1]), path, steps[-1]
    if os.path.isfile(os.path.join(path, "config.json")):
        parent = os.path.dirname(os.path.abspath(path))
        return path, parent if RunDir(parent).exists() else None, None
    raise ModelError(f"{path}: neither a run directory (with experiment.json) nor an HF model directory (with "
                     f"config.json); pass runs/<name> or a save_pretrained directory")


def load_model(path: str, *, attention: str = "auto", tokenizer: str | None = None, device: str = "cpu",
               dtype: str = "fp32", attn_implementation: str = "sdpa", step: int | None = None) -> EvalModel:
    """Load ``path`` (run or HF directory; with ``step``, that checkpoint of the run) for evaluation, in eval mode;
    ``tokenizer`` overrides the model directory's own tokenizer files."""
    if attention not in ATTENTIONS:
        raise ModelError(f"attention {attention!r} is not one of {', '.join(ATTENTIONS)}")
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such model; pass a run directory (runs/<name>) or an HF model directory")
    hf_dir, run_dir, step = resolve(path, step)
    try:
        tok = load_tokenizer(tokenizer or hf_dir)
    except ValueError as e:
        raise ModelError(f"{hf_dir}: the model has no usable tokenizer ({e}); copy the training tokenizer's files "
                         f"into it, or pass --tokenizer DIR") from e
    lm = load_hf(hf_dir, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    try:
        record = read_record(lm.config)
    except (TypeError, ValueError) as e:
        raise ModelError(f"{hf_dir}/config.json: {e}; re-export the model with launch/export_hf.py") from e
    if record is None:  # an export without a record: its run's experiment, else a plain decoder
        record = from_experiment(RunDir(run_dir).experiment(), tok) if run_dir else EncoderRecord()
    if tok.info.vocab_size > lm.config.vocab_size:
        raise ModelError(f"{hf_dir}: the tokenizer has {tok.info.vocab_size} ids but the model only "
                         f"{lm.config.vocab_size}; pass the tokenizer the model was trained with (--tokenizer)")
    lm.to(device).eval()
    return EvalModel(lm=lm, tokenizer=tok, hf_dir=hf_dir, run_dir=run_dir, step=step, record=record,
                     attention=record.attention if attention == "auto" else attention)
