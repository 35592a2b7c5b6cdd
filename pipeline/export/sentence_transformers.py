"""Make an HF export a sentence-transformers model directory: ``SentenceTransformer(DIR)`` then embeds text as
``pipeline.eval.encode`` does with the export's recorded pooling, layout and instruction.

The files are sentence-transformers' own (6.x): ``modules.json`` (the directory's transformer, then pooling),
``sentence_bert_config.json`` (whether the tokenizer adds its special tokens), ``1_Pooling/config.json`` and
``config_sentence_transformers.json`` (the instruction as the default prompt, cosine similarity, and the record's
``truncate_dim`` where one was asked for: the leading dims of a Matryoshka-trained model). The model is
the directory's config and weights, loaded by ``AutoModel``, so a bidirectional export runs bidirectionally
(``is_causal: false``, ``pipeline.export.record``).

sentence-transformers tokenizes ``prompt + text`` as one string and leaves the prompt's own tokens out of pooling
(``include_prompt: false``), as ``encode`` does. Its mean pooling covers every other token, special tokens too, so
it equals ``encode``'s only when the layout adds none (``text``); its last-token pooling equals ``encode``'s
``last`` under the tokenizer's own layout. An export takes the run's pooling and the nearest layout that
sentence-transformers reproduces (:func:`st_record`); other combinations asked for are refused with the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from pipeline.data.format.instructions import format_instruction
from pipeline.export.record import EncoderRecord

ST_POOLING = {"mean": "mean", "last": "lasttoken"}
TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"
POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"


# the layout sentence-transformers reproduces for a pooling when the run's is not one it reproduces
EXPRESSED = {"mean": "text", "last": "special"}


def _problem(record: EncoderRecord) -> str | None:
    if record.pooling not in ST_POOLING:
        return (f"pooling {record.pooling!r} has no sentence-transformers equivalent; export with --pooling mean or "
                f"--pooling last")
    if record.pooling == "mean" and record.layout != "text":
        return (f"sentence-transformers' mean pooling includes special tokens, so it equals encode()'s mean only "
                f"under layout 'text' (the layout is {record.layout!r}); export with --layout text, or --pooling last")
    if record.pooling == "last" and record.layout == "bos_eos":
        return ("sentence-transformers adds the tokenizer's own special tokens, not data prep's BOS/EOS; export "
                "with --layout special (or text)")
    return None


def check_expressible(record: EncoderRecord) -> None:
    """Raise unless sentence-transformers' modules reproduce ``encode`` under ``record``."""
    if problem := _problem(record):
        raise ValueError(problem)


def st_record(record: EncoderRecord, pooling: str | None = None, layout: str | None = None) -> EncoderRecord:
    """The record of a sentence-transformers export of a run recorded as ``record``: its pooling, and its layout
    where sentence-transformers reproduces it, else the one it reproduces for that pooling (``EXPRESSED``: a
    mean-pooled run reads the text alone); ``pooling`` / ``layout`` override. Raises for an override it cannot
    express."""
    pooling = pooling or record.pooling
    if layout is None:
        kept = replace(record, pooling=pooling)
        layout = record.layout if _problem(kept) is None else EXPRESSED.get(pooling, record.layout)
    chosen = replace(record, pooling=pooling, layout=layout)
    check_expressible(chosen)
    return chosen


def _write(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_sentence_transformers(hf_dir: str, record: EncoderRecord) -> None:
    """Add the sentence-transformers files to the HF export ``hf_dir`` (its config.json holds ``record``)."""
    check_expressible(record)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    _write(os.path.join(hf_dir, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": TRANSFORMER},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": POOLING}])
    _write(os.path.join(hf_dir, "sentence_bert_config.json"), {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
        "processing_kwargs": {"text": {"add_special_tokens": record.layout != "text"}}})
    _write(os.path.join(hf_dir, "1_Pooling", "config.json"), {
        "embedding_dimension": hidden, "pooling_mode": ST_POOLING[record.pooling], "include_prompt": False})
    prompt = format_instruction(record.instruction_format, record.instruction)
    prompts = {"instruction": prompt} if prompt else {}
    truncate = {"truncate_dim": record.truncate_dim} if record.truncate_dim else {}
    _write(os.path.join(hf_dir, "config_sentence_transformers.json"), {
        "model_type": "SentenceTransformer", "prompts": prompts,
        "default_prompt_name": "instruction" if prompts else None, "similarity_fn_name": "cosine", **truncate})
