"""Evaluation across the ranks of a ``torchrun`` / ``deepspeed`` launch: the process group, each rank's device, and
the gather of per-rank rows back into input order.

Entry points (``launch/evaluate.py``, ``MTEBEncoder``) call :func:`init_from_env`: under a launcher (``WORLD_SIZE``
> 1) it starts the process group from the launcher's environment (NCCL when the ranks run on CUDA, else gloo) and
puts each rank on its own GPU (``cuda`` -> ``cuda:LOCAL_RANK``); alone it does nothing. ``encode()`` splits its work
over whatever group is initialised and never starts one itself, so a library caller chooses. Rows are gathered on
the host over gloo (a gloo group beside NCCL's): embeddings are kept in host memory, not on the GPUs.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str = "cpu") -> str:
    """Start the process group of a launch with ``WORLD_SIZE`` > 1 (once); the device this rank runs on."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return device
    cuda = torch.device(device).type == "cuda"
    if cuda and torch.device(device).index is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def lockstep(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weights are ZeRO-3 partitions (an evaluator during training): each forward gathers them
    from every rank, so every rank must run every forward, as many as the busiest rank."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


@functools.cache
def _host_group():
    """A gloo group for host tensors: the default group when it is gloo, else one made beside it (every rank
    reaches this in the same call, as ``new_group`` requires)."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def gather_rows(local: torch.Tensor, owned: list[list[int]], total: int, to_all: bool) -> np.ndarray | None:
    """Rows ``local`` [n_rank, d] (host, float32) of this rank, where ``owned[r]`` lists the input index of each row of
    rank ``r``, gathered into [total, d] in input order: on every rank (``to_all``), else on rank 0 (None elsewhere)."""
    rank, size = world()
    width = max(len(o) for o in owned)
    padded = torch.zeros((width, local.shape[1]), dtype=local.dtype)
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(size)] if to_all or rank == 0 else None
    if to_all:
        dist.all_gather(parts, padded, group=_host_group())
    else:
        dist.gather(padded, parts, dst=0, group=_host_group())
    if parts is None:
        return None
    out = np.zeros((total, local.shape[1]), dtype=np.float32)
    for part, rows in zip(parts, owned):
        out[rows] = part[: len(rows)].numpy()
    return out
