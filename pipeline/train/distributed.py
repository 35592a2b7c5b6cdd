"""The process group of a training run: one rank without a launcher, the rendezvous, and leaving a finished rank."""

from __future__ import annotations

import logging
import os
import socket
import sys

# The trainer's own collectives (target counts, logged sums, the stop flag) use small tensors on the training
# device, since NCCL refuses CPU tensors.
DIST_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def single_process_env(env=os.environ) -> bool:
    """``python launch/train.py`` without a launcher: set what torch.distributed needs for one rank (instead of
    DeepSpeed's MPI discovery, which fails without mpi4py). Returns whether it did."""
    if any(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    return True


def _device():
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def start_distributed():
    """(device, rank, world size) once torch.distributed runs: the rendezvous only, no engine yet."""
    import deepspeed
    import torch.distributed as dist

    device = _device()
    deepspeed.init_distributed(dist_backend=DIST_BACKENDS[device.type])
    return device, dist.get_rank(), dist.get_world_size()


def exit_without_teardown(rc: int) -> None:
    """Leave a finished rank without interpreter teardown. DeepSpeed keeps references to its gloo process groups
    past ``destroy_process_group()``, so their threads still run when the interpreter frees modules at exit, and
    now and then a rank of a finished run aborted there ("terminate called without an active exception"; one
    sweep of 36 smoke runs met it once), which the launcher reports as a failed run. Everything the run writes
    is closed by the time training returns; only the streams need flushing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
