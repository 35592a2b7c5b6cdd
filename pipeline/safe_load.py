"""``torch.load`` of checkpoint files without running code: pickle lets a file name any function to call while it is
read, so a checkpoint directory from elsewhere could run code through a plain ``torch.load``. Every file the project
loads itself (RNG states, the universal optimizer's parameter groups, a ZeRO stage 0 export, and through
``pipeline.train.async_checkpoint.WeightsOnlyLoads`` the engine's model and optimizer states at a resume) is read
with ``weights_only=True`` and only the types these files hold allowed; anything else is refused with one line
naming the file and the type. Before any file of a checkpoint directory is read (a resume's preflight, an export,
so an evaluation's export) and so before DeepSpeed's own unpickling loaders get it, :func:`check_directory` checks
the whole directory: its links stay inside, every file's list of types is read without unpickling, parameter names
are no paths. torch is imported where a file is read: a start's first checks (:func:`check_links`) come before it.
docs/reliability.md says what DeepSpeed unpickles itself.
"""

from __future__ import annotations

import functools
import os
import pickle
import re

import numpy as np

# numpy's array rebuilder: numpy.core.multiarray._reconstruct before numpy 2, numpy._core... since (either name
# may be in a file: the numpy that wrote it)
_RECONSTRUCT = np.zeros(0).__reduce__()[0]


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that names a function or class outside :func:`allowed_types` (or is no torch file)."""


@functools.cache
def allowed_types() -> tuple:
    """What the project's checkpoint files hold besides tensors and plain containers: numpy's RNG state (a uint32
    array), and DeepSpeed's records in its optimizer states: the ZeRO stage, the loss scaler, and ZeRO 1/2's
    parameter slice addresses (imported here: only a resume or an export pays for importing DeepSpeed)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (_RECONSTRUCT, (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
            (_RECONSTRUCT, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


def _refusal(path: str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{path}: not loaded: {what}; the project's checkpoints hold, inside their own directory, only tensors, "
        f"numpy RNG states and DeepSpeed's optimizer records (weights_only). Resume or export only checkpoints this "
        f"project wrote, and check where this directory came from")


def load_weights_only(path: str, map_location=None):
    """``torch.load(path)`` allowing only :func:`allowed_types`; raises :class:`UnsafeCheckpoint` naming the file."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed_types())):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        raise _refusal(path, f"it names {found.group(1)}, which unpickling would call" if found else
                       f"it is not a plain torch file ({str(e).splitlines()[-1].strip() or type(e).__name__})") from None


def check_directory(directory: str) -> None:
    """The one check of a checkpoint directory before anything of it is read (a resume's preflight, an export, an
    evaluation's export): :func:`check_links`; every ``.pt`` file names only :func:`allowed_types`, read without
    unpickling; and every parameter name a ZeRO model state gives the universal conversion, which makes each a
    folder, is a name and not a path (``..``). DeepSpeed's own loaders (the universal conversion and load,
    ``zero_to_fp32``) unpickle with ``weights_only=False``."""
    import torch

    check_links(directory)
    with torch.serialization.safe_globals(list(allowed_types())):
        for here, _, files in os.walk(os.path.realpath(directory)):
            for name in sorted(n for n in files if n.endswith(".pt")):
                _check_file(os.path.join(here, name))


def check_links(directory: str) -> None:
    """Every entry of ``directory``, followed to its real path, stays inside it (a link out of it, as ``universal
    -> ../../elsewhere``, is refused: ``os.walk`` alone does not enter a linked directory). What a start checks
    before torch is imported, so that it reads the checkpoint's JSON records (its experiment, global batch, shards)
    from the directory itself; :func:`check_directory` makes it again with the rest."""
    root = os.path.realpath(directory)
    for here, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(here, name)
            if os.path.commonpath([root, os.path.realpath(path)]) != root:
                raise _refusal(path, f"it links to {os.path.realpath(path)}, outside the checkpoint directory "
                                     f"{directory}")


def _check_file(path: str) -> None:
    import torch

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - not a zip of a pickle: torch raises several kinds
        raise _refusal(path, f"it is not a plain torch file ({type(e).__name__}: {e})") from None
    if unsafe:
        raise _refusal(path, f"it names {unsafe[0]}, which unpickling would call")
    if path.endswith("model_states.pt"):
        states = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: names, not weights
        try:
            names = [n for group in states.get("param_shapes") or () for n in group] + list(
                states.get("frozen_param_shapes") or {})
        except (AttributeError, TypeError):
            raise _refusal(path, "its param_shapes are not DeepSpeed's (lists of name -> shape maps)") from None
        if bad := next((n for n in names if not _plain_name(n)), None):
            raise _refusal(path, f"it names the parameter {bad!r}, which the universal conversion would make a "
                                 f"path outside its folder")


def _plain_name(name) -> bool:
    """A parameter name that is one folder name: no separator, not ``.`` or ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
