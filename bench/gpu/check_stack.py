"""Imports what training and bench_gpu.py import (and the modules named on the command line: reproduce_short.sh
names the reproduction driver, which evaluates too), then prints the stack's versions: run by run.sh before the
benchmark, so a missing package fails in seconds with its name rather than after the data prep."""

import importlib
import importlib.metadata
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
# the trainer (deepspeed, the model, the loader), data prep (zstandard) and FusedAdam's Python side
MODULES = ("deepspeed", "deepspeed.ops.adam", "pipeline.train.trainer", "pipeline.data.prep.build")


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    for module in (*MODULES, *sys.argv[1:]):
        importlib.import_module(module)
    import deepspeed
    import torch

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU"
    print(f"python {sys.version.split()[0]}; " + "; ".join(f"{d} {version(d)}" for d in (
        "torch", "transformers", "deepspeed", "triton")) + f"; {cuda}; deepspeed from {os.path.dirname(deepspeed.__file__)}",
        flush=True)


if __name__ == "__main__":
    main()
