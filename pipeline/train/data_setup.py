"""Make sure the experiment's shard directory exists: rank 0 builds it from ``data.build_inputs`` when missing."""

from __future__ import annotations

import os

import torch.distributed as dist

from pipeline.data.build import run_job
from pipeline.data.build_config import BuildConfig
from pipeline.data.manifest import MANIFEST, DatasetIndex, load_index
from pipeline.train.experiment import DataConfig


def ensure_shards(data: DataConfig, tokenizer, rank: int) -> DatasetIndex:
    missing = not os.path.exists(os.path.join(data.shards, MANIFEST))
    if missing and not data.build_if_missing:
        raise FileNotFoundError(f"{data.shards}: no shard directory; build it with data_prep/build_shards.py "
                                f"or set data.build_if_missing=true with data.build_inputs")
    if missing and rank == 0:
        print(f"building shards of {data.build_inputs} into {data.shards} (seq_len {data.seq_len})", flush=True)
        run_job(BuildConfig(inputs=tuple(data.build_inputs), tokenizer=tokenizer.path, output=data.shards,
                            seq_len=data.seq_len, workers=1, progress=False))
    if dist.is_initialized():
        dist.barrier()
    return load_index(data.shards)
