"""Train a sentencepiece BPE tokenizer for from-scratch runs and save it as an HF tokenizer directory, and the
command line (``pipeline-train-tokenizer`` runs the same):

    python data_prep/train_tokenizer.py --input 'data/sample/train/chunk*/example_train_*.jsonl.zst' \\
        --vocab-size 8000 --output data/sample/tokenizer

Llama-style: BPE with byte fallback (no unknown characters), digits split, no normalisation, a dummy prefix space;
``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<pad>``=3 and a dedicated ``<mask>``=4, all control symbols, so text can
never produce them. DIR holds ``tokenizer.model`` (used by data prep as the fast backend) and the HF files that
``AutoTokenizer.from_pretrained(DIR)`` loads. Training is single-threaded and seeded, so the same inputs and
options give byte-identical files. Sentencepiece trains on lines: each document is split at newlines, which it
then encodes as the byte token ``<0x0A>``.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from collections.abc import Iterator

import sentencepiece as spm

from pipeline.data.prep.sources import InputError, RecordStats, expand_inputs, read_texts
from pipeline.tokenizer import Tokenizer, hf_from_sentencepiece, load_tokenizer

SPECIALS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
MASK = "<mask>"
MAX_LINE_BYTES = 1 << 14  # sentencepiece drops longer lines; its default of 4192 would lose long web paragraphs


def iter_lines(paths: list[str], text_field: str, stats: dict[str, RecordStats]) -> Iterator[str]:
    """Non-blank lines of every document; bad records are counted in ``stats`` per file."""
    for path in paths:
        stats[path] = RecordStats()
        for text in read_texts(path, text_field, stats[path]):
            yield from (line for line in text.split("\n") if line.strip())


def train_model(lines: Iterator[str], vocab_size: int, seed: int, max_lines: int) -> bytes:
    """The serialized sentencepiece model. Written through ``model_writer`` so no output path is embedded in it."""
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    ids = {f"{name}_id": i for i, name in enumerate(SPECIALS)}
    pieces = {f"{name}_piece": piece for name, piece in SPECIALS.items()}
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, model_type="bpe", vocab_size=vocab_size, **ids, **pieces,
        control_symbols=[MASK], byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        character_coverage=0.9995, max_sentence_length=MAX_LINE_BYTES, input_sentence_size=max_lines,
        shuffle_input_sentence=True, num_threads=1, minloglevel=2)
    return model.getvalue()


def save(model: bytes, output: str) -> Tokenizer:
    """Write ``tokenizer.model`` and the HF files into ``output`` (refusing a directory holding anything else),
    then load it back through the pipeline's loader, which must pick the sentencepiece backend."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(model)
        hf_from_sentencepiece(os.path.join(tmp, "tokenizer.model"), add_bos_token=True).save_pretrained(tmp)
        names = sorted(os.listdir(tmp))
        os.makedirs(output, exist_ok=True)
        stray = sorted(set(os.listdir(output)) - set(names))
        if stray:
            raise SystemExit(f"--output {output} holds other files {stray}; pass a new or empty directory")
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(output, name))
    tok = load_tokenizer(output)
    if tok.backend != "sentencepiece":
        raise RuntimeError(f"{output}: the HF tokenizer gives other ids than tokenizer.model; this is a bug in "
                           f"{__file__}, please report it")
    return tok


def main(argv: list[str] | None = None) -> int:
    """The command line; errors exit through SystemExit with their message."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="globs of .jsonl / .jsonl.zst / .jsonl.gz / .parquet "
                    "files or HF dataset directories")
    ap.add_argument("--vocab-size", type=int, required=True, help="total vocabulary size, special tokens included")
    ap.add_argument("--output", required=True, help="tokenizer directory to write")
    ap.add_argument("--text-field", default="text", help="record field holding the document (default: text)")
    ap.add_argument("--seed", type=int, default=0, help="seed of sentencepiece's line sampling (default: 0)")
    ap.add_argument("--max-lines", type=int, default=10_000_000,
                    help="train on a uniform sample of this many lines when the input has more (default: 10M)")
    args = ap.parse_args(argv)
    try:
        paths = expand_inputs(args.input)
    except InputError as e:
        raise SystemExit(str(e)) from e
    stats: dict[str, RecordStats] = {}
    try:
        model = train_model(iter_lines(paths, args.text_field, stats), args.vocab_size, args.seed, args.max_lines)
    except RuntimeError as e:
        error = e
    else:
        error = None
    for path, s in stats.items():
        if s.num_bad:
            print(f"{path}: skipped {s.num_bad} bad records {s.bad}; first: {s.examples[0]}", file=sys.stderr)
    if not sum(s.documents for s in stats.values()):
        raise SystemExit(f"--input {args.input}: no usable documents in field {args.text_field!r}")
    if error is not None:
        raise SystemExit(f"sentencepiece training on {args.input} failed: {error}")
    tok = save(model, args.output)
    info = tok.info
    print(f"tokenizer: {args.output}")
    print(f"fingerprint: {info.fingerprint}")
    print(f"vocab_size: {info.vocab_size}")
    print(f"bos_id: {info.bos_id}  eos_id: {info.eos_id}  pad_id: {info.pad_id}  mask_id: {info.mask_id}  "
          f"special_ids: {list(info.special_ids)}")
    return 0
