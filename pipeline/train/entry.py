"""A training process from start to exit status, behind ``launch/train.py``: the configs, the checks a rank makes
alone, the rendezvous, the preflight every rank agrees on, the :class:`~pipeline.train.trainer.Trainer`, and one
message per failure; or, with ``--check``, the checks alone (:mod:`pipeline.train.check`).

Nothing heavy is imported at module level: the launcher installs the stop signals before this module imports
torch and DeepSpeed, so a signal during the imports stops cleanly too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

from pipeline.train.deepspeed_import import skip_autotuner_mlflow
from pipeline.train.distributed import exit_without_teardown, single_process_env
from pipeline.train.signals import StopRequest

skip_autotuner_mlflow()  # a rank of `python -m pipeline.train.entry` (the sweep's local runs) has no launch/_repo.py

CONFIG_ERROR, FAILED, DIVERGED = 2, 1, 3  # exit statuses besides 0
USAGE = """Train with DeepSpeed: ``deepspeed launch/train.py --config ds_configs/zero3.json [--experiment FILE.yaml] [--set k=v ...]``.
Check a run without training (no GPU needed, nothing written): the same command with ``--check [--gpu h100 --nodes 4]``.

Without ``--experiment`` it runs the embedded default: a tiny Llama-style model trained with CLM on shards of the
sample corpus (built on first use), on CPU in a few minutes. See README.md and docs/training.md.
"""


def run(ds_config: str, experiment: str | None, overrides: list[str], stop: StopRequest,
        check: tuple[str | None, int, int | None] | None = None) -> int:
    """Train the experiment (``experiment`` YAML with ``--set`` ``overrides``; None: the embedded sample
    experiment) with the DeepSpeed JSON ``ds_config``; returns the exit status. ``check``: (GPU, nodes, GPUs per
    node) of ``--check``, which runs the checks alone (:mod:`pipeline.train.check`)."""
    if single_process_env() and check is None:
        print("no launcher (RANK/WORLD_SIZE unset): training on one rank; for N GPUs run "
              "deepspeed --num_gpus N launch/train.py ...", file=sys.stderr, flush=True)
    rank = int(os.environ["RANK"])
    from pipeline.config import ConfigError
    from pipeline.experiment import load_experiment
    from pipeline.train.ds_config import load_ds_config

    try:
        exp = load_experiment(experiment, overrides)
        ds = load_ds_config(ds_config)
    except ConfigError as e:
        stop.failing()  # another rank's exit makes the launcher signal this one: the config error must still show
        if rank == 0:  # every rank reads the same files: one message is enough
            print(f"config error: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR
    stop.config_checked(exp.run_dir)
    if check is not None:
        return checked(exp, ds, rank, check, stop)
    local = local_checks(exp, ds, rank, stop)
    if local is None:
        return CONFIG_ERROR
    # DeepSpeed still calls the torch.distributed collectives that torch 2.13 renamed; one warning per call
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    started = time.time()
    import torch.distributed as dist

    from pipeline.train import errors
    from pipeline.train.distributed import PortTaken, start_distributed
    from pipeline.train.guard import Diverged
    from pipeline.train.preflight import agreed_preflight
    from pipeline.train.trainer import Trainer

    try:
        device, rank, world = start_distributed()
    except (PortTaken, ConfigError) as e:  # the port, or TORCH_CUDA_ARCH_LIST
        stop.failing()
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR
    with contextlib.ExitStack() as held:  # rank 0's lock of the run directory, released once, however the run ends
        prepared = agreed_preflight(exp, rank, world, device.type == "cuda", held, local, on_failure=stop.failing)
        if prepared is None:
            return CONFIG_ERROR
        try:
            for note in prepared.notes:
                print(note, file=sys.stderr, flush=True)
            Trainer.build(prepared, stop, device).fit()
        except Diverged as e:
            stop.failing()
            errors.report(e, exp.run_dir, rank, started, prefix="diverged")
            return DIVERGED
        except BaseException as e:  # noqa: BLE001 - every failure becomes one message and a log file
            stop.failing()
            errors.report(e, exp.run_dir, rank, started)
            return FAILED
    dist.destroy_process_group()
    return 0


def local_checks(exp, ds: dict, rank: int, stop: StopRequest):
    """This rank's :func:`~pipeline.train.preflight.local_preflight` (the DeepSpeed JSON ``ds`` resolved against
    the experiment among its checks), before any process group and, where they need neither, before torch and
    DeepSpeed (:mod:`~pipeline.train.first_checks`): the Prepared, or the failure for the agreed preflight to report
    (rank 0's is reported now, and the rank returns None: the launcher then stops the others while they start
    up)."""
    from pipeline.train.agreement import failure_line
    from pipeline.train.first_checks import first_checks

    world = int(os.environ["WORLD_SIZE"])
    try:
        first_checks(exp, rank, world)
        import torch

        from pipeline.train.preflight import local_preflight

        return local_preflight(exp, rank, world, torch.cuda.is_available(), ds)
    except Exception as e:  # noqa: BLE001 - one line, whatever failed
        if rank != 0:  # rank 0 may pass (files differ between nodes): the agreed preflight reports this one
            return e
        stop.failing()
        print(failure_line(e), file=sys.stderr, flush=True)
        return None


def checked(exp, ds: dict, rank: int, check: tuple[str | None, int, int | None], stop: StopRequest) -> int:
    """``--check``: the report (rank 0 prints it) and 0, or one line and :data:`CONFIG_ERROR`."""
    from pipeline.train.agreement import failure_line
    from pipeline.train.first_checks import first_checks

    try:
        first_checks(exp, rank, None)
        from pipeline.train.check import report, target

        lines = report(exp, ds, target(*check))
    except Exception as e:  # noqa: BLE001 - one line, whatever failed
        stop.failing()
        if rank == 0:
            print(failure_line(e), file=sys.stderr, flush=True)
        return CONFIG_ERROR
    if rank == 0:
        print("\n".join([*lines, "check passed: no engine built, no shards built, nothing written"]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    stop = StopRequest(int(os.environ.get("RANK", 0)))  # first: a signal during the imports stops cleanly too
    try:
        args = parse_args(argv)
        return run(args.config, args.experiment, args.overrides, stop,
                   (args.gpu, args.nodes, args.gpus_per_node) if args.check else None)
    finally:
        stop.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/zero3.json", help="DeepSpeed JSON (fields may be \"auto\")")
    p.add_argument("--experiment", default=None, help="experiment YAML (default: the embedded sample experiment)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment field, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--check", action="store_true",
                   help="check the run and exit (0, or 2 with one line) without training: the config, shards, "
                        "tokenizer, resume point, budget and memory; no GPU needed, nothing written")
    p.add_argument("--gpu", help="with --check: the cluster's GPU for the memory estimate (h100, h200, a100, ...; "
                                 "default: the GPU here, none: a CPU run)")
    p.add_argument("--nodes", type=int, default=1, help="with --check: nodes of the run (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --check: ranks per node (default: the GPUs here, else 8 for a named --gpu, else the "
                        "launcher's ranks)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    args = p.parse_args(argv)
    if not args.check and (args.gpu or args.nodes != 1 or args.gpus_per_node):
        p.error("--gpu, --nodes and --gpus-per-node describe the cluster for --check; add --check (a run's ranks "
                "come from the launcher)")
    return args


if __name__ == "__main__":  # python -m pipeline.train.entry, as the sweep's local runs start it
    exit_without_teardown(main())
