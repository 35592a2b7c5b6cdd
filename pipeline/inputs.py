"""An experiment's input paths, checked before anything starts: each shard directory holds shards or can be built,
the inputs named to build it from exist and are what it was built from, and the tokenizer exists
(``pipeline.tokenizer.check_tokenizer_path``). Preflight calls these before a run trains and the sweep before it
queues one, so each check lives here once (below ``pipeline.train``, which the sweep may not import)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from pipeline.config import ConfigError
from pipeline.data.format.index import MANIFEST, load_manifest
from pipeline.data.format.remote import ShardStore, is_url
from pipeline.data.prep.manifest import built_otherwise, fingerprinted_otherwise
from pipeline.data.prep.sources import InputError, expand_inputs
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


def shards_fingerprint(directory: str, d: DataConfig) -> str:
    """The fingerprint of the shards in ``directory`` (local or at a URL), as its manifest records it."""
    if is_url(directory):
        return load_manifest(directory.rstrip("/"), shard_store(d))["fingerprint"]
    return load_manifest(directory)["fingerprint"]


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


def built_from_others(directory: str, inputs: Sequence[str], seq_len: int, d: DataConfig,
                      tokenizer: str | None) -> list[str]:
    """How the shards in ``directory`` differ from those its named ``inputs`` build with the tokenizer of fingerprint
    ``tokenizer`` (None: not loaded yet, not compared) at ``seq_len``
    (:func:`~pipeline.data.prep.manifest.built_otherwise`); empty when they are those, when no inputs are named,
    and for a directory a run never builds: without shards, at a URL, or of sentence units or pairs
    (``build_shards.py --units/--pairs``, which a units or pairs stage names as data.shards beside the packed inputs
    it inherits)."""
    if not inputs or is_url(directory) or not has_shards(directory, d):
        return []
    manifest = load_manifest(directory)
    if "units" in manifest["settings"] or "pairs" in manifest["settings"]:
        return []
    return built_otherwise(manifest, expand_inputs(inputs), tokenizer, seq_len,
                           (d.build_source_field, d.build_source_default))


def builds_other_shards(directory: str, inputs: Sequence[str], seq_len: int, d: DataConfig) -> bool:
    """Whether the shards that ``inputs`` build at ``seq_len`` cannot be those in ``directory`` (a checkpoint's),
    whatever the tokenizer (:func:`~pipeline.data.prep.manifest.fingerprinted_otherwise`); False where that cannot
    be told: no inputs named, ``directory`` gone or at a URL."""
    if not inputs or is_url(directory) or not has_shards(directory, d):
        return False
    return fingerprinted_otherwise(load_manifest(directory), expand_inputs(inputs), seq_len)


def check_named_inputs(directory: str, setting: str, inputs_setting: str, inputs: Sequence[str], seq_len: int,
                       d: DataConfig, tokenizer: str | None) -> None:
    """Each pattern of ``inputs`` matches a file, whatever ``directory`` holds, and shards there are the ones they
    build (:func:`built_from_others`) or data.rebuild rebuilds them: a run never trains on other data than the
    inputs it names (and its records claim)."""
    try:
        expand_inputs(inputs)
    except InputError as e:
        kept = f", or set {inputs_setting}=[] to read {directory} as built" if has_shards(directory, d) else ""
        raise ConfigError(f"{inputs_setting}: {str(e).removeprefix('--input ')}{kept}") from None
    differences = built_from_others(directory, inputs, seq_len, d, tokenizer)
    if differences and not d.rebuild:
        raise ConfigError(f"{setting}: {directory} was built {'; '.join(differences)}: it does not hold the shards "
                          f"of {inputs_setting}; build them into a new directory (another {setting}), or set "
                          f"data.rebuild=true to rebuild {directory} (beside it, swapped in when complete)")
