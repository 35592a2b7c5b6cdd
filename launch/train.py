"""Train with DeepSpeed: ``deepspeed launch/train.py --config ds_configs/zero3.json [--experiment FILE.yaml] [--set k=v ...]``.

Without ``--experiment`` it runs the embedded default: a tiny Llama-style model trained with CLM on shards of the
sample corpus (built on first use), on CPU in a few minutes. See README.md and docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import warnings

from pipeline.train.signals import StopRequest  # light: nothing heavy is imported before it works


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


def main(argv: list[str] | None = None) -> int:
    stop = StopRequest(int(os.environ.get("RANK", 0)))  # first: a signal during the imports stops cleanly too
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/zero3.json", help="DeepSpeed JSON (fields may be \"auto\")")
    p.add_argument("--experiment", default=None, help="experiment YAML (default: the embedded sample experiment)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment field, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    args = p.parse_args(argv)
    if single_process_env():
        print("no launcher (RANK/WORLD_SIZE unset): training on one rank; for N GPUs run "
              "deepspeed --num_gpus N launch/train.py ...", file=sys.stderr, flush=True)
    rank = int(os.environ["RANK"])
    from pipeline.config import ConfigError
    from pipeline.train.ds_config import load_ds_config
    from pipeline.train.experiment import load_experiment

    try:
        exp = load_experiment(args.experiment, args.overrides)
        ds = load_ds_config(args.config)
    except ConfigError as e:
        if rank == 0:  # every rank reads the same files: one message is enough
            print(f"config error: {e}", file=sys.stderr)
        return 2
    # DeepSpeed still calls the torch.distributed collectives that torch 2.13 renamed; one warning per call
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    started = time.time()
    from pipeline.train import errors
    from pipeline.train.guard import Diverged
    from pipeline.train.loop import start_distributed, train

    device, rank, world = start_distributed()
    prepared = agreed_preflight(exp, rank, world)
    if prepared is None:
        return 2
    try:
        for note in prepared.notes:
            print(note, file=sys.stderr, flush=True)
        train(exp, ds, prepared, stop, device)
    except Diverged as e:
        errors.report(e, exp.run_dir, rank, started, prefix="diverged")
        return 3
    except BaseException as e:  # noqa: BLE001 - every failure becomes one message and a log file
        errors.report(e, exp.run_dir, rank, started)
        return 1
    finally:
        if prepared.lock is not None:
            prepared.lock.release()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def agreed_preflight(exp, rank: int, world: int):
    """Run the checks of :mod:`pipeline.train.preflight` on every rank; when any rank fails, rank 0 prints the
    first failure once and every rank returns None."""
    import torch.distributed as dist

    from pipeline.config import ConfigError
    from pipeline.train import errors
    from pipeline.train.preflight import preflight

    prepared, failure = None, None
    try:
        prepared = preflight(exp, rank, world)
    except Exception as e:  # noqa: BLE001 - reported below, once
        kind = "config error" if isinstance(e, ConfigError) else "error"
        failure = (kind, errors.one_line(e))
    failures: list = [None] * world
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return prepared
    if rank == 0:
        print(f"{first[0]}: {first[1]}", file=sys.stderr, flush=True)
    if prepared is not None and prepared.lock is not None:
        prepared.lock.release()
    return None


def exit_without_teardown(rc: int) -> None:
    """Leave a finished rank without interpreter teardown. DeepSpeed keeps references to its gloo process groups
    past ``destroy_process_group()``, so their threads still run when the interpreter frees modules at exit, and
    now and then a rank of a finished run aborted there ("terminate called without an active exception"; one
    sweep of 36 smoke runs met it once), which the launcher reports as a failed run. Everything the run writes
    is closed by the time ``main`` returns; only the streams need flushing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_without_teardown(main())
