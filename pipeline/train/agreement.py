"""Cross-rank agreement of preflight: every rank runs rank 0's experiment with rank 0's code
(:func:`check_same_run`), and each check of :func:`~pipeline.train.preflight.agreed_preflight` ends agreed
(:func:`agreed`): the first failure of any rank is reported once, by rank 0, as one line (:func:`failure_line`)."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from collections.abc import Callable

from pipeline.config import ConfigError, to_dict
from pipeline.experiment import ExperimentConfig
from pipeline.train import errors


class PreflightFailed(Exception):
    """A rank's preflight failed; rank 0 has printed why."""


def code_digest() -> str:
    """sha256 of the pipeline package's Python sources, in path order: what each rank runs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _first_difference(a, b, key: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else k)
    return f"{key or 'the experiment'}: {b!r} there, {a!r} on rank 0"


def check_same_run(exp: ExperimentConfig, world: int) -> None:
    """Every rank trains what rank 0 trains, with the same code: nodes that read other files (another checkout, a
    stale copy of the experiment, other --set options) would otherwise train together on mismatched settings."""
    import torch.distributed as dist

    mine = (socket.gethostname(), code_digest(), to_dict(exp))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    host0, code0, exp0 = everyone[0]
    for r, (host, code, exp_r) in enumerate(everyone[1:], 1):
        where = f"rank {r} on {host} runs"
        if code != code0:
            raise ConfigError(f"{where} other code than rank 0 on {host0} (pipeline/ differs); launch every node "
                              f"from the same checkout")
        if exp_r != exp0:
            raise ConfigError(f"{where} another experiment than rank 0 on {host0}, "
                              f"{_first_difference(exp0, exp_r)}; launch every node with the same --experiment file "
                              f"and --set options")


def agreed(rank: int, world: int, check: Callable[[], object], on_failure: Callable[[], None]):
    """``check()`` on every rank; when any rank fails, rank 0 prints the first failure once, no rank leaves before
    it has (a rank's exit makes the launcher signal the others), and every rank raises :class:`PreflightFailed`."""
    import torch.distributed as dist

    result, failure = None, None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - reported below, once
        failure = failure_line(e)
    failures: list = [None] * world
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return result
    on_failure()
    if rank == 0:
        print(first, file=sys.stderr, flush=True)
    dist.barrier()
    raise PreflightFailed(first)


def failure_line(e: Exception) -> str:
    """The one line that reports a failed check: ``config error: ...`` for a setting, else ``error: ...``."""
    return f"{'config error' if isinstance(e, ConfigError) else 'error'}: {errors.one_line(e)}"
