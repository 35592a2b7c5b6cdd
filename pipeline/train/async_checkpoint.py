"""Checkpoint writes off the training thread (``checkpoint.async_save``): the next steps run while files are written.

DeepSpeed's ``save_checkpoint`` hands every file's state dict to its checkpoint engine. :class:`AsyncCheckpointEngine`
takes that place: ``save`` copies the state dict to host memory (pinned and reused between saves on CUDA, as
torchtitan's ``async_with_pinned_mem``) and queues the write on one writer thread per rank, so the step stalls only
for the copy. The run directory's rule holds: a checkpoint counts once ``COMPLETE`` is written, which a second
thread of rank 0 does only after every rank has reported its files written (``written-rank<r>`` beside them); a run
killed mid-write leaves a directory without ``COMPLETE`` that is never resumed from.

DeepSpeed's own decoupled engine writes through its fast (DeepNVMe, ``async_io``) writer in a spawned process,
which needs the aio op built and is not available on CPU ranks; this one is plain ``torch.save`` in a thread.
Its base, :class:`WeightsOnlyLoads`, is the engine of every run (async or not): it loads without running code.
"""

from __future__ import annotations

import copy
import itertools
import os
import queue
import signal
import threading
import time
from collections.abc import Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from pipeline.run_dir import tag
from pipeline.safe_load import load_weights_only

RANK_TIMEOUT_S = 900.0  # rank 0 waits this long after its own files for another rank's, then fails the checkpoint


class BackgroundWriter:
    """One daemon thread running queued jobs in order. The first job that raises stops the rest; ``wait`` re-raises
    it in the caller's thread."""

    def __init__(self):
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="checkpoint-writer", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until every queued job has run; raise the first error of one."""
        self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as e:  # noqa: BLE001 -- handed to the training thread by wait()
                self._error = e
            finally:
                self._jobs.task_done()


class HostCopy:
    """A state dict's tensors copied to host memory, its containers rebuilt and anything else deep-copied, so the
    training thread may change the originals at once. On CUDA the copies go to pinned buffers that are reused from
    save to save (``key`` names a file; its tensors keep their order) and are waited for by ``ready``."""

    def __init__(self):
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, obj, key: str) -> tuple[object, Callable[[], None]]:
        copied = self._copy(obj, key, itertools.count())
        if not torch.cuda.is_available():
            return copied, lambda: None
        event = torch.cuda.Event()
        event.record()
        return copied, event.synchronize

    def _copy(self, obj, key: str, counter):
        if torch.is_tensor(obj):
            return self._tensor(obj, (key, next(counter)))
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, key, counter)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self._copy(v, key, counter) for v in obj)
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, slot: tuple[str, int]) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.clone()
        buffer = self._pinned.get(slot)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = self._pinned[slot] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buffer.copy_(t, non_blocking=True)


class WeightsOnlyLoads(CheckpointEngine):
    """DeepSpeed's checkpoint engine ``inner``, loading with ``weights_only`` (:mod:`pipeline.safe_load`): the
    engine's model and optimizer states (with the client state) at a resume run no code from the files. Writing and
    everything else is ``inner``'s."""

    def __init__(self, inner: CheckpointEngine):
        super().__init__()
        self.name, self.inner = inner.name, inner

    def create(self, info: CheckpointCommitInfo):
        return self.inner.create(info)

    def save(self, state_dict, path: str):
        return self.inner.save(state_dict, path)

    def load(self, path: str, map_location=None):
        return load_weights_only(path, map_location)

    def commit(self, info: CheckpointCommitInfo):
        return self.inner.commit(info)

    def makedirs(self, path, exist_ok=False):
        return self.inner.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank):
        return self.inner.is_data_parallel_writer(dp_rank)


class AsyncCheckpointEngine(WeightsOnlyLoads):
    """:class:`WeightsOnlyLoads` with its writes queued on ``writer`` after a host copy."""

    def __init__(self, inner: CheckpointEngine, writer: BackgroundWriter):
        super().__init__(inner)
        self.name = f"Async{inner.name}"
        self.writer, self.host_copy = writer, HostCopy()
        self.tag = ""

    def create(self, info: CheckpointCommitInfo):
        self.tag = info.tag
        return self.inner.create(info)

    def save(self, state_dict, path: str):
        copied, ready = self.host_copy(state_dict, os.path.basename(path))
        checkpoint_tag = self.tag

        def write():
            ready()
            self.inner.save(copied, path)
            inject_fault("kill-mid-write", checkpoint_tag)

        self.writer.submit(write)


def written_marker(path: str, rank: int) -> str:
    """The file rank ``rank`` writes into the checkpoint directory ``path`` once its files are written."""
    return os.path.join(path, f"written-rank{rank}")


def wait_for_ranks(path: str, world: int, timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Rank 0's completer: block until every rank's ``written-rank<r>`` is in ``path``. A rank whose write failed
    stops the run by its own error; the timeout only bounds a wait for a rank that vanished otherwise."""
    deadline = None
    while True:
        missing = [r for r in range(world) if not os.path.exists(written_marker(path, r))]
        if not missing:
            return
        deadline = deadline or time.monotonic() + timeout_s
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: rank {missing[0]} did not finish writing its checkpoint files within "
                               f"{timeout_s:g} s of rank 0; the checkpoint is not marked complete (is that rank's "
                               "disk full or its process gone?)")
        time.sleep(0.05)


def inject_fault(kind: str, checkpoint_tag: str) -> None:
    """Fault injection for the tests and bench/chaos_soak.py: ``PIPELINE_FAULT=<kind>:<step>[:<rank>]`` kills this
    process (SIGKILL) when it reaches ``kind`` in the checkpoint of that step, on every rank or on rank ``rank``
    alone: ``kill-before-marker`` (every file written, no ``COMPLETE``) or, with ``checkpoint.async_save``,
    ``kill-mid-write`` (the writer thread, after the step's first file)."""
    kind_, step, rank = (os.environ.get("PIPELINE_FAULT", "").split(":") + ["", ""])[:3]
    if kind_ == kind and step.isdigit() and tag(int(step)) == checkpoint_tag and rank in ("", os.environ.get("RANK")):
        os.kill(os.getpid(), signal.SIGKILL)
