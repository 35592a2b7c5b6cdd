"""The one checkpoint path: DeepSpeed engine state + our client state (:class:`~pipeline.train.state.TrainState`)
+ a completion marker.

Layout (:class:`pipeline.run_dir.RunDir`): ``RUN/checkpoints/step{N:08d}/`` holds DeepSpeed's files, ``rng-rank{r}.pt`` per rank, and ``COMPLETE``
(written by rank 0 once every rank has finished writing: after a barrier, or with ``checkpoint.async_save`` when
every rank's ``written-rank{r}`` is there). A directory without ``COMPLETE`` is a half-written checkpoint and is
never resumed from; DeepSpeed's ``latest`` file is not trusted.

Resuming on another world size: ZeRO-3 files hold one flat partition per rank, so DeepSpeed refuses them at another
data-parallel size. When the marker's ``world_size`` differs from the current one, rank 0 converts the checkpoint
once into DeepSpeed's universal format (``step{N}/universal/``: fp32 weights and Adam moments per parameter) and
every rank loads its new partition from there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import math
import os
import random
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from pipeline.io import read_json, write_json_atomic
from pipeline.run_dir import MARKER, RunDir, tag
from pipeline.safe_load import load_weights_only
from pipeline.train.async_checkpoint import (
    AsyncCheckpointEngine,
    BackgroundWriter,
    inject_fault,
    wait_for_ranks,
    written_marker,
)
from pipeline.train.run_setup import ResumePoint
from pipeline.train.state import TrainState

if TYPE_CHECKING:
    from pipeline.train.plan import CheckpointSpec

UNIVERSAL = "universal"  # sub-directory of a step with its universal-format copy


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, run: RunDir, step: int, client_state: dict, extra_files: dict[str, dict], keep_last: int,
         keep_every: int, writer: BackgroundWriter | None = None, completer: BackgroundWriter | None = None,
         best: dict | None = None) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory; ``best``: the record of
    ``checkpoint.keep_best``'s step (step, value, metric, mode), whose checkpoint pruning spares besides ``keep_last``
    and ``keep_every`` and :func:`mark_best` marks. With ``writer`` (the engine's
    :class:`~pipeline.train.async_checkpoint.AsyncCheckpointEngine` queues its files there) it returns once the
    state is copied: the files and each rank's ``written-rank<r>`` follow in the background, and rank 0's
    ``completer`` writes ``COMPLETE`` once every rank's marker is there."""
    root, path = run.checkpoints, run.checkpoint(step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        engine.save_checkpoint(root, tag=tag(step), client_state=client_state)
        rng = os.path.join(path, f"rng-rank{rank}.pt")
        if writer is None:
            torch.save(rng_state(), rng)
        else:
            writer.submit(functools.partial(torch.save, rng_state(), rng))
    except (OSError, RuntimeError) as e:
        if _disk_full(e, root):
            raise _disk_full_error(run, step) from e
        raise
    complete = functools.partial(_complete, run, step, extra_files, world, keep_last, keep_every, best)
    if writer is not None:
        writer.submit(lambda: write_json_atomic(written_marker(path, rank), {"step": step}))
        if completer is not None:
            completer.submit(lambda: (wait_for_ranks(path, world), complete()))
        return path
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        complete()
    if dist.is_initialized():
        dist.barrier()
    return path


def _complete(run: RunDir, step: int, extra_files: dict[str, dict], world: int, keep_last: int,
              keep_every: int, best: dict | None = None) -> None:
    """Rank 0, once every rank's files of ``step`` are written: the run files, ``COMPLETE``, then pruning and the
    best's mark."""
    path = run.checkpoint(step)
    inject_fault("kill-before-marker", tag(step))
    for name, obj in extra_files.items():
        write_json_atomic(os.path.join(path, name), obj)
    write_json_atomic(os.path.join(path, MARKER), {"step": step, "time": time.time(), "world_size": world})
    prune(run, keep_last, keep_every, (best["step"],) if best else ())
    mark_best(run, best)


def mark_best(run: RunDir, best: dict | None) -> None:
    """``BEST`` (the record: step, value, metric, mode) in the best step's checkpoint directory and in no other, so
    the directory says which one it is (:meth:`RunDir.best`); none after ``checkpoint.keep_best`` was dropped or
    changed. The new mark is written before the old one goes (a kill between leaves two, the newer the best), and
    only when it changes: its time is when the step became the best, which an ``hf-best`` exported since is of."""
    mark = best and run.best_mark(best["step"])
    if best and not (os.path.isfile(mark) and read_json(mark) == best):
        write_json_atomic(mark, best)
    for step in run.checkpoint_steps():
        if not best or step != best["step"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(run.best_mark(step))


def _disk_full_error(run: RunDir, step: int) -> OSError:
    """A full disk while saving ``step``, naming the checkpoint still intact."""
    previous = run.latest_complete()
    kept = f"the checkpoint of step {previous} is intact" if previous is not None else "no earlier checkpoint"
    return OSError(errno.ENOSPC, f"no space left on device: {run.checkpoint(step)} (checkpoint of step {step}); "
                                 f"{kept}: free space and start the same command again")


def _disk_full(e: BaseException, root: str) -> bool:
    """torch.save reports a full disk as a RuntimeError without errno ("file write failed", "unexpected pos"), so
    a save that failed on a disk with less than 1 MiB left counts as a full disk too."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return shutil.disk_usage(root).free < 1 << 20


def prune(run: RunDir, keep_last: int, keep_every: int, spare: tuple[int, ...] = ()) -> None:
    """Keep the newest ``keep_last`` complete checkpoints, every ``keep_every``-th step and the steps ``spare``;
    drop the rest and any incomplete directory older than the newest complete one."""
    steps = run.complete_steps()
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    keep |= set(spare)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    newest = steps[-1] if steps else -1
    for step in run.checkpoint_steps():
        if step not in keep and step <= newest:
            shutil.rmtree(run.checkpoint(step), ignore_errors=True)


def to_universal(path: str) -> str:
    """Convert the checkpoint directory ``path`` into DeepSpeed's universal format in ``path/universal`` (once;
    the conversion writes to a temporary directory and renames it, so a killed conversion is redone). Its marker
    names the checkpoint it was made from (the step's ``COMPLETE``): a universal copy made from another checkpoint
    (another run's step, copied in) is made again."""
    from deepspeed.checkpoint import ds_to_universal

    out = os.path.join(path, UNIVERSAL)
    source = {"converted_from": os.path.basename(path), "complete": read_json(os.path.join(path, MARKER))}
    made = os.path.join(out, MARKER)
    if os.path.isfile(made) and {k: v for k, v in read_json(made).items() if k in source} == source:
        return out
    tmp = f"{out}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # one worker: the conversion runs inside a training process, where forking worker processes is unsafe
    ds_to_universal.main(argparse.Namespace(input_folder=path, output_folder=tmp, num_extract_workers=1,
                                            num_merge_workers=1, keep_temp_folder=False, strict=True,
                                            inject_missing_state=False))
    os.remove(os.path.join(path, "latest_universal"))  # written beside the output; we name the tag ourselves
    write_json_atomic(os.path.join(tmp, MARKER), source | {"time": time.time()})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _load_universal(engine, path: str):
    """Load ``path/universal`` into an engine of any data-parallel size.

    DeepSpeed reads its ``load_universal`` setting only while loading, so it is switched on just for this load
    (putting it in the config would need the resume step before the engine exists). Two repairs after its ZeRO-3
    loader: it copies the hyper-parameters of the first optimizer param group into every group (weight decay on
    the norms), so each group gets its own saved values back; and it gives every group's Adam state the same
    ``step`` tensor, which torch's Adam increments in place, so the step would advance once per group and skew
    the bias correction; each group gets its own copy.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:  # preflight's check_directory of the checkpoint came first (resume_point): both unpickle
        to_universal(path)
    if dist.is_initialized():
        dist.barrier()
    engine._config.load_universal_checkpoint = True
    try:
        load_path, client = engine.load_checkpoint(path, tag=UNIVERSAL, load_module_strict=True)
    finally:
        engine._config.load_universal_checkpoint = False
    saved = load_weights_only(os.path.join(path, UNIVERSAL, "zero", "optimizer_state.pt"))["param_groups"]
    optimizer = engine.optimizer.optimizer
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError(f"{path}: the checkpoint has {len(saved)} optimizer param groups, the model "
                           f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    return load_path, client


def load(engine, run: RunDir, step: int, saved_world: int) -> dict:
    """Collective. Restores the engine (weights, optimizer, lr scheduler) from the complete checkpoint of ``step``,
    written by ``saved_world`` ranks, and this rank's RNG; returns client state. A checkpoint written by another
    number of ranks goes through the universal format (see the module doc)."""
    path = run.checkpoint(step)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if saved_world == world:
        load_path, client = engine.load_checkpoint(run.checkpoints, tag=tag(step), load_module_strict=True)
    else:
        load_path, client = _load_universal(engine, path)
    if load_path is None:
        raise RuntimeError(f"{path}: DeepSpeed could not load this checkpoint (files missing?)")
    restore_rng(path, dist.get_rank() if dist.is_initialized() else 0)
    return client


def restore_rng(path: str, rank: int) -> None:
    """This rank's RNG states from the checkpoint directory ``path`` (without running code from the file)."""
    rng_file = os.path.join(path, f"rng-rank{rank}.pt")
    if os.path.exists(rng_file):  # absent for a rank the saved run did not have: its RNG keeps the seeded start
        set_rng_state(load_weights_only(rng_file))


@dataclasses.dataclass(frozen=True)
class Best:
    """The step whose ``checkpoint.keep_best`` metric is the best so far, and that value."""

    step: int
    value: float


class Checkpointer:
    """The trainer's checkpoints: resume from the newest complete one, save at a step, and remember the last step
    saved. ``run_files`` (the run's description) are written into every checkpoint. With ``checkpoint.async_save``
    the engine's files are written in the background (:mod:`pipeline.train.async_checkpoint`): a save waits only for
    the previous one's writes, and :meth:`wait` for the last. With ``spec.keep`` (``checkpoint.keep_best`` as
    preflight decided it) it follows the best step (:meth:`observe`), spares its checkpoint from pruning and carries
    it in the client state with its metric and direction, so a resumed run with the same setting knows it."""

    def __init__(self, engine, run: RunDir, spec: CheckpointSpec, run_files: dict[str, dict]):
        self.engine, self.run, self.spec, self.run_files = engine, run, spec, run_files
        self.last_saved = 0
        self.keep, self.best = spec.keep, None
        self.writer = self.completer = None
        if spec.async_save:
            self.writer = BackgroundWriter()  # this rank's files, then its written-rank<r>
            self.completer = BackgroundWriter() if not dist.is_initialized() or dist.get_rank() == 0 else None
            engine.checkpoint_engine = AsyncCheckpointEngine(engine.checkpoint_engine, self.writer)

    def resume(self, state: TrainState, point: ResumePoint | None, half_written: tuple[int, ...] = ()) -> bool:
        """Collective. Drop the ``half_written`` checkpoint directories, then load the checkpoint ``point`` into the
        engine and ``state`` (both as preflight found them); False for a fresh start (``point`` None). The saved
        best counts only when it was chosen by this run's metric in this run's direction: after a change of
        ``checkpoint.keep_best`` (or its mode, or none now) the old best is neither spared nor exported."""
        self._drop_half_written(half_written)
        if point is None:
            return False
        client = load(self.engine, self.run, point.step, point.world_size)
        state.load_state_dict(client)
        saved = client.get("best") or {}
        if self.keep is not None and (saved.get("metric"), saved.get("mode")) == (self.keep.metric, self.keep.mode):
            self.best = Best(saved["step"], saved["value"])
        self.last_saved = state.step
        return True

    def observe(self, step: int, phase: int, scalars: dict[str, float]) -> None:
        """A healthy step's validation scalars, in phase ``phase``: the step becomes the best when the metric beats
        the best so far (a tie keeps the earlier step; a value that is not finite never wins). A phase that does not
        log the metric (preflight named it), or a validation that left it out with nothing to score, has no
        candidate."""
        keep = self.keep
        if keep is None or phase not in keep.phases:
            return
        if keep.metric not in scalars:
            if keep.sometimes:
                return
            raise ValueError(f"checkpoint.keep_best: {keep.metric} was not logged at step {step}; the validation "
                             f"logs {sorted(k for k in scalars if k.startswith('eval/'))}")
        value = float(scalars[keep.metric])
        if not math.isfinite(value):
            return
        if self.best is None or (value > self.best.value if keep.mode == "max" else value < self.best.value):
            self.best = Best(step, value)

    def _drop_half_written(self, steps: tuple[int, ...]) -> None:
        """Collective: rank 0 removes the checkpoint directories without ``COMPLETE`` (``steps``) that a killed run
        left. This run writes those steps again, and a ``written-rank<r>`` left in one would count as that rank's
        new files written: rank 0 would mark the new checkpoint complete while its files were still being written."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            for step in steps:
                shutil.rmtree(self.run.checkpoint(step), ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def save(self, state: TrainState) -> None:
        """Collective: the engine and ``state`` at its step."""
        self._written()  # one state in host memory at a time, and the previous save's errors surface here
        best = dataclasses.asdict(self.best) | {"metric": self.keep.metric, "mode": self.keep.mode} if self.best else None
        save(self.engine, self.run, state.step, state.state_dict() | ({"best": best} if best else {}), self.run_files,
             self.spec.keep_last, self.spec.keep_every, self.writer, self.completer, best)
        self.last_saved = state.step

    def wait(self) -> None:
        """Collective: return once the last save is complete (a no-op without ``checkpoint.async_save``). Each rank
        waits for its own files first and raises its own error, so a rank whose write failed leaves the barrier
        and the others stop there instead of waiting for its marker."""
        if self.writer is None:
            return
        self._written()
        if dist.is_initialized():
            dist.barrier()
        if self.completer is not None:
            self.completer.wait()

    def _written(self) -> None:
        """This rank's files of the last save written; a full disk is the same error as in a synchronous save."""
        if self.writer is None:
            return
        try:
            self.writer.wait()
        except (OSError, RuntimeError) as e:
            if _disk_full(e, self.run.checkpoints):
                raise _disk_full_error(self.run, self.last_saved) from e
            raise

    def last_good(self) -> str | None:
        """The newest complete checkpoint directory, for messages."""
        step = self.run.latest_complete()
        return None if step is None else self.run.checkpoint(step)
