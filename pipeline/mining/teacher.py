"""Embed the texts of pair shards once with a teacher, for distillation (``data_prep/teacher_embed.py``):

    python data_prep/teacher_embed.py --shards runs/shards/pairs --model runs/big/hf [--output DIR]

The teacher is this project's export or run (``encode``) or a sentence-transformers directory (its ``encode_query``
/ ``encode_document``), read by the miner's :class:`Embedder`: unit-length float32 embeddings. The texts are each
slot's pooled tokens decoded with the shards' tokenizer: what the student pools (cut to the slot's width, without
its instruction), so teacher and student see one text. The files (``pipeline.data.format.teacher``) are written
whole, the record last, in ``--output`` (default ``<shards>/teacher``); the ``distill`` objective reads them.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from pipeline.data.format.index import DatasetIndex, load_index
from pipeline.data.format.tar_shard import ShardReader
from pipeline.data.format.teacher import KEYS, RECORD, default_directory, slot_names
from pipeline.io import fsync_replace, write_json_atomic
from pipeline.mining.cli import ENCODERS, Embedder, MineConfig
from pipeline.tokenizer import load_tokenizer


def slot_texts(index: DatasetIndex, tokenizer_path: str = "") -> tuple[list[str], list[list[str]]]:
    """(sample keys, each slot's texts) of the pair shards, in sample order."""
    tok = load_tokenizer(tokenizer_path or index.tokenizer_path)
    keys, columns = [], [[] for _ in range(index.pairs["slots"])]
    for info in index.shards:
        for sample in ShardReader(info.path):
            keys.append(sample.key)
            for column, (begin, end) in zip(columns, sample.pool_spans):
                column.append(tok.hf.decode(sample.input_ids[begin:end].tolist()))
    return keys, columns


def embed_shards(shards: str, model: str, output: str = "", encoder: str = "auto", tokenizer: str = "",
                 batch_size: int = 32, max_length: int = 512, progress: bool = True) -> dict:
    """Write the teacher's embeddings of every slot of ``shards`` and its record; returns the record."""
    index = load_index(shards)
    if index.pairs is None:
        raise ValueError(f"{shards}: not pair shards (built without --pairs); point --shards at "
                         "data_prep/build_shards.py --pairs output")
    output = output or default_directory(shards)
    embed = Embedder(MineConfig(inputs=(), model=model, output=output, encoder=encoder, batch_size=batch_size,
                                max_length=max_length, progress=progress))
    keys, columns = slot_texts(index, tokenizer)
    os.makedirs(output, exist_ok=True)
    dim = 0
    for s, (name, texts) in enumerate(zip(slot_names(len(columns)), columns)):
        values = embed(texts, query=s == 0).numpy().astype(np.float32)
        dim = values.shape[1]
        save_npy(os.path.join(output, f"{name}.npy"), values)
    save_npy(os.path.join(output, KEYS), np.array(keys))
    teacher = embed.describe()
    record = {"teacher": teacher, "dim": dim, "normalized": True,
              "pooling": teacher.get("record", {}).get("pooling", "the sentence-transformers modules'"),
              "texts": "each slot's pooled tokens decoded with the shards' tokenizer",
              "shards": os.path.abspath(shards), "shards_fingerprint": index.fingerprint,
              "samples": len(keys), "slots": len(columns)}
    write_json_atomic(os.path.join(output, RECORD), record)
    return record


def save_npy(path: str, values: np.ndarray) -> None:
    """``values`` to ``path`` through a temporary file: a killed run leaves no short file under the name."""
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, values)
    fsync_replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="a pair shard directory (build_shards.py --pairs)")
    p.add_argument("--model", required=True, help="the teacher: our export or run, or a sentence-transformers dir")
    p.add_argument("--output", default="", help="the teacher directory (default <shards>/teacher)")
    p.add_argument("--encoder", choices=ENCODERS, default="auto")
    p.add_argument("--tokenizer", default="", help="the shards' tokenizer (default: the one their manifest names)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        record = embed_shards(a.shards, a.model, a.output, a.encoder, a.tokenizer, a.batch_size, a.max_length,
                              not a.no_progress)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{record['samples']} rows x {record['slots']} texts, dim {record['dim']}, in "
          f"{a.output or default_directory(a.shards)}")
    return 0
