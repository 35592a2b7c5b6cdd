"""The process group of a training run: one rank without a launcher, the rendezvous, rank 0's long writes the
others wait for (:func:`on_rank_0`), and leaving a finished rank."""

from __future__ import annotations

import contextlib
import datetime
import glob
import io
import logging
import os
import sys
import time
from collections.abc import Callable

from pipeline.train.deepspeed_ops import arch_list_for_deepspeed, track_build_locks, use_install_ops_dir

# The trainer's own collectives (target counts, logged sums, the stop flag) use small tensors on the training
# device, since NCCL refuses CPU tensors.
DIST_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
CPU_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder op, built when a CPU rank joins
STALE_BUILD_LOCK_S = 600  # DeepSpeed's CPU ops build in about a minute here; a lock this old is almost surely left over


def single_process_env(env=os.environ) -> bool:
    """``python launch/train.py`` without a launcher: set what torch.distributed needs for one rank (instead of
    DeepSpeed's MPI discovery, which fails without mpi4py). Returns whether it did. The store of one rank is its
    own server and client, so it binds port 0 and the OS picks a free port in the bind (a port probed free first
    could be taken before the bind)."""
    if any(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return False
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="0")
    return True


def _device():
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stale_build_locks(min_age_s: float = STALE_BUILD_LOCK_S) -> list[tuple[str, float]]:
    """(path, age in seconds) of each torch-extension build lock older than ``min_age_s``. DeepSpeed builds its ops
    (the CPU ranks' shared-memory collectives, the fused optimizers) with torch's extension builder, whose lock
    file a killed build leaves behind; every later process that needs the op then waits on it forever, silently."""
    now, found = time.time(), []
    for path in sorted(glob.glob(os.path.join(use_install_ops_dir(), "*", "lock"))):
        try:
            age = now - os.path.getmtime(path)
        except OSError:  # released meanwhile
            continue
        if age >= min_age_s:
            found.append((path, age))
    return found


def cpu_op_built() -> bool:
    """Whether DeepSpeed's CPU collectives op is already built in this install's folder."""
    return os.path.isfile(os.path.join(use_install_ops_dir(), CPU_COMM_OP, f"{CPU_COMM_OP}.so"))  # torch's builder's


def say_if_building_cpu_op() -> None:
    """DeepSpeed compiles its CPU collectives op on a machine's first start, about a minute of silence on 2 cores
    that looked like a hang: say so first."""
    if not cpu_op_built():
        print(f"building DeepSpeed's CPU collectives op ({CPU_COMM_OP}) once, about a minute on 2 cores; later starts "
              f"load it from {use_install_ops_dir()}", file=sys.stderr, flush=True)


class _WithoutLine(io.TextIOBase):
    """A text stream that passes each whole line on to ``out`` as it is written, less the lines ``drop`` picks."""

    def __init__(self, out, drop: Callable[[str], bool]):
        self.out, self.drop, self.pending = out, drop, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        self.out.write("".join(f"{line}\n" for line in lines if not self.drop(line)))
        return len(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def built_said_only_when_built():
    """DeepSpeed prints "DeepSpeed ...deepspeed_shm_comm_op built successfully" each time a CPU rank loads the op,
    from the cache too, so every start claimed a build: the block's prints pass through as they come, less that
    line where the op was built before the block."""
    cached, out = cpu_op_built(), sys.stdout
    stream = _WithoutLine(out, lambda line: cached and line.startswith("DeepSpeed ") and "built successfully" in line)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        out.write(stream.pending)


def warn_stale_build_locks() -> None:
    for path, age in stale_build_locks():
        print(f"warning: {path} is {age / 60:.0f} min old: a build of DeepSpeed op "
              f"'{os.path.basename(os.path.dirname(path))}' holds it, or a killed build left it behind, and every "
              f"process that needs the op waits on it without a word. If no compiler is running (pgrep -a "
              f"'ninja|cc1plus'), remove it: rm {path}", file=sys.stderr, flush=True)


class PortTaken(RuntimeError):
    """Rank 0 could not open the rendezvous port: another process (usually another run) listens on it."""


def port_taken_message(port: str) -> str:
    return (f"the rendezvous port {port} (MASTER_PORT) is taken on this machine, most likely by another run; "
            f"pick a free one: deepspeed --master_port PORT launch/train.py ... (torchrun: --master-port PORT)")


def start_distributed():
    """(device, rank, world size) once torch.distributed runs: the rendezvous only, no engine yet. The first local
    rank warns first of build locks that would hang it (DeepSpeed builds ops from here on, into
    :func:`use_install_ops_dir`'s folder, with :func:`arch_list_for_deepspeed`'s TORCH_CUDA_ARCH_LIST). A taken
    port is a :class:`PortTaken` on rank 0 (the other ranks wait for it until the launcher stops them)."""
    import deepspeed
    import torch.distributed as dist

    device = _device()
    use_install_ops_dir()
    arch_list_for_deepspeed()
    track_build_locks()  # a stop in start-up then leaves no build lock behind
    if os.environ.get("LOCAL_RANK", "0") == "0":
        warn_stale_build_locks()
        if device.type == "cpu":
            say_if_building_cpu_op()
    try:
        with built_said_only_when_built():
            deepspeed.init_distributed(dist_backend=DIST_BACKENDS[device.type])
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise PortTaken(port_taken_message(os.environ.get("MASTER_PORT", "?"))) from None
    return device, dist.get_rank(), dist.get_world_size()


# how long the other ranks wait for rank 0's exports at the end of training (pipeline.train.export): zero_to_fp32
# of a large ZeRO-3 checkpoint reads every rank's optimizer files, which may take hours on network storage, well
# past the process group's timeout (30 min by default, after which NCCL's watchdog aborts a waiting rank)
RANK_0_WRITE_TIMEOUT = datetime.timedelta(hours=12)


def on_rank_0(write: Callable[[], None], timeout: datetime.timedelta = RANK_0_WRITE_TIMEOUT) -> None:
    """Collective: rank 0 runs ``write`` while the others wait for it at a barrier of their own gloo group, whose
    timeout is ``timeout`` instead of the process group's."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timeout)
    if dist.get_rank() == 0:
        write()
    dist.barrier(group=group)
    dist.destroy_process_group(group)


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
