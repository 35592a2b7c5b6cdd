"""What a model card may say about where an export came from, as the Hub reads it: Hub ids only (a local path in
``base_model`` links nowhere and leaks the machine's layout), the license the start model carries, and local files
named by what stays true on any machine (a path inside the repository, else the file name)."""

from __future__ import annotations

import os

from huggingface_hub import metadata_load
from huggingface_hub.utils import HFValidationError, validate_repo_id

from pipeline.experiment import ExperimentConfig
from pipeline.io import REPO
from pipeline.model.presets import PRESETS

PRESET_LICENSE = "apache-2.0"  # a run from a preset: the weights are the project's own work, under its license
CACHE_PREFIX = "models--"  # huggingface_hub's cache: .../models--{namespace}--{name}/snapshots/{revision}/


def local_name(path: str) -> str:
    """``path`` as a card names it: relative to the repository when inside it (the commands run from there), else
    its last component; never absolute."""
    full = os.path.abspath(path)
    if full.startswith(REPO + os.sep):
        return os.path.relpath(full, REPO)
    return os.path.basename(os.path.normpath(path)) or path


def is_hub_id(value: object) -> bool:
    """Whether ``value`` names a Hub repository and not a local path (which may look like ``namespace/name``)."""
    if not isinstance(value, str) or os.path.exists(value):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def cached_hub_id(path: str) -> str | None:
    """The Hub id of a checkpoint that sits in huggingface_hub's cache (``snapshot_download``'s directory)."""
    parts = os.path.abspath(path).split(os.sep)
    for part, below in zip(parts, parts[1:]):
        if part.startswith(CACHE_PREFIX) and below == "snapshots":
            return part[len(CACHE_PREFIX):].replace("--", "/")  # "--" cannot occur in a Hub id
    return None


def start_card(exp: ExperimentConfig) -> dict:
    """The YAML front matter of the start checkpoint's own ``README.md`` ({} for a preset or a card-less start)."""
    path = os.path.join(exp.model.init, "README.md")
    if exp.model.init in PRESETS or not os.path.isfile(path):
        return {}
    return metadata_load(path) or {}


def start_hub_id(exp: ExperimentConfig) -> str | None:
    """The Hub id of the start checkpoint itself: ``export.base_model``, else that of a start in the HF cache."""
    if exp.export.base_model:
        return exp.export.base_model
    return None if exp.model.init in PRESETS else cached_hub_id(exp.model.init)


def adapter_base(exp: ExperimentConfig) -> str:
    """What a LoRA adapter names as its ``base_model_name_or_path``: the start checkpoint's Hub id, else its
    absolute path (a relative one loads only from the directory the run was started in). Not the start card's
    inherited ``base_model``: that is an ancestor, not the weights the adapter was trained on."""
    return start_hub_id(exp) or os.path.abspath(exp.model.init)


def base_model(exp: ExperimentConfig, start: dict) -> str | list[str] | None:
    """The start checkpoint's Hub id (:func:`start_hub_id`); else the start card's own ``base_model`` (an export
    of this project started from a Hub model: its Hub ancestor); None for a preset."""
    own = start_hub_id(exp)
    if own or exp.model.init in PRESETS:
        return own
    inherited = start.get("base_model")
    ids = [m for m in (inherited if isinstance(inherited, list) else [inherited]) if is_hub_id(m)]
    return (ids[0] if len(ids) == 1 else ids) or None


def license_fields(exp: ExperimentConfig, start: dict) -> dict[str, str]:
    """``license`` (with the start card's ``license_name`` / ``license_link`` for its ``other``): ``export.license``,
    else the start card's, else for a preset :data:`PRESET_LICENSE`; {} when nothing says."""
    if exp.export.license:
        return {"license": exp.export.license}
    if start.get("license"):
        return {k: start[k] for k in ("license", "license_name", "license_link") if start.get(k)}
    return {"license": PRESET_LICENSE} if exp.model.init in PRESETS else {}
