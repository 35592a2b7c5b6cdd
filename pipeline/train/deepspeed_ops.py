"""Where DeepSpeed's JIT-built ops go: one folder per install and version, not one per user.

torch's extension builder keeps every op in one folder per user (``~/.cache/torch_extensions/py311_cpu/<op>``), named
by the op alone: a second install on the machine (another checkout, CI beside a developer's environment, a cluster's
shared home directory) loads the op that the first one built, and a DeepSpeed of another version fails on it (issue
43: ``module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'``). So each way the project starts DeepSpeed
(``launch/_repo.py``, which every launch script and so every rank imports first, whatever started it: DeepSpeed's
launcher, torchrun, srun; ``tests/conftest.py``; the benches; the trainer's ``start_distributed``) calls
:func:`use_install_ops_dir`, which sets ``TORCH_EXTENSIONS_DIR`` to this install's own folder unless the user set
one; child processes inherit it. ``python launch/build_ops.py`` builds the ops there ahead of a run (a cluster's
login node or a short GPU job, before the run's sbatch: docs/slurm.md). Every build reads TORCH_CUDA_ARCH_LIST in
the form DeepSpeed's builder can (:func:`arch_list_for_deepspeed`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import re
import sys
import time
from collections.abc import Callable

ENV = "TORCH_EXTENSIONS_DIR"
# what a run here JIT-builds first, by DeepSpeed accelerator: the CPU ranks' shared-memory collectives
# (deepspeed_shm_comm, at init_distributed); DeepSpeed's FusedAdam on CUDA (optim.fused: deepspeed)
DEFAULT_OPS = {"cpu": ["ShareMemCommBuilder"], "cuda": ["FusedAdamBuilder"]}


# No lock guards these two: a stop signal's handler (exit_after_builds) runs between two bytecodes of the thread it
# interrupts, which may be inside the wrappers below, so a lock they hold would be held against the handler for good.
# Each step is one operation on a builtin set or list (atomic under the GIL), ordered so that every interleaving
# runs a deferred exit exactly once and never while a build lock is held.
_held: set[str] = set()  # the build locks this process holds or is taking (track_build_locks)
_after_builds: list[Callable[[], None]] = []  # what runs once it holds none (exit_after_builds)


def track_build_locks() -> None:
    """Follow the lock file torch's extension builder (``torch.utils.file_baton.FileBaton``) holds while it builds
    or checks an op: every other process that needs the op waits for that file to go. A rank that exited at once
    while holding it (a stop in start-up exits with ``os._exit``: USR1 while the CPU collectives op loaded) left it
    behind for good, and every later start of the run waited on it; :func:`exit_after_builds` defers such an exit
    to the lock's release. The trainer's ``start_distributed`` calls this before DeepSpeed builds anything."""
    from torch.utils.file_baton import FileBaton

    if getattr(FileBaton, "tracked_by_pipeline", False):
        return
    acquire, release = FileBaton.try_acquire, FileBaton.release

    def try_acquire(self) -> bool:
        _held.add(self.lock_file_path)  # before the file exists: a stop in between is deferred, not lost
        got = False
        try:
            got = acquire(self)
        finally:
            if not got:
                _released(self.lock_file_path)
        return got

    def release_then_run_deferred(self) -> None:
        release(self)
        _released(self.lock_file_path)

    FileBaton.try_acquire, FileBaton.release = try_acquire, release_then_run_deferred
    FileBaton.tracked_by_pipeline = True


def _released(path: str) -> None:
    """``path`` is no longer held: with no build lock left, run what waited for that (each exit taken by one
    ``pop``, so the handler and this never both run it)."""
    _held.discard(path)
    while not _held:
        try:
            run = _after_builds.pop(0)
        except IndexError:
            return
        run()


def exit_after_builds(exit_now: Callable[[], None]) -> bool:
    """Hand ``exit_now`` to the release of the last build lock this process holds (:func:`track_build_locks`);
    False, with nothing done, when it holds none (the caller exits itself). Safe in a signal handler: it never
    waits (module comment above)."""
    _after_builds.append(exit_now)
    if _held:
        return True
    try:  # no lock held: take the exit back, unless a release took it first (then that release runs it)
        _after_builds.remove(exit_now)
    except ValueError:
        return True
    return False


def ops_dir_name(deepspeed: str, torch: str) -> str:
    """The folder of one DeepSpeed and torch pair (torch's local label, e.g. ``+cpu``, names its build)."""
    return f"deepspeed-{deepspeed}-torch-{torch}"


def install_ops_dir(prefix: str = sys.prefix) -> str | None:
    """``PREFIX/torch_extensions/deepspeed-V-torch-V`` for the environment at ``prefix`` (a venv's root); where the
    prefix is read-only (a cluster's shared environment), the user's cache, in a folder named by the install's path
    too. None without DeepSpeed: nothing to build."""
    try:
        name = ops_dir_name(importlib.metadata.version("deepspeed"), importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if os.access(prefix, os.W_OK):
        return os.path.join(prefix, "torch_extensions", name)
    install = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(os.path.join("~", ".cache"))
    return os.path.join(cache, "torch_extensions", f"{name}-{install}")


def use_install_ops_dir(env=os.environ) -> str | None:
    """Set ``env``'s TORCH_EXTENSIONS_DIR to :func:`install_ops_dir` unless it is set; returns where ops go (None
    without DeepSpeed and without the user's setting)."""
    if not env.get(ENV) and (ops := install_ops_dir()):
        env[ENV] = ops
    return env.get(ENV) or None


# One entry of TORCH_CUDA_ARCH_LIST: torch reads "9.0a" (Hopper's arch-specific features) or "10.0f" (a family),
# but DeepSpeed's op builder int()s each part of MAJOR.MINOR[+PTX] and stops on the suffix (issue 32: FusedAdam on an
# H200 image that sets 9.0a). Its ops use none of those features, so the plain MAJOR.MINOR builds the same code.
ARCH_ENTRY = re.compile(r"(\d+)\.(\d+)[af]?(\+PTX)?")


def deepspeed_arch_list(value: str) -> str:
    """``value`` (a TORCH_CUDA_ARCH_LIST, ``;`` or space separated) as DeepSpeed's JIT op builder can read it: each
    entry's ``a``/``f`` suffix dropped, duplicates once. An entry it cannot read is a ConfigError naming the fix."""
    from pipeline.config import ConfigError

    entries = []
    for entry in value.replace(" ", ";").split(";"):
        if not entry.strip():
            continue
        m = ARCH_ENTRY.fullmatch(entry.strip())
        if m is None:
            raise ConfigError(f"TORCH_CUDA_ARCH_LIST={value!r}: DeepSpeed's op builder reads each entry as "
                              f"MAJOR.MINOR[+PTX] and cannot read {entry.strip()!r}; set it to the GPU's compute "
                              f"capability, e.g. TORCH_CUDA_ARCH_LIST=9.0, or unset it")
        plain = f"{m[1]}.{m[2]}{m[3] or ''}"
        if plain not in entries:
            entries.append(plain)
    return ";".join(entries)


def arch_list_for_deepspeed(env=os.environ) -> None:
    """Rewrite ``env``'s TORCH_CUDA_ARCH_LIST (when set) to :func:`deepspeed_arch_list`'s form before DeepSpeed
    JIT-builds an op (FusedAdam, the ops the engine loads), saying so once when it changed."""
    value = env.get("TORCH_CUDA_ARCH_LIST", "")
    if value.strip() and (plain := deepspeed_arch_list(value)) != value:
        env["TORCH_CUDA_ARCH_LIST"] = plain
        print(f"TORCH_CUDA_ARCH_LIST={value!r} -> {plain!r} for DeepSpeed's op builds (it cannot read arch "
              f"suffixes)", file=sys.stderr, flush=True)


def build_ops(names: list[str]) -> str:
    """JIT-build (or load, when built) each of DeepSpeed's op builders ``names`` for this machine's DeepSpeed
    accelerator (DS_ACCELERATOR) into :func:`use_install_ops_dir`; returns the directory."""
    where = use_install_ops_dir()
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    arch_list_for_deepspeed()
    accelerator = get_accelerator()
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None:
            raise SystemExit(f"build_ops: DeepSpeed's {accelerator.device_name()} accelerator has no op builder "
                             f"{name!r}; name one of deepspeed.ops.op_builder's, e.g. {DEFAULT_OPS['cpu'][0]}")
        if isinstance(builder, CUDAOpBuilder) and not torch.cuda.is_available():
            raise SystemExit(f"build_ops: torch sees no GPU here, and DeepSpeed would build {name} without CUDA; "
                             f"build it on a GPU node: srun --nodes=1 --gpus=1 python launch/build_ops.py --op {name}")
        start = time.time()
        builder.load(verbose=False)
        print(f"{builder.NAME}: built or loaded in {time.time() - start:.0f} s, in {where}", flush=True)
    return where


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Build DeepSpeed's JIT ops into this install's own folder (TORCH_EXTENSIONS_DIR unless set: "
                    "PREFIX/torch_extensions/deepspeed-V-torch-V) before a run: CPU ops anywhere (a cluster's login "
                    "node), CUDA ops where torch sees a GPU (one short job on a GPU node): docs/slurm.md.")
    p.add_argument("--op", action="append", metavar="BUILDER",
                   help="a DeepSpeed op builder (repeatable), e.g. FusedAdamBuilder, CPUAdamBuilder; default: "
                        + "; ".join(f"{acc}: {', '.join(ops)}" for acc, ops in DEFAULT_OPS.items()))
    p.add_argument("--print-dir", action="store_true", help="print the folder and build nothing")
    args = p.parse_args(argv)
    if args.print_dir:
        print(use_install_ops_dir() or "no DeepSpeed installed: no ops folder")
        return 0
    from deepspeed.accelerator import get_accelerator

    build_ops(args.op or DEFAULT_OPS.get(get_accelerator().device_name(), []))
    return 0
