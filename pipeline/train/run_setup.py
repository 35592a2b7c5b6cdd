"""The run directory and where the run starts, checked before anything is built: ``run_dir`` writable
(:func:`check_run_dir`) and not in use (:func:`check_run_dir_free`), then locked for the run (:func:`lock_run_dir`);
the checkpoint a resume starts from with its global batch (:func:`resume_point`) and what else it must share with
this run (:func:`check_resumable`), and the half-written checkpoints a killed run left (:func:`half_written`)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.data.format.index import ShardKind
from pipeline.experiment import ExperimentConfig
from pipeline.inputs import builds_other_shards
from pipeline.lock import DirLock, describe
from pipeline.run_dir import DATA, MODEL_CONFIG, RunDir
from pipeline.safe_load import check_directory, check_links

# the keys of a model config that fix its parameters' shapes: a checkpoint loads only into a model that has its
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts")


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint, which the run resumes from."""

    step: int
    world_size: int  # the ranks that wrote it (another count loads it through the universal format)


def check_run_dir(run_dir: str) -> None:
    """``run_dir`` can be made and written by this user; checked where it exists, else on its nearest existing
    parent, so a refused start leaves no directory behind."""
    existing = os.path.abspath(run_dir)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir: {run_dir} is not writable ({e.strerror}); set run_dir to a directory this "
                          f"user can write (--set run_dir=...)") from None


def check_run_dir_free(run_dir: str) -> None:
    """No other run holds ``run_dir``'s lock (:class:`~pipeline.lock.LockHeld` naming it); takes nothing."""
    DirLock(RunDir(run_dir).lock, f"run directory {run_dir}").check_free()


def lock_run_dir(run_dir: str, held: contextlib.ExitStack) -> list[str]:
    """Make and lock ``run_dir`` until ``held`` closes (the entry's ``with``: one release, however the run ends);
    the note of a lock taken over from a run that died holding it. A directory this start made and left holding
    nothing but its lock (a start refused after the lock) is removed on that release."""
    created = not os.path.exists(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    if created:
        held.callback(_remove_if_only_locked, run_dir)  # pushed before the lock: runs after its release
    lock = held.enter_context(DirLock(RunDir(run_dir).lock, f"run directory {run_dir}"))
    return [f"note: took over the lock of {run_dir} from a run that ended without releasing it: "
            f"{describe(lock.stale)}"] if lock.stale else []


def _remove_if_only_locked(run_dir: str) -> None:
    if os.listdir(run_dir) == [os.path.basename(RunDir(run_dir).lock)]:
        os.unlink(RunDir(run_dir).lock)
        os.rmdir(run_dir)


def batch_keeping(global_batch: int, world: int, micro_batch: int) -> tuple[int, int] | None:
    """(micro-batch, accumulation) that make ``global_batch`` on ``world`` ranks: ``micro_batch`` where it divides
    a rank's share, else the largest smaller one that does (the memory a micro-step needs stays within today's);
    None when ``world`` does not divide it."""
    if global_batch % world:
        return None
    share = global_batch // world
    micro = max(m for m in range(1, min(micro_batch, share) + 1) if share % m == 0)
    return micro, share // micro


def resume_point(exp: ExperimentConfig, world: int | None, scan: bool = True) -> ResumePoint | None:
    """The newest complete checkpoint a resume starts from (None: a fresh start, or ``checkpoint.resume: false``),
    its directory checked (links, code in files, parameter names: :func:`~pipeline.safe_load.check_directory`; its
    links alone without ``scan``, before torch: :mod:`pipeline.train.first_checks`, which reads only its JSON
    records). A resume that changes the global batch changes the optimisation: refused unless asked for (``world``
    None: the ranks are not known yet, not checked)."""
    run = RunDir(exp.run_dir)
    step = run.latest_complete() if exp.checkpoint.resume else None
    if step is None:
        return None
    (check_directory if scan else check_links)(run.checkpoint(step))  # before any file of it is read
    point = ResumePoint(step, run.checkpoint_world_size(step))
    if exp.checkpoint.allow_global_batch_change or world is None:
        return point
    path = run.checkpoint(step)
    saved_train = run.checkpoint_experiment(step).train
    saved = saved_train.global_batch(point.world_size)
    t = exp.train
    now = t.global_batch(world)
    if saved != now:
        keep = batch_keeping(saved, world, t.micro_batch)
        fix = f"set train.micro_batch={keep[0]} train.grad_accum={keep[1]} to keep it, or " if keep else \
            f"no micro-batch x accumulation on {world} ranks makes {saved}; "
        raise ConfigError(f"checkpoint.allow_global_batch_change: {path} was trained with a global batch of {saved} "
                          f"(micro_batch {saved_train.micro_batch} x grad_accum {saved_train.grad_accum} x "
                          f"{point.world_size} ranks), this run has {now} (micro_batch {t.micro_batch} x grad_accum "
                          f"{t.grad_accum} x {world} ranks); {fix}set checkpoint.allow_global_batch_change=true "
                          f"to resume with the new batch")
    return point


def check_resumable(exp: ExperimentConfig, point: ResumePoint, model_config: dict | None,
                    shards: dict[str, tuple[str, str | None]]) -> None:
    """The checkpoint this run resumes from (``point``) was trained on what a resume cannot change: the same shards
    (``shards``: (directory, fingerprint) of data.shards, ``packed``, and of each phase's own, ``phases[i]``, when
    the run starts, built or to be built; a phase's own where the checkpoint records them), a model of the same
    shape (``model_config``, this run's) and LoRA rank, the same objectives in each phase. Else a ConfigError naming
    the run directory, the difference and a new name; the resume would otherwise fail only once the shards and the
    model are built, naming neither. A fingerprint or ``model_config`` of None is not known yet (before the
    tokenizer and the model's config are read: :mod:`pipeline.train.first_checks`) and not compared, but shards
    still to build from other inputs or at another length than the checkpoint's cannot be its shards."""
    run, d = RunDir(exp.run_dir), exp.data
    saved = run.checkpoint_experiment(point.step)
    differences = []
    record = run.checkpoint_run_file(point.step, DATA) or {}
    fingerprint = shards[ShardKind.PACKED.value][1]
    inputs = f" (from data.build_inputs {d.build_inputs})" if d.build_inputs else ""
    if record and fingerprint is not None and record["fingerprint"] != fingerprint:
        differences.append(f"on {record['directory']} (fingerprint {record['fingerprint'][:12]}), while this run's "
                           f"data.shards {d.shards}{inputs} has {fingerprint[:12]}")
    elif record and fingerprint is None and builds_other_shards(record["directory"], d.build_inputs, d.seq_len, d):
        differences.append(f"on {record['directory']} (fingerprint {record['fingerprint'][:12]}), while this run's "
                           f"data.shards {d.shards}{inputs} are to be built from other inputs or data.seq_len")
    for name, trained in sorted(record.get("phase_shards", {}).items()):  # none recorded: an older checkpoint
        now = shards.get(name)
        if now is None or now[1] not in (None, trained["fingerprint"]):
            differences.append(f"with {name}.shards {trained['directory']} (fingerprint {trained['fingerprint'][:12]}"
                               f"), while this run's " + (f"{name} reads data.shards" if now is None else
                                                         f"{name}.shards {now[0]} has {now[1][:12]}"))
    saved_config = run.checkpoint_run_file(point.step, MODEL_CONFIG) or {}
    model_config = model_config or {}
    shape = [k for k in SHAPE_KEYS if k in saved_config and k in model_config and saved_config[k] != model_config[k]]
    if shape:
        differences.append(f"with a model of {', '.join(f'{k} {saved_config[k]}' for k in shape)}, while this run's "
                           f"({exp.model.init}) has {', '.join(f'{k} {model_config[k]}' for k in shape)}")
    if saved.model.lora.r != exp.model.lora.r:
        differences.append(f"with model.lora.r {saved.model.lora.r}, while this run has {exp.model.lora.r}")
    objectives = [[[o.name for o in p.objectives] for p in e.phases] for e in (saved, exp)]
    if objectives[0] != objectives[1]:
        differences.append(f"with the objectives {objectives[0]}, while this run has {objectives[1]}")
    if differences:
        key = "name" if os.path.normpath(exp.run_dir) == os.path.join("runs", exp.name) else "run_dir"
        raise ConfigError(f"{key}: {exp.run_dir} holds run {saved.name}'s checkpoint of step {point.step}, trained "
                          f"{'; '.join(differences)}, which this run cannot resume; start a new run with --set "
                          f"{key}=NEW, or resume with that run's settings")


def half_written(run_dir: str) -> tuple[int, ...]:
    """Steps whose checkpoint directory has no ``COMPLETE``: a killed run's, which this run writes again (and drops
    first: see :meth:`~pipeline.train.checkpoint.Checkpointer.resume`)."""
    run = RunDir(run_dir)
    complete = set(run.complete_steps())
    return tuple(step for step in run.checkpoint_steps() if step not in complete)
