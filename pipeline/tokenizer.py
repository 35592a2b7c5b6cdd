"""One loader for every tokenizer the pipeline accepts: an HF tokenizer directory or a sentencepiece ``.model``.

The HF tokenizer is the reference for token ids. Where a sentencepiece model sits beside it (``tokenizer.model``,
``spiece.model``, or a bare ``.model``) and gives identical ids on a probe text, ``encode_batch`` uses sentencepiece
instead: it is faster per core (~1.7x HF's batch call for the 8k sample tokenizer, ~3x against a 32k byte-level
BPE in the feasibility notes), and tokenization is the cost of data prep.

Plain-text encoding never yields special ids: a literal ``<s>`` or ``<mask>`` inside a document is encoded as text
(HF ``split_special_tokens=True``; sentencepiece never matches control symbols in text), so masking and document
boundaries cannot be forged by the data.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import asdict, dataclass

import numpy as np
import sentencepiece as spm
import transformers

# Files that define an HF tokenizer's ids besides the class's own vocab files. Model weights and config.json in
# the same directory are left out, so the fingerprint names the tokenizer, not the checkpoint.
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
HF_MARKER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Hashed under a fixed name, so a renamed copy of a .model has the same fingerprint.
BARE_MODEL_NAME = "sentencepiece.model"
# Texts on which the sentencepiece backend must reproduce the HF ids before it is used: whitespace runs and edges,
# newlines and tabs, digits, NFC/NFD and NFKC-sensitive characters, non-Latin scripts, emoji, literal special-token
# strings, and the metaspace character itself.
PROBE_TEXTS = (
    "HAMLET.\nTo be, or not to be: that is the question:\n  Whether 'tis nobler in the mind to suffer",
    " leading space", "  two leading spaces", "trailing space ", "\nleading newline", "tab\tand\r\nCRLF",
    "runs  of   spaces    here", "1,234,567.89 and 2024-05-17", "caf\u00e9 cafe\u0301 \ufb01 \uff21\uff22 \u00bd",
    "\u65e5\u672c\u8a9e \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \U0001f600",
    "<s> </s> <pad> <mask> <unk> [MASK] <|endoftext|>", "\u2581metaspace \u2581\u2581twice", "",
)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a shard directory records about its tokenizer; the fingerprint is what the trainer checks."""

    fingerprint: str  # sha256 over the tokenizer's files (sorted names + bytes), stable across copies/paths
    vocab_size: int  # len(tokenizer), i.e. including added tokens
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    mask_id: int | None
    special_ids: tuple[int, ...]  # all special / added-special ids; these are never masked

    def as_dict(self) -> dict:
        return {**asdict(self), "special_ids": list(self.special_ids)}


def fingerprint_files(files: dict[str, str]) -> str:
    """sha256 over ``{name: path}`` in name order; each entry is length-prefixed so no two file sets collide."""
    h = hashlib.sha256()
    for name in sorted(files):
        with open(files[name], "rb") as f:
            data = f.read()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


class Tokenizer:
    """An HF tokenizer plus, where it gives identical ids, a sentencepiece processor for fast batch encoding."""

    def __init__(self, path: str, hf: transformers.PreTrainedTokenizerBase, files: dict[str, str],
                 sp_model: str | None):
        self.path = path
        self.hf = hf
        self.files = files
        self._sp = _matching_sentencepiece(hf, sp_model) if sp_model else None
        self.backend = "sentencepiece" if self._sp is not None else "hf"
        special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
        if self._sp is not None:
            special |= {i for i in range(self._sp.get_piece_size())
                        if self._sp.is_control(i) or self._sp.is_unknown(i)}
        self.info = TokenizerInfo(
            fingerprint=fingerprint_files(files), vocab_size=len(hf), bos_id=hf.bos_token_id,
            eos_id=hf.eos_token_id, pad_id=hf.pad_token_id, mask_id=hf.mask_token_id,
            special_ids=tuple(sorted(special)))

    bos_id = property(lambda self: self.info.bos_id)
    eos_id = property(lambda self: self.info.eos_id)
    pad_id = property(lambda self: self.info.pad_id)
    mask_id = property(lambda self: self.info.mask_id)
    special_ids = property(lambda self: self.info.special_ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with no BOS/EOS added and no special token matched inside the text."""
        if self._sp is not None:
            return self._sp.encode(list(texts))
        return _hf_encode(self.hf, list(texts))

    def save(self, out: str) -> None:
        """Write the tokenizer into directory ``out``. An HF directory's files are copied verbatim, so the copy keeps
        the fingerprint and a model exported with it still matches shards made with the original."""
        os.makedirs(out, exist_ok=True)
        if os.path.isdir(self.path):
            for name, src in self.files.items():
                shutil.copyfile(src, os.path.join(out, name))
        else:
            self.hf.save_pretrained(out)

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])

    def regular_ids(self) -> np.ndarray:
        """int32 ids that are not special: the pool for random MLM replacement."""
        return np.setdiff1d(np.arange(self.info.vocab_size), np.asarray(self.info.special_ids, dtype=np.int64)
                            ).astype(np.int32)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, backend={self.backend}, vocab_size={self.info.vocab_size})"


def _hf_encode(hf: transformers.PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:  # transformers raises IndexError on an empty batch
        return []
    return hf(texts, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False,
              return_token_type_ids=False)["input_ids"]


def _matching_sentencepiece(hf: transformers.PreTrainedTokenizerBase, model_file: str
                            ) -> spm.SentencePieceProcessor | None:
    """The sentencepiece processor if it has the same vocabulary size and ids as ``hf`` on PROBE_TEXTS, else None.
    Single-threaded: data prep parallelises over processes, one per core."""
    try:
        sp = spm.SentencePieceProcessor(model_file=model_file, num_threads=1)
    except (OSError, RuntimeError):  # e.g. a tiktoken file under the name tokenizer.model
        return None
    if sp.get_piece_size() != len(hf) or sp.encode(list(PROBE_TEXTS)) != _hf_encode(hf, list(PROBE_TEXTS)):
        return None
    return sp


def _load_hf_dir(path: str) -> Tokenizer:
    present = [name for name in HF_MARKER_FILES if os.path.isfile(os.path.join(path, name))]
    if not present:
        raise ValueError(f"{path} is not a tokenizer directory: it has none of {', '.join(HF_MARKER_FILES)}; pass a "
                         f"directory written by save_pretrained or data_prep/train_tokenizer.py, or a .model file")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers and tokenizers raise many types (even bare Exception) for bad files
        raise ValueError(f"{path}: transformers cannot load this tokenizer directory ({type(e).__name__}: {e}); "
                         f"check its tokenizer_config.json and tokenizer.json, or re-save it with save_pretrained"
                         ) from e
    names = {*hf.vocab_files_names.values(), *HF_CONFIG_FILES}
    files = {n: os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))}
    sp_name = hf.vocab_files_names.get("vocab_file", "tokenizer.model")
    sp_model = files.get(sp_name) if sp_name.endswith(".model") else None
    return Tokenizer(path, hf, files, sp_model)


def hf_from_sentencepiece(model_file: str, **kwargs) -> transformers.PreTrainedTokenizerFast:
    """An HF fast tokenizer equivalent to a sentencepiece model, with its pad piece and a ``<mask>`` piece (when
    the model has them) as special tokens. The generic class keeps sentencepiece's normaliser and dummy prefix
    exactly; ``LlamaTokenizer`` would rebuild them and differ on texts that start with a space."""
    sp = spm.SentencePieceProcessor(model_file=model_file)
    if sp.pad_id() >= 0:
        kwargs.setdefault("pad_token", sp.id_to_piece(sp.pad_id()))
    if sp.piece_to_id("<mask>") != sp.unk_id():
        kwargs.setdefault("mask_token", "<mask>")
    cls = transformers.PreTrainedTokenizerFast
    return cls(**cls.convert_to_native_format(vocab_file=model_file, **kwargs))


def _load_sentencepiece(path: str) -> Tokenizer:
    try:
        spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path} is not a sentencepiece model ({e}); pass a .model written by spm_train or "
                         f"data_prep/train_tokenizer.py, or the directory of an HF tokenizer") from e
    return Tokenizer(path, hf_from_sentencepiece(path), {BARE_MODEL_NAME: path}, path)


def check_tokenizer_path(path: str) -> None:
    """The tokenizer exists: checked as it loads, and by the sweep before it queues a run that would load it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} does not exist: pass an HF tokenizer directory or a sentencepiece "
                                f".model file (train one with data_prep/train_tokenizer.py)")


def load_tokenizer(path: str) -> Tokenizer:
    """Load an HF tokenizer directory (local only, never the hub) or a sentencepiece ``.model`` file."""
    check_tokenizer_path(path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    return _load_sentencepiece(path)
