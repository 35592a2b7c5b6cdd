"""Train with DeepSpeed: ``deepspeed launch/train.py --config ds_configs/zero3.json [--experiment FILE.yaml] [--set k=v ...]``.

Without ``--experiment`` it runs the embedded default: a tiny Llama-style model trained with CLM on shards of the
sample corpus (built on first use), on CPU in a few minutes. See README.md and docs/training.md.
"""

from __future__ import annotations

import argparse
import os

# light: nothing heavy is imported before the stop signals work
from pipeline.train.distributed import exit_without_teardown
from pipeline.train.entry import run
from pipeline.train.signals import StopRequest


def main(argv: list[str] | None = None) -> int:
    stop = StopRequest(int(os.environ.get("RANK", 0)))  # first: a signal during the imports stops cleanly too
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/zero3.json", help="DeepSpeed JSON (fields may be \"auto\")")
    p.add_argument("--experiment", default=None, help="experiment YAML (default: the embedded sample experiment)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment field, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    args = p.parse_args(argv)
    return run(args.config, args.experiment, args.overrides, stop)


if __name__ == "__main__":
    exit_without_teardown(main())
