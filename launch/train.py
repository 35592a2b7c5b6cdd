"""Train with DeepSpeed: ``deepspeed launch/train.py --config ds_configs/zero3.json [--experiment FILE.yaml] [--set k=v ...]``.

Without ``--experiment`` it runs the embedded default: a tiny Llama-style model trained with CLM on shards of the
sample corpus (built on first use), on CPU in a few minutes. See README.md and docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import ConfigError  # noqa: E402
from pipeline.train.ds_config import load_ds_config  # noqa: E402
from pipeline.train.experiment import load_experiment  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/zero3.json", help="DeepSpeed JSON (fields may be \"auto\")")
    p.add_argument("--experiment", default=None, help="experiment YAML (default: the embedded sample experiment)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment field, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    args = p.parse_args(argv)
    try:
        exp = load_experiment(args.experiment, args.overrides)
        ds = load_ds_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # DeepSpeed still calls the torch.distributed collectives that torch 2.13 renamed; one warning per call
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    import torch.distributed as dist

    from pipeline.train.loop import train

    train(exp, ds)
    dist.destroy_process_group()
    return 0


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
