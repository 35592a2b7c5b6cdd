"""``torch.load`` of checkpoint files without running code: pickle lets a file name any function to call while it is
read, so a checkpoint directory from elsewhere could run code through a plain ``torch.load``. Every file the project
loads itself (RNG states, the universal optimizer's parameter groups, a ZeRO stage 0 export, and through
``pipeline.train.async_checkpoint.WeightsOnlyLoads`` the engine's model and optimizer states at a resume) is read
with ``weights_only=True`` and only the types these files hold allowed; anything else is refused with one line
naming the file and the type. Before DeepSpeed's own unpickling loaders get a directory (a resume on another world
size, an export of a ZeRO checkpoint), :func:`check_directory` reads every file's list of types without unpickling.
docs/reliability.md says what DeepSpeed unpickles itself.
"""

from __future__ import annotations

import functools
import os
import pickle
import re

import numpy as np
import torch

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
        f"{path}: not loaded: {what}; the project's checkpoint files hold only tensors, numpy RNG states and "
        f"DeepSpeed's optimizer records (weights_only). Resume or export only checkpoints this project wrote, "
        f"and check where this directory came from")


def load_weights_only(path: str, map_location=None):
    """``torch.load(path)`` allowing only :func:`allowed_types`; raises :class:`UnsafeCheckpoint` naming the file."""
    try:
        with torch.serialization.safe_globals(list(allowed_types())):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        raise _refusal(path, f"it names {found.group(1)}, which unpickling would call" if found else
                       f"it is not a plain torch file ({str(e).splitlines()[-1].strip() or type(e).__name__})") from None


def check_directory(directory: str) -> None:
    """Every ``.pt`` file under ``directory`` names only :func:`allowed_types`, read without unpickling it: run
    before DeepSpeed's own loaders get the directory (the universal conversion and load, ``zero_to_fp32``), which
    unpickle with ``weights_only=False``."""
    with torch.serialization.safe_globals(list(allowed_types())):
        for root, dirs, files in os.walk(directory):
            dirs.sort()
            for name in sorted(n for n in files if n.endswith(".pt")):
                path = os.path.join(root, name)
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
                except Exception as e:  # noqa: BLE001 - not a zip of a pickle: torch raises several kinds
                    raise _refusal(path, f"it is not a plain torch file ({type(e).__name__}: {e})") from None
                if unsafe:
                    raise _refusal(path, f"it names {unsafe[0]}, which unpickling would call")
