"""An experiment's input paths, checked before anything starts: each shard directory holds shards or can be built,
and the tokenizer exists (``pipeline.tokenizer.check_tokenizer_path``). Preflight calls these before a run trains
and the sweep before it queues one, so each check lives here once (below ``pipeline.train``, which the sweep may
not import)."""

from __future__ import annotations

import os

from pipeline.config import ConfigError
from pipeline.data.format.index import MANIFEST
from pipeline.data.format.remote import ShardStore, is_url
from pipeline.experiment import DataConfig


def under(root: str, path: str) -> str:
    """``path`` relative to ``root`` (an absolute path or a URL as it is)."""
    return path if is_url(path) else os.path.join(root, path)


def shard_store(d: DataConfig) -> ShardStore:
    """How shard directories at a URL are fetched and cached."""
    return ShardStore(d.cache_dir, int(d.cache_max_gb * 2**30), d.fetch_attempts, d.fetch_timeout_s)


def has_shards(directory: str, d: DataConfig) -> bool:
    if not is_url(directory):
        return os.path.exists(os.path.join(directory, MANIFEST))
    try:
        shard_store(d).size(f"{directory.rstrip('/')}/{MANIFEST}")
    except FileNotFoundError:
        return False
    return True


def check_buildable(directory: str, setting: str, inputs_setting: str, inputs: list[str], seq_len: int,
                    d: DataConfig) -> bool:
    """``directory`` holds shards (True), or data.build_if_missing can build it (locally, from ``inputs``)."""
    if has_shards(directory, d):
        return True
    if is_url(directory):
        raise ConfigError(f"{setting}: {directory} has no {MANIFEST}, and shards are never built at a URL "
                          f"(data.build_if_missing builds local directories only); build them with "
                          f"data_prep/build_shards.py and upload the directory there")
    if not d.build_if_missing:
        raise ConfigError(f"{setting}: {directory} is not a shard directory; build it with "
                          f"data_prep/build_shards.py or set data.build_if_missing=true with data.build_inputs")
    if not inputs:
        raise ConfigError(f"{setting}: {directory} holds no shards (no {MANIFEST}) and {inputs_setting} names "
                          f"nothing to build them from; check the path, build them with data_prep/build_shards.py "
                          f"--output {directory} --seq-len {seq_len} --tokenizer {d.tokenizer} --input FILES, or "
                          f"set data.build_inputs=[FILES] to have rank 0 build them")
    return False
