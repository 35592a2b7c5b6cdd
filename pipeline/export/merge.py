"""Merge exports of one architecture into one export (``launch/merge.py``, :func:`main`; docs/export.md): linear,
SLERP and task arithmetic, as Qwen3-Embedding and EmbeddingGemma merge their checkpoints. The arithmetic is
mergekit's (``MergeConfiguration``, ``run_merge``; the optional ``merge`` extra), not written here.

mergekit reads causal LMs, so each input is staged as one (:func:`stage`): a directory of its own holding its config
under the causal-LM class and links to its weight files, with an encoder's index of the variant ``lm`` (its LM head
beside the base model, ``pipeline.export.weights``) as the index mergekit reads, so the head is merged too and an
export given twice counts twice. mergekit writes a causal LM; :func:`write_export` writes it back in the inputs' form
(an encoder's base model and head apart) with their record, tokenizer, sentence-transformers files where every input
has them, mergekit's configuration (inputs by name) and a card naming the method, the inputs and their weights.

The inputs must read text one way and share one architecture: their records' :data:`READ_ALIKE` fields, their
configs' architecture fields (all but :data:`NOT_ARCHITECTURE`, as transformers loads them) and their tokenizers'
vocabularies. A difference is refused in one line naming both exports and the field, before any weight is read.
Task arithmetic's ``--base`` (the start the task vectors are taken from, e.g. the causal LM the encoders were trained
from) shares the architecture and the vocabulary only. The record is the first input's: its defaults for queries
(instruction, its format) and its history (objectives) where the inputs differ, which the card lists; its Matryoshka
dims are those every input trained.
"""

from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import sys
import tempfile
from dataclasses import dataclass, fields, replace

import torch
from huggingface_hub import ModelCard, ModelCardData, metadata_load
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pipeline.data.format.instructions import special_tokens
from pipeline.export.card import is_encoder, usage_snippet
from pipeline.export.hub import is_hub_id, local_name
from pipeline.export.record import KEY, EncoderRecord, read_record, write_record
from pipeline.export.sentence_transformers import write_sentence_transformers
from pipeline.export.weights import BASE_INDEX, save_weights
from pipeline.io import directory_beside
from pipeline.model.load_hf import LM_INDEX
from pipeline.tokenizer import Tokenizer, load_tokenizer

METHODS = ("linear", "slerp", "task_arithmetic")  # mergekit's merge_method names
INSTALL = "pip install 'decoder-encoders[merge]'"
# how the merge is read (pipeline.eval.encode): one way for every input
READ_ALIKE = ("attention", "reads_previous", "mask_token", "pooling", "layout", "truncate_dim")
# config fields that are not the architecture: the class (encoder or causal LM), the record and its switch, the
# dtype (the merge is computed in fp32 and written in the first input's), the writer's version, training's dropout
NOT_ARCHITECTURE = frozenset({"architectures", "is_causal", KEY, "dtype", "torch_dtype", "transformers_version",
                              "_name_or_path", "use_cache", "attention_dropout"})
ST_MODULES = "modules.json"  # a sentence-transformers export's (pipeline.export.sentence_transformers)
MERGEKIT_CONFIG = "mergekit_config.yml"  # mergekit's record of the merge, kept in the export


class MergeError(ValueError):
    """A merge that cannot be made; the message names the export, the field and the fix."""


@dataclass(frozen=True)
class Export:
    """An input as read before its weights: its directory, config (as transformers loads it), record, and whether
    it is a sentence-transformers export."""

    path: str
    config: PretrainedConfig
    record: EncoderRecord | None
    sentence_transformers: bool


def read_export(path: str) -> Export:
    """The config and record of the export ``path``, checked to hold safetensors weights (not read)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise MergeError(f"{path}: no config.json; pass export directories (launch/export_hf.py --output DIR)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", BASE_INDEX)):
        raise MergeError(f"{path}: no model.safetensors (or {BASE_INDEX}); mergekit merges safetensors exports")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        record = read_record(config)
    except ValueError as e:
        raise MergeError(f"{path}: {e}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise MergeError(f"{path}: model type {config.model_type!r} has no causal-LM class in transformers, which "
                         f"mergekit's reading of an export needs; merge exports of decoder LLMs")
    return Export(path, config, record, os.path.isfile(os.path.join(path, ST_MODULES)))


def architecture(config: PretrainedConfig) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in NOT_ARCHITECTURE}


def difference(a: Export, b: Export, records: bool) -> str | None:
    """The first field in which ``b`` differs from ``a`` (``records``: the records' reading fields first), as
    ``field (b's vs a's)``; None when they merge."""
    pairs = [(f"{KEY}.{name}", getattr(a.record, name), getattr(b.record, name))
             for name in (READ_ALIKE if records else ())]
    ours, theirs = architecture(a.config), architecture(b.config)
    pairs += [(key, ours.get(key), theirs.get(key)) for key in sorted(set(ours) | set(theirs))]
    return next((f"{name} ({vb!r} vs {va!r})" for name, va, vb in pairs if va != vb), None)


def check_inputs(models: list[Export], base: Export | None) -> None:
    """Refuse, in one line naming both exports and the field, inputs that do not merge (module docstring)."""
    first = models[0]
    for m in models:
        if m.record is None:
            raise MergeError(f"{m.path}: config.json has no {KEY} record, so how it reads text is unknown; merge "
                             f"exports of launch/export_hf.py (a plain checkpoint may be task arithmetic's --base)")
    for other, records in [(m, True) for m in models[1:]] + ([(base, False)] if base else []):
        if field := difference(first, other, records):
            raise MergeError(f"{other.path} and {first.path} differ in {field}: merge exports of one architecture "
                             + ("(the base too)" if not records else "that read text one way"))


def tokenizer_of(export: Export) -> Tokenizer:
    try:
        return load_tokenizer(export.path)
    except (OSError, ValueError) as e:
        raise MergeError(f"{export.path}: no tokenizer to merge with ({e})") from None


def check_vocabularies(models: list[Export], base: Export | None) -> Tokenizer:
    """The first input's tokenizer, once every input's (and the base's) vocabulary is found equal to it."""
    tokenizer = tokenizer_of(models[0])
    vocab = tokenizer.hf.get_vocab()
    for other in models[1:] + ([base] if base else []):
        theirs = tokenizer_of(other).hf.get_vocab()
        if theirs != vocab:
            moved = len(set(vocab.items()) ^ set(theirs.items()))
            raise MergeError(f"{other.path} and {models[0].path} differ in the tokenizer's vocabulary ({moved} "
                             f"entries): merge exports trained with one tokenizer")
    return tokenizer


def merged_record(models: list[Export]) -> tuple[EncoderRecord, list[str]]:
    """The merge's record (module docstring) and the record fields the inputs differ in, beyond the Matryoshka dims
    (narrowed to those every input trained)."""
    first = models[0].record
    dims = tuple(d for d in first.matryoshka_dims if all(d in m.record.matryoshka_dims for m in models))
    differ = [f.name for f in fields(EncoderRecord) if f.name != "matryoshka_dims"
              and any(getattr(m.record, f.name) != getattr(first, f.name) for m in models)]
    return replace(first, matryoshka_dims=dims), differ


def check_settings(method: str, models: list[str], weights: list[float] | None, t: float | None,
                   base: str | None, lambda_: float | None, output: str) -> list[float] | None:
    """The per-input weights to merge with (None for SLERP), once the options fit ``method``."""
    if method not in METHODS:
        raise MergeError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    least, most = {"linear": (2, None), "slerp": (2, 2), "task_arithmetic": (1, None)}[method]
    if len(models) < least or (most and len(models) > most):
        raise MergeError(f"--models: {method} merges {'exactly' if most else 'at least'} {least} export(s); "
                         f"{len(models)} given")
    for flag, value, allowed in (("--t", t, "slerp"), ("--base", base, "task_arithmetic"),
                                 ("--lambda", lambda_, "task_arithmetic")):
        if value is not None and method != allowed:
            raise MergeError(f"{flag} applies to --method {allowed}, not {method}")
    if method == "task_arithmetic" and base is None:
        raise MergeError("--base: task arithmetic adds each export's difference from a base to it; name the base "
                         "(e.g. the checkpoint the exports were trained from)")
    if method == "slerp":
        if weights is not None:
            raise MergeError("--weights: SLERP weighs its two exports by --t (0: the first, 1: the second)")
        if t is not None and not 0 <= t <= 1:
            raise MergeError(f"--t {t}: SLERP interpolates between its exports; pass 0 (the first) to 1 (the second)")
    if weights is not None and len(weights) != len(models):
        raise MergeError(f"--weights: {len(weights)} weight(s) for {len(models)} export(s); give one per export, "
                         f"in the order of --models")
    if any(not math.isfinite(w) for w in (weights or []) + [t or 0.0, lambda_ or 0.0]):
        raise MergeError("--weights, --t and --lambda must be finite numbers")
    if method == "linear" and weights is not None and sum(weights) == 0:
        raise MergeError(f"--weights {weights}: linear merging divides by their sum, which is 0")
    inputs = {os.path.realpath(p) for p in models + ([base] if base else [])}
    if os.path.realpath(output) in inputs:
        raise MergeError(f"--output {output}: one of the inputs; name a new directory")
    if os.path.isdir(output) and os.listdir(output) and not os.path.isfile(os.path.join(output, "config.json")):
        raise MergeError(f"--output {output}: a directory that holds no export; a merge replaces its directory as a "
                         f"whole: name a new directory or remove this one")
    return None if method == "slerp" else weights or [1.0] * len(models)


def mergekit():
    """mergekit's configuration type, entry point and options, or one line naming the extra."""
    try:
        from mergekit.config import MergeConfiguration
        from mergekit.merge import MergeOptions, run_merge
        from mergekit.merge_methods.registry import get
    except ImportError:
        raise MergeError(f"merging needs mergekit: {INSTALL}") from None
    return MergeConfiguration, run_merge, MergeOptions, get


def stage(export: Export, out: str) -> str:
    """``out``: ``export`` as mergekit reads a causal LM (module docstring), by links to its weight files."""
    os.makedirs(out)
    config = copy.deepcopy(export.config)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    for path in glob.glob(os.path.join(os.path.abspath(export.path), "*.safetensors")):
        os.symlink(path, os.path.join(out, os.path.basename(path)))
    index = next((os.path.join(export.path, f) for f in (LM_INDEX, BASE_INDEX)
                  if os.path.isfile(os.path.join(export.path, f))), None)
    if index:
        os.symlink(os.path.abspath(index), os.path.join(out, BASE_INDEX))
    return out


def configuration(method: str, models: list[str], weights: list[float] | None, t: float | None, base: str | None,
                  lambda_: float | None, dtype: str) -> dict:
    """mergekit's configuration of the merge, with ``models`` and ``base`` as paths."""
    if method == "slerp":  # mergekit's SLERP goes from its base (t = 0) to the other model
        entries, parameters = [{"model": m} for m in models], {"t": 0.5 if t is None else t}
        base = models[0]
    else:
        entries = [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)]
        parameters = {"lambda": lambda_} if lambda_ is not None else None
    return {"merge_method": method, "models": entries, "dtype": "float32", "out_dtype": dtype,
            **({"base_model": base} if base else {}), **({"parameters": parameters} if parameters else {})}


def write_export(merged: str, out: str, record: EncoderRecord, tokenizer: Tokenizer,
                 sentence_transformers: bool) -> None:
    """mergekit's causal LM in ``merged`` as an export in ``out``: the weights in the form of the class the record
    asks for (``pipeline.export.weights``), the record, the tokenizer, mergekit's configuration and, with
    ``sentence_transformers``, that library's files."""
    config = AutoConfig.from_pretrained(merged, local_files_only=True)
    with torch.device("meta"):  # the class and config alone: the weights are mergekit's
        lm = AutoModelForCausalLM.from_config(config)
    state_dict = {}
    for path in sorted(glob.glob(os.path.join(merged, "*.safetensors"))):
        state_dict.update(load_file(path))
    save_weights(lm, state_dict, out, is_encoder(record, sentence_transformers))
    write_record(out, record)
    tokenizer.save(out)
    if sentence_transformers:
        write_sentence_transformers(out, record)
    os.replace(os.path.join(merged, MERGEKIT_CONFIG), os.path.join(out, MERGEKIT_CONFIG))


def card_metadata(models: list[Export], base: Export | None, method: str, encoder: bool,
                  sentence_transformers: bool) -> ModelCardData:
    """Hub metadata: the inputs' own Hub ancestors as ``base_model`` (a local path links nowhere), their license
    where all say the same, mergekit's tags."""
    cards = [metadata_load(p) or {} if os.path.isfile(p := os.path.join(m.path, "README.md")) else {}
             for m in models + ([base] if base else [])]
    ancestors = [a for c in cards for a in (c.get("base_model") if isinstance(c.get("base_model"), list)
                                            else [c.get("base_model")]) if is_hub_id(a)]
    licenses = {c.get("license") for c in cards}
    return ModelCardData(base_model=sorted(set(ancestors)) or None, license=licenses.pop() if len(licenses) == 1
                         and None not in licenses else None,
                         library_name="sentence-transformers" if sentence_transformers else "transformers",
                         pipeline_tag="feature-extraction" if encoder else "text-generation",
                         tags=["decoder-encoders", "merge", "mergekit", method.replace("_", "-")]
                         + ["sentence-transformers"] * sentence_transformers)


def card_body(out: str, models: list[Export], base: Export | None, method: str, weights: list[float] | None,
              t: float | None, lambda_: float | None, record: EncoderRecord, differ: list[str], source: str,
              sentence_transformers: bool, tokenizer: Tokenizer, spec) -> str:
    """The card's text: the method (mergekit's name, its paper), each input with its weight and objectives, how the
    merge reads text, mergekit's configuration and how to embed with it."""
    rows = [(f"`{local_name(m.path)}`", f"{w:g}" if weights else ("t = 0" if i == 0 else "t = 1"),
             ", then ".join(m.record.objectives) or "none") for i, (m, w) in enumerate(zip(models, weights or [0, 0]))]
    if base:
        rows.append((f"`{local_name(base.path)}` (base)", "the start of each task vector", "-"))
    table = "| input | weight | objectives |\n|---|---|---|\n" + "".join(f"| {' | '.join(r)} |\n" for r in rows)
    how = {"linear": "the weighted mean of the inputs' weights (weights divided by their sum)",
           "slerp": f"the spherical interpolation between the two inputs at t = {0.5 if t is None else t:g}",
           "task_arithmetic": f"the base plus {1.0 if lambda_ is None else lambda_:g} x the weighted sum of each "
                              "input's difference from it"}[method]
    reading = (f"{record.attention} attention, {record.pooling} pooling, layout `{record.layout}`"
               + (f", instruction {record.instruction!r}" if record.instruction else ""))
    kept = (f" The inputs' records differ in {', '.join(differ)}: this one keeps the first input's."
            if differ else "")
    special = special_tokens(tokenizer, "special") if record.layout == "special" else ([], [])
    return (f"# {os.path.basename(os.path.normpath(out))}\n\n"
            f"A merge of decoder-encoders exports by `launch/merge.py` with mergekit's `{method}` "
            f"([{spec.pretty_name}]({spec.reference_url})): {how}.\n\n{table}\n"
            f"Read as its inputs were trained ({reading}; `config.json` → `decoder_encoders`, `is_causal`).{kept}\n\n"
            f"mergekit's configuration (`{MERGEKIT_CONFIG}`, the inputs by name):\n\n```yaml\n{source}\n```\n\n"
            "## Usage\n\nRun it from the directory this card is in; from elsewhere, put that directory's path in "
            "place of `\".\"`.\n\n" + usage_snippet(".", record, sentence_transformers, special))


def merge(method: str, models: list[str], output: str, weights: list[float] | None = None, t: float | None = None,
          base: str | None = None, lambda_: float | None = None, progress: bool = True) -> list[str]:
    """Merge the exports ``models`` (and task arithmetic's ``base``) into the export ``output`` with mergekit's
    ``method``; everything is checked before any weight is read (module docstring). Returns the record fields the
    inputs differ in, whose values the merge takes from the first input."""
    weights = check_settings(method, models, weights, t, base, lambda_, output)
    exports = [read_export(p) for p in models]
    base_export = read_export(base) if base else None
    check_inputs(exports, base_export)
    tokenizer = check_vocabularies(exports, base_export)
    record, differ = merged_record(exports)
    st = all(m.sentence_transformers for m in exports)
    MergeConfiguration, run_merge, MergeOptions, method_named = mergekit()
    dtype = str(exports[0].config.dtype or torch.float32).removeprefix("torch.")
    named = configuration(method, [local_name(m) for m in models], weights, t, base and local_name(base), lambda_,
                          dtype)
    source = MergeConfiguration.model_validate(named).to_yaml()
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    with directory_beside(output) as out, tempfile.TemporaryDirectory(prefix=".merge-", dir=parent) as work:
        staged = [stage(m, os.path.join(work, str(i))) for i, m in enumerate(exports)]
        staged_base = stage(base_export, os.path.join(work, "base")) if base_export else None
        config = MergeConfiguration.model_validate(configuration(method, staged, weights, t, staged_base, lambda_,
                                                                 dtype))
        merged = os.path.join(work, "merged")
        run_merge(config, merged, MergeOptions(copy_tokenizer=False, quiet=not progress), config_source=source)
        write_export(merged, out, record, tokenizer, st)
        data = card_metadata(exports, base_export, method, is_encoder(record, st), st)
        text = card_body(output, exports, base_export, method, weights, t, lambda_, record, differ, source, st,
                         tokenizer, method_named(method).spec)
        ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}").save(os.path.join(out, "README.md"))
    return differ


USAGE = """Merge exports of one architecture into one export with mergekit (pip install 'decoder-encoders[merge]'):
``python launch/merge.py --method linear|slerp|task_arithmetic --models DIR DIR ... --output DIR
[--weights W W ...] [--t T] [--base DIR] [--lambda L] [--no-progress]``.

linear: the weighted mean (weights default 1 each, divided by their sum); slerp: two exports, --t from 0 (the first)
to 1 (the second), default 0.5; task_arithmetic: --base plus --lambda (default 1) x the sum of each export's weight x
its difference from the base (weights default 1, not normalised). The exports must share their architecture, their
tokenizer's vocabulary and how they read text (the record's attention, pooling, layout, ...): a difference is refused
in one line before any weight is read. The merge keeps the record (the first export's defaults and history where the
inputs differ), the tokenizer, the sentence-transformers files when every export has them, and writes mergekit's
configuration (mergekit_config.yml) and a model card naming the method, the inputs and their weights (docs/export.md).
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, choices=METHODS, help="mergekit's merge method")
    p.add_argument("--models", required=True, nargs="+", metavar="DIR", help="the exports to merge (directories)")
    p.add_argument("--output", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--weights", nargs="+", type=float, metavar="W", help="one per export (linear, task_arithmetic; default 1 each)")
    p.add_argument("--t", type=float, help="slerp: 0 is the first export, 1 the second (default 0.5)")
    p.add_argument("--base", metavar="DIR", help="task_arithmetic: the checkpoint each export's difference is taken from")
    p.add_argument("--lambda", dest="lambda_", type=float, metavar="L", help="task_arithmetic: the sum's scale (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:
        differ = merge(args.method, args.models, args.output, args.weights, args.t, args.base, args.lambda_,
                       not args.no_progress)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged {', '.join(args.models)} ({args.method}) into {args.output}"
          + (f"; the inputs' records differ in {', '.join(differ)}: kept the first's" if differ else ""))
    return 0
