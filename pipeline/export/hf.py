"""An HF ``save_pretrained`` directory with the training record (docs/export.md): :func:`save_hf` writes one from
a state dict (the trainer's end-of-training export uses it too), :func:`export_checkpoint` from a run's
checkpoint, offline in one process, behind ``launch/export_hf.py`` (:func:`main`) and evaluation's exports of
checkpoints.

Every ZeRO stage the trainer accepts exports: stages 1-3 (offload included) keep the fp32 master weights
partitioned in their optimizer files, which DeepSpeed's ``zero_to_fp32`` gathers; stage 0 keeps the whole model in
its module state (the fp32 weights of an fp32 run; a bf16 run's bf16 weights, what its engine export writes too).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import replace

import torch
from huggingface_hub import EvalResult
from transformers import PreTrainedModel

from pipeline.experiment import ExperimentConfig, phase_at
from pipeline.export.card import is_encoder, write_card
from pipeline.export.hub import adapter_base
from pipeline.export.model_index import results_at
from pipeline.export.record import EncoderRecord, from_experiment, write_record
from pipeline.export.sentence_transformers import st_record, write_sentence_transformers
from pipeline.export.weights import save_weights
from pipeline.io import directory_beside
from pipeline.model.build import DTYPES
from pipeline.model.lora import ADAPTER_DIR, merge_lora, save_adapter
from pipeline.model.rope import configure_rope
from pipeline.run_dir import RunDir, tag
from pipeline.safe_load import check_directory, load_weights_only

PREFIX = "lm."  # the HF model's parameter names inside the engine's module (pipeline.train.module.TrainModule.lm)
STAGE0_MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file of the whole module without ZeRO


class ExportError(ValueError):
    """An export that cannot be written; the message names the run and the fix."""


def save_hf(lm: PreTrainedModel, state_dict: dict, tokenizer, out: str, record: EncoderRecord,
            exp: ExperimentConfig, step: int, tokens: int | None = None, sentence_transformers: bool = False,
            results: list[EvalResult] = ()) -> str:
    """Write an HF ``save_pretrained`` directory from an engine-module state dict of ``exp``'s run at ``step``:
    weights in the form of the class the config names (``pipeline.export.weights``), the training ``record`` in
    the config, the tokenizer, the model card (with the step's evaluation ``results``), and with ``sentence_transformers`` that library's files (``record``
    must be one it expresses: ``st_record``). A LoRA run's adapter is merged into the weights and also written
    alone into ``adapter/``. Written beside ``out`` and renamed into place (:func:`~pipeline.io.directory_beside`), as
    checkpoints are; an existing ``out`` that is no export is refused rather than replaced."""
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        raise ExportError(f"{out}: a directory that holds no export; an export replaces its directory as a whole: "
                          f"name a new directory or remove this one")
    with directory_beside(out) as tmp:  # a kill mid-export leaves no directory at `out` that loads as an export
        _write_hf(lm, state_dict, tokenizer, tmp, record, exp, step, tokens, sentence_transformers, results)
    return out


def _write_hf(lm: PreTrainedModel, state_dict: dict, tokenizer, out: str, record: EncoderRecord,
              exp: ExperimentConfig, step: int, tokens: int | None, sentence_transformers: bool,
              results: list[EvalResult]) -> None:
    sd = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in state_dict.items()}
    encoder = is_encoder(record, sentence_transformers)
    if exp.model.lora.r:
        save_adapter(sd, exp.model.lora, adapter_base(exp), os.path.join(out, ADAPTER_DIR),
                     lm.base_model_prefix + "." if encoder else "")
        sd = merge_lora(sd, exp.model.lora.scale)
    lm.config.use_cache = True
    save_weights(lm, sd, out, encoder)
    write_record(out, record)
    tokenizer.save(out)
    if sentence_transformers:
        write_sentence_transformers(out, record)
    write_card(out, record, exp, step, tokens, sentence_transformers, tokenizer, results)


def checkpoint_state_dict(run: RunDir, step: int) -> dict[str, torch.Tensor]:
    """The engine module's weights at ``step``, whatever the ZeRO stage that wrote them (module docstring); the
    directory checked first (zero_to_fp32 unpickles with weights_only=False: :func:`check_directory`). zero_to_fp32's
    bars ("Loading checkpoint shards", "Gathering sharded weights") are drawn where transformers' are: off under
    ``launch/evaluate.py --no-progress``, which turns transformers' off."""
    check_directory(run.checkpoint(step))
    if run.checkpoint_zero_stage(step) == 0:
        path = os.path.join(run.checkpoint(step), STAGE0_MODEL_STATES)
        if not os.path.isfile(path):
            raise ExportError(f"{path}: missing from a ZeRO stage 0 checkpoint; export another step "
                              f"(complete steps: {run.complete_steps()})")
        return load_weights_only(path, map_location="cpu")["module"]
    from deepspeed.utils import zero_to_fp32
    from transformers.utils.logging import is_progress_bar_enabled

    bars = zero_to_fp32.tqdm  # the module's own name for tqdm, which it calls with no way to turn it off
    zero_to_fp32.tqdm = functools.partial(bars, disable=not is_progress_bar_enabled())
    try:
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(run.checkpoints, tag=tag(step))
    finally:
        zero_to_fp32.tqdm = bars


def tokens_at(run: RunDir, step: int) -> int | None:
    """The tokens the run had trained on at ``step``, when its metrics logged that step."""
    if not os.path.isfile(run.metrics):
        return None
    with open(run.metrics) as f:
        logged = {rec.get("step"): rec for rec in map(json.loads, f)}
    return logged.get(step, {}).get("progress/tokens_seen")


def export_checkpoint(run: RunDir, out: str, step: int | None = None, dtype: str = "fp32",
                      sentence_transformers: bool = False, pooling: str | None = None,
                      layout: str | None = None, truncate_dim: int | None = None) -> int:
    """Export the checkpoint of ``step`` (default: the newest complete one) with the run's model config and
    tokenizer; ``pooling`` / ``layout`` override the recorded defaults; ``truncate_dim`` records the leading dims
    ``encode()`` and sentence-transformers keep by default (a Matryoshka run's); ``sentence_transformers`` also writes that
    library's files, with the run's pooling and the layout it expresses (``st_record``); the card's model-index
    holds the run's evaluations of that step (``launch/evaluate.py``). Returns the step."""
    from transformers import AutoModelForCausalLM

    from pipeline.tokenizer import load_tokenizer

    steps = run.complete_steps()
    if not steps:
        raise ExportError(f"{run.path} has no complete checkpoint (looked in {run.checkpoints})")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ExportError(f"{run.path} has no complete checkpoint at step {step}; complete steps: {steps}")
    exp = run.experiment()
    tokenizer = load_tokenizer(exp.data.tokenizer)
    record = from_experiment(exp, tokenizer)
    if sentence_transformers:
        try:  # before reading the weights
            record = st_record(record, pooling, layout)
        except ValueError as e:
            raise ExportError(str(e)) from None
    else:
        record = replace(record, **{k: v for k, v in (("pooling", pooling), ("layout", layout)) if v})
    config = run.model_config()  # the start model's; the RoPE settings of the phase that trained step `step`:
    if truncate_dim is not None:
        record = replace(record, truncate_dim=truncate_dim_of(truncate_dim, config.hidden_size, record))
    sd = checkpoint_state_dict(run, step)
    phase = exp.phase_data(phase_at(exp.phase_starts(), max(step - 1, 0)))
    configure_rope(config, phase.rope_theta, phase.context)
    lm = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    save_hf(lm, {k: v.to(DTYPES[dtype]) for k, v in sd.items()}, tokenizer, out, record, exp, step,
            tokens_at(run, step), sentence_transformers, results_at(run, step, record.attention))
    return step


def truncate_dim_of(dim: int, hidden_size: int, record: EncoderRecord) -> int:
    """``dim``, checked before any weight is read: a width the model has, and one a Matryoshka run trained where
    it recorded its dims (another width was never trained to stand alone)."""
    if not 1 <= dim <= hidden_size:
        raise ExportError(f"--truncate-dim {dim}: the model's embeddings have {hidden_size} dims; pass 1 to "
                          f"{hidden_size}" + (f", e.g. one of the trained {list(record.matryoshka_dims)}"
                                              if record.matryoshka_dims else ""))
    if record.matryoshka_dims and dim not in record.matryoshka_dims:
        raise ExportError(f"--truncate-dim {dim}: the run trained the dims {list(record.matryoshka_dims)} to stand "
                          f"alone (matryoshka.dims); pass one of them")
    return dim


USAGE = """Export a training checkpoint as an HF ``save_pretrained`` directory, offline, in one process:
``python launch/export_hf.py --run RUN_DIR [--step N] --output DIR [--dtype fp32|bf16]
[--sentence-transformers [--pooling P] [--layout L]] [--truncate-dim N]``.

The weights come from the checkpoint of any ZeRO stage, the model config and the tokenizer from the run directory,
and the training record goes into config.json, a model card into README.md (docs/export.md; with the results of
launch/evaluate.py for that step of the run, when there are some, as its model-index). An encoder keeps its
LM head apart (``AutoModelForCausalLM.from_pretrained(DIR, variant="lm")`` loads it); a LoRA run's adapter is also
written alone into DIR/adapter. ``--sentence-transformers`` also makes DIR a sentence-transformers model
(``SentenceTransformer(DIR)``) with the run's pooling and the layout that library reproduces (the text alone for
mean pooling); ``--pooling`` / ``--layout`` override the recorded defaults. ``--truncate-dim N`` makes the export
embed with its first N dims by default (a Matryoshka run's, one of its recorded ``matryoshka_dims``): ``encode()``
and sentence-transformers (its ``truncate_dim``) alike. Training also exports at its end
(``train.export_hf``, ``train.export_sentence_transformers``).
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (holds checkpoints/ and experiment.json)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--sentence-transformers", action="store_true",
                   help="also write the sentence-transformers files (modules.json, pooling, prompts)")
    p.add_argument("--pooling", choices=["mean", "last", "weighted_mean"], help="default: the run's (recorded)")
    p.add_argument("--layout", choices=["bos_eos", "special", "text"],
                   help="default: the run's (recorded); with --sentence-transformers, the one it reproduces")
    p.add_argument("--truncate-dim", type=int, default=None,
                   help="embed with the first N dims by default (a Matryoshka run's; default: all)")
    args = p.parse_args(argv)
    try:
        step = export_checkpoint(RunDir(args.run), args.output, args.step, args.dtype, args.sentence_transformers,
                                 args.pooling, args.layout, args.truncate_dim)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {tag(step)} of {args.run} to {args.output}")
    return 0
